"""Issue 47's video workloads (bench/video.py): ``bench ticks --video-share`` records a vision
stage and the memory plan's bytes per video session; ``bench serve --video-share`` runs video
callers (MiniCPM-o dialect, mode=video, a frame a second) beside OpenAI callers against a real
tiny server with ``model.vision: true``, and both hear their replies."""
from __future__ import annotations

import json

import pytest
import torch

from duplexcache.bench import engine_ticks as et
from duplexcache.bench import video
from duplexcache.cli import main as cli_main
from duplexcache.config import DeployConfig
from duplexcache.runtime.bundle import build_models
from duplexcache.runtime.engine import DuplexEngine
from duplexcache.server.app import REALTIME_PATH, create_app
from duplexcache.server.loopback import LoopbackServer

torch.set_num_threads(1)
REPLY = (2, 3)
DURATION = 7


def test_video_sessions_are_spread_evenly_and_frames_differ_by_second():
    assert [video.is_video(i, 0.5) for i in range(4)] == [False, True, False, True]
    assert all(video.is_video(i, 1.0) for i in range(5)) and not any(video.is_video(i, 0.0) for i in range(5))
    assert video.frame_jpeg(0, 0) != video.frame_jpeg(0, 1) != video.frame_jpeg(1, 1)
    assert video.frame_jpeg(0, 0) == video.frame_jpeg(0, video.DISTINCT_FRAMES)


def test_bench_ticks_video_share_records_a_vision_stage_and_bytes(tmp_path):
    cfg = et.TickBenchConfig("tiny", "cpu", (2,), ticks=2, warmup_ticks=1, video_share=1.0)
    assert et.make_deploy(cfg).model.vision is True
    assert et.make_deploy(et.TickBenchConfig("tiny", "cpu", (2,))).model.vision is False
    results = et.run_benchmark(cfg, tmp_path)
    (run,) = results["runs"]
    assert run["status"] == "ok", run["note"]
    assert all(v > 0 for v in run["per_tick_s"]["vision"])   # every recorded tick encoded frames
    assert run["video"]["sessions"] == 2
    b = run["video"]["bytes_per_session"]
    assert b["video"] > b["audio"] > 0 and b["thinker_tokens_per_frame"] == 66
    md = (tmp_path / "results.md").read_text()
    assert "2 video sessions" in md and "| vision ms |" in md


def test_bench_serve_video_callers_beside_openai_callers(tmp_path):
    deploy = DeployConfig.default("tiny")
    deploy.engine.speak_policy.mode = "reply"
    deploy.engine.speak_policy.reply_min_units, deploy.engine.speak_policy.reply_max_units = REPLY
    deploy.engine.tick_seconds = 0.25
    deploy.engine.tick_headroom = 1e9
    deploy.model.vision = True
    engine = DuplexEngine(deploy, build_models(deploy, seed=0))
    with LoopbackServer(create_app(engine, deploy)) as srv:
        argv = ["--url", srv.ws_url(REALTIME_PATH), "--sessions", "2", "--duration", str(DURATION),
                "--ramp", "0", "--user-units", "2,2", "--max-lead-units", "0", "--reply-min-units", str(REPLY[0]),
                "--reply-max-units", str(REPLY[1]), "--drain", "8", "--video-share", "0.5", "--out", str(tmp_path)]
        assert cli_main(["bench", "serve", *argv]) == 0
        frames = engine.vision_stage.frames_encoded
    results = json.loads((tmp_path / "results.json").read_text())
    (step,) = results["steps"]
    assert results["config"]["video_share"] == 0.5
    assert [row["dialect"] for row in step["per_session"]] == ["openai", "minicpmo-video"]
    for row in step["per_session"]:
        assert row["errors"] == [] and row["replies_done"] == row["replies_with_audio"] == 1, row
    assert frames >= DURATION - 1   # a frame with (nearly) every unit of the video caller
    assert "vision" in step["stage_ms_mean"], step["stage_ms_mean"]


@pytest.mark.parametrize("share", [-0.1, 1.5])
def test_a_video_share_outside_0_1_is_refused(share):
    with pytest.raises(ValueError, match="video_share"):
        et.TickBenchConfig("tiny", "cpu", (1,), video_share=share)
