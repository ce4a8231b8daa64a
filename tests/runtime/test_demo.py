"""`duplexcache demo` end to end: real server on loopback (or direct), WAVs and the table.

Nothing here depends on the machine's speed: the demo waits for ``response.done`` events, so a
slowed engine only makes it slower, and the stalled-engine test fails by the demo's own verdict.
"""
from __future__ import annotations

import argparse
import logging
import time
import wave

import pytest
import torch

from duplexcache import demo
from duplexcache.runtime.engine_api import ResponseDone

torch.set_num_threads(1)



@pytest.fixture(autouse=True)
def _admit_by_memory_only(monkeypatch):
    """Admission by time measures this machine's ticks: on a busy CI box it would refuse the
    demo's third session, so these tests admit by memory only (the demo's own default stays)."""
    real = demo.demo_deploy

    def deploy_without_compute_limit(config):
        deploy = real(config)
        deploy.engine.tick_headroom = 1e9
        return deploy

    monkeypatch.setattr(demo, "demo_deploy", deploy_without_compute_limit)


# one turn of 2 units: 24000 samples per unit, then the final chunk (the last 3 codes: 6 mel
# frames of 480 samples) and the 3840-sample vocoder tail
REPLY_FRAMES = 2 * 24000 + 6 * 480 + 3840


def _args(tmp_path, **kw) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    demo.add_arguments(parser)
    argv = ["--sessions", "3", "--seconds", "2", "--voices", "2", "--out", str(tmp_path / "out")]
    for key, value in kw.items():
        argv += [f"--{key}"] + ([] if value is True else [str(value)])
    return parser.parse_args(argv)


def _frames(path) -> int:
    with wave.open(str(path)) as w:
        assert (w.getframerate(), w.getnchannels(), w.getsampwidth()) == (24000, 1, 2)
        return w.getnframes()


@pytest.mark.parametrize("direct", [False, True])
def test_demo_writes_wavs_and_prints_the_table(tmp_path, capsys, direct):
    args = _args(tmp_path, direct=True) if direct else _args(tmp_path)
    assert demo.run(args) == 0
    out = capsys.readouterr().out
    assert ("WebSocket server on loopback" in out) != direct
    for needle in ("3 sessions", "ticks", "audio out", "responses 3;", "p50 latency", "thinker_kv", "code2wav",
                   "context cache hits 1",  # 3rd session reuses the 1st's context
                   demo.RANDOM_WEIGHTS_NOTE,
                   "sharing switches on: stage0.shared_anchor_blocks, context_cache.duplex_context_caching, "
                   "code2wav.cfm_prompt_att_sharing;"):
        assert needle in out, needle
    wavs = sorted((tmp_path / "out").glob("*.wav"))
    assert [p.name for p in wavs] == ["session0_default.wav", "session1_alt.wav", "session2_default.wav"]
    assert [_frames(p) for p in wavs] == [REPLY_FRAMES] * 3


def _patch_engine(monkeypatch, method: str, wrap) -> list:
    """Build the real engine, then replace its ``method`` with ``wrap(real_method)``; returns
    the list the built engines go to."""
    real_build = demo.build_engine
    built = []

    def build(deploy):
        engine = real_build(deploy)
        setattr(engine, method, wrap(getattr(engine, method)))
        built.append(engine)
        return engine

    monkeypatch.setattr(demo, "build_engine", build)
    return built


def test_demo_waits_for_the_reply_however_slow_the_ticks(tmp_path, capsys, monkeypatch, caplog):
    """The stage run that finishes the reply sleeps longer than any idle timer the old client had
    (5 s): the demo must still wait for response.done and get the whole reply. The late tick is
    logged once (by the engine), not also by the server."""
    stall_s = 6.0
    stalled = []

    def wrap(real_run_units):
        def run_units(units, lat):
            events = real_run_units(units, lat)
            if not stalled and any(isinstance(e, ResponseDone) for e in events):
                stalled.append(True)
                time.sleep(stall_s)
            return events
        return run_units

    built = _patch_engine(monkeypatch, "_run_units", wrap)
    caplog.set_level(logging.INFO)
    assert demo.run(_args(tmp_path, sessions=1)) == 0
    assert stalled, "the slowed stage never ran"
    assert _frames(tmp_path / "out" / "session0_default.wav") == REPLY_FRAMES
    assert "session 0 has its replies (1, 2.28 s of audio)" in caplog.text
    late_lines = [r for r in caplog.records if r.levelno >= logging.WARNING and "late" in r.getMessage()]
    assert built[0].late_ticks >= 1 and len(late_lines) == built[0].late_ticks, late_lines
    # the table counts what the log says (the server's late ticks, between ticks included): a
    # newcomer saw a late tick logged above a table that said "late 0"
    assert f"(late {len(late_lines)});" in capsys.readouterr().out


def test_the_table_counts_the_server_s_late_ticks(tmp_path):
    """A tick between unit ticks that ran late is the server's (the engine counts unit ticks):
    the demo reads it from the server's /metrics as an operator would."""
    from duplexcache.server.loopback import LoopbackServer
    from starlette.applications import Starlette
    from starlette.responses import PlainTextResponse
    from starlette.routing import Route

    text = "# TYPE duplexcache_late_ticks counter\nduplexcache_late_ticks_total 3.0\n"
    app = Starlette(routes=[Route("/metrics", lambda request: PlainTextResponse(text))])
    with LoopbackServer(app) as srv:
        assert demo.server_late_ticks(srv.http_url("/metrics")) == 3
    assert demo.server_late_ticks("http://127.0.0.1:9/metrics") is None   # nothing listens: unknown


def test_demo_fails_when_no_reply_comes(tmp_path, capsys, monkeypatch):
    """A stalled engine (its ticks return nothing): the demo exits 1 at its deadline, says why,
    and writes no empty WAV files."""
    _patch_engine(monkeypatch, "tick", lambda real_tick: lambda **_: [])
    assert demo.run(_args(tmp_path, sessions=2, timeout=2)) == 1
    err = capsys.readouterr().err
    assert "FAILED: no complete replies within --timeout 2 s: 0 of 2 replies, 0.00 s of audio" in err
    assert "ticks without finishing the replies" in err
    assert not (tmp_path / "out").exists()


def test_demo_direct_fails_when_no_reply_comes(tmp_path, capsys, monkeypatch):
    _patch_engine(monkeypatch, "tick", lambda real_tick: lambda **_: [])
    assert demo.run(_args(tmp_path, sessions=1, direct=True)) == 1
    assert "finished 0 of 1 replies" in capsys.readouterr().err


def test_the_timeout_message_names_late_ticks(tmp_path):
    """diagnose() reads the engine's late-tick figures (what a user on a busy machine needs)."""
    deploy = demo.demo_deploy(None)
    engine = demo.build_engine(deploy)
    try:
        engine.recorder.late_ticks = 3   # the engine counts late ticks in its stats recorder
        engine.latency_history["tick"].extend([0.5, 8.0, 7.5, 9.25])
        message = demo.diagnose(engine)
    finally:
        engine.shutdown()
    assert message.startswith("ticks are running 8.2 s late on this machine (3 of 0 ticks")
    assert "--sessions 1" in message


def test_demo_rejects_bad_counts(tmp_path):
    assert demo.run(_args(tmp_path, voices=5)) == 2
    assert demo.run(_args(tmp_path, sessions=0)) == 2
    assert demo.run(_args(tmp_path, seconds=1)) == 2   # the scripted policy ends a turn every 2 units
    assert demo.run(_args(tmp_path, timeout=0)) == 2


def test_demo_reports_a_config_it_cannot_load(tmp_path, capsys):
    assert demo.run(_args(tmp_path, config=str(tmp_path / "missing.yaml"))) == 2
    assert "duplexcache demo: [Errno 2] No such file or directory" in capsys.readouterr().err
    bad = tmp_path / "bad.yaml"
    bad.write_text("engine: {no_such_key: 1}\n")
    assert demo.run(_args(tmp_path, config=str(bad))) == 2
    assert "no_such_key" in capsys.readouterr().err


def test_model_policy_waits_for_every_unit_and_matches_direct(tmp_path):
    """speak_policy model: no reply count is known, so the clients wait until the engine has run
    every unit sent (counted in ticks); the server run must hear what the direct run hears."""
    deploy = demo.DeployConfig.default("tiny")
    deploy.engine.speak_policy.mode = "model"
    # The clients wait ticks past their audio; a server would fill those with silence once they
    # are quiet (scheduler.fill_silence_after_ms), and the model could answer it, which the direct
    # run, with no server, never hears. Off, both runs hear exactly the audio the clients sent.
    deploy.scheduler.fill_silence_after_ms = None
    config = tmp_path / "model.yaml"
    config.write_text(deploy.to_yaml())
    pcm = {}
    for direct in (False, True):
        out = tmp_path / ("direct" if direct else "server")
        args = _args(tmp_path, sessions=1, seconds=3, config=config, out=out, **({"direct": True} if direct else {}))
        assert demo.run(args) == 0
        with wave.open(str(out / "session0_default.wav")) as w:
            pcm[direct] = w.readframes(w.getnframes())
    assert pcm[False] and pcm[False] == pcm[True]
