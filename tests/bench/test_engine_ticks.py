"""Engine tick benchmark (duplexcache/bench/engine_ticks.py): a reduced tiny run on CPU.

Checked against independent sources, not the bench's own summary:
* per-stage numbers: the engine's ``latency_history`` deque (the bench reads ``stats()``), and
  p50/p99 recomputed here by hand-written linear interpolation;
* every recorded tick ran a unit for every session (text from each session, so the audio pushed
  covered warm-up + recorded ticks), and Code2Wav has a sample exactly in the ticks with audio;
* one model build, a fresh engine per session count, every session closed and every engine shut;
* refusals, the wall-clock budget and the CLI write a report instead of raising.
"""

from __future__ import annotations

import json
import logging
import math
import time

import numpy as np
import pytest
import torch

from duplexcache.bench import engine_ticks as et
from duplexcache.bench import engine_ticks_report as etr
from duplexcache.bench.engine_ticks_config import CONTINUOUS_K, config_from_args
from duplexcache.bench.fast_forward import fast_forward_session
from duplexcache.cli import build_parser
from duplexcache.cli import main as cli_main
from duplexcache.config import DeployConfig
from duplexcache.runtime.bundle import build_models
from duplexcache.runtime.engine import DuplexEngine

torch.set_num_threads(1)  # 2 shared cores
TICKS, WARMUP = 2, 2


def parse_args(argv: list[str]):
    """The settings and output folder of ``duplexcache bench ticks ARGV``, through the real parser."""
    args = build_parser().parse_args(["bench", "ticks", *argv])
    return config_from_args(args), args.out


class TrackedEngine(DuplexEngine):
    """Records what the bench does to it; ``delay_s`` slows every tick (for the budget test)."""

    built: list["TrackedEngine"] = []
    delay_s = 0.0

    def __init__(self, deploy, models) -> None:
        super().__init__(deploy, models)
        self.opened: list[str] = []
        self.voices_opened: list[str] = []
        self.closed: list[str] = []
        self.shutdowns = 0
        TrackedEngine.built.append(self)

    def open_session(self, client_session, *, queue_if_full=False):
        sid = super().open_session(client_session, queue_if_full=queue_if_full)
        self.opened.append(sid)
        self.voices_opened.append(client_session["voice"])
        return sid

    def close_session(self, sid):
        self.closed.append(sid)
        super().close_session(sid)

    def tick(self):
        time.sleep(self.delay_s)
        return super().tick()

    def shutdown(self):
        self.shutdowns += 1
        super().shutdown()


@pytest.fixture(scope="module")
def models():
    return build_models(DeployConfig.default("tiny"), seed=0)


@pytest.fixture(scope="module")
def reduced(models, tmp_path_factory):
    out = tmp_path_factory.mktemp("ticks")
    TrackedEngine.built = []
    cfg = et.TickBenchConfig("tiny", "cpu", (1, 2), TICKS, WARMUP)
    results = et.run_benchmark(cfg, out, models=models, engine_factory=TrackedEngine)
    return results, out, list(TrackedEngine.built)


def _percentile(values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks, written out independently of numpy."""
    v = sorted(values)
    pos = (len(v) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return v[lo] + (v[hi] - v[lo]) * (pos - lo)


def test_reduced_run_writes_table_with_stage_numbers(reduced):
    results, out, _ = reduced
    md = (out / "results.md").read_text()
    assert json.loads((out / "results.json").read_text()) == results
    assert "| sessions | status | encoder ms | vision ms | thinker ms | talker ms | code2wav ms | tick ms | wall ms " \
           "| all ticks < 1 s |" in md
    rows = [line for line in md.splitlines() if line.startswith("| 1 |") or line.startswith("| 2 |")]
    assert len(rows) == 2
    for line in rows:
        cells = [c.strip() for c in line.strip("|").split("|")]
        assert cells[1] == "ok"
        assert cells[3] == "-"        # vision: no frames in this workload
        for cell in cells[2:3] + cells[4:9]:   # encoder, thinker, talker, code2wav, tick, wall all ran
            p50, p99, mx = (float(x) for x in cell.split(" / "))
            assert 0 < p50 <= p99 <= mx
        assert cells[9] in ("yes", "no")
    assert "Largest session count tried with every tick < 1 s" in md


def test_every_recorded_tick_ran_every_session(reduced):
    results, _, _ = reduced
    for run in results["runs"]:
        n = run["sessions"]
        assert run["status"] == "ok" and run["admitted"] == n and run["session_errors"] == 0
        assert run["recorded_ticks"] == TICKS
        assert run["text_sessions_per_tick"] == [n] * TICKS   # k=2: every unit speaks
        c2w = run["per_tick_s"]["code2wav"]
        # Code2Wav has a sample exactly in the ticks that emitted audio: every speaking unit's
        # chunk leaves in its own tick, and a turn's last unit adds its final chunk (k = 2)
        assert [v > 0 for v in c2w] == [a > 0 for a in run["audio_chunks_per_tick"]]
        assert run["audio_chunks_per_tick"] == [n * (1 + k % 2) for k in range(TICKS)]


def test_stage_numbers_match_engine_history_and_percentiles(reduced):
    results, _, engines = reduced
    assert len(engines) == 2
    for run, eng in zip(results["runs"], engines):
        per = run["per_tick_s"]
        for stage in et.STAGES:
            assert per[stage] == list(eng.latency_history[stage])[-TICKS:], stage
            ran = [v for v in per[stage] if v > 0]
            if stage == "vision":   # no frames in this workload
                assert not ran and run["stages_s"][stage]["n"] == 0
                continue
            s = run["stages_s"][stage]
            assert s["n"] == len(ran)
            assert s["p50"] == pytest.approx(_percentile(ran, 50), rel=1e-12)
            assert s["p99"] == pytest.approx(_percentile(ran, 99), rel=1e-12)
            assert s["max"] == max(ran)
        for k in range(TICKS):
            parts = sum(per[s][k] for s in ("encoder", "thinker", "talker", "code2wav"))
            assert parts <= per["tick"][k] <= per["wall"][k]
        assert run["all_ticks_under_1s"] == (max(per["wall"]) < 1.0)
    want = [r["sessions"] for r in results["runs"] if r["all_ticks_under_1s"]]
    assert results["largest_sessions_all_ticks_under_1s"] == (max(want) if want else None)


def test_fresh_engine_per_count_all_closed_and_shut_down(reduced):
    _, _, engines = reduced
    assert [len(e.opened) for e in engines] == [1, 2]
    for eng in engines:
        assert eng.closed == eng.opened and eng.shutdowns == 1
        assert eng.stats().live_sessions == 0 and len(eng.ledger) == 0
        with pytest.raises(RuntimeError, match="shut down"):
            eng.tick()
    assert engines[0].models is engines[1].models   # one model bundle for the whole sweep


def test_refusal_is_recorded_and_larger_counts_skipped(models):
    TrackedEngine.built = []
    cfg = et.TickBenchConfig("tiny", "cpu", (64, 65), 1, 0)
    results = et.run_benchmark(cfg, models=models, engine_factory=TrackedEngine)
    first, second = results["runs"]
    assert first["status"] == "refused" and first["recorded_ticks"] == 0
    assert first["admitted"] < 64 and first["planned_sessions"] < 64
    assert f"admitted {first['admitted']} of 64" in first["note"]
    assert second["status"] == "skipped" and "n=64 ended refused" in second["note"]
    assert results["largest_sessions_all_ticks_under_1s"] is None
    eng = TrackedEngine.built[0]
    assert eng.closed == eng.opened and eng.shutdowns == 1 and len(eng.ledger) == 0


def test_wall_clock_budget_stops_the_sweep(models):
    TrackedEngine.built, TrackedEngine.delay_s = [], 1.2
    try:
        cfg = et.TickBenchConfig("tiny", "cpu", (1, 2), 3, 1, max_seconds=1.0)
        results = et.run_benchmark(cfg, models=models, engine_factory=TrackedEngine)
    finally:
        TrackedEngine.delay_s = 0.0
    first, second = results["runs"]
    assert first["status"] == "stopped" and first["recorded_ticks"] == 0
    assert "wall-clock budget" in first["note"]
    assert second["status"] == "skipped" and results["skipped_sessions"] == [2]
    assert len(TrackedEngine.built) == 1 and TrackedEngine.built[0].shutdowns == 1
    md = etr.markdown(results)
    assert "| 1 | stopped |" in md and "wall-clock budget" in md


@pytest.fixture
def restore_logging():
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


def test_cli_writes_report_when_budget_is_spent(tmp_path, capsys, restore_logging):
    assert cli_main(["bench", "ticks", "--sessions", "1,8", "--max-seconds", "0.001", "--out", str(tmp_path)]) == 0
    results = json.loads((tmp_path / "results.json").read_text())
    assert [r["status"] for r in results["runs"]] == ["skipped", "skipped"]
    assert "wall-clock budget" in results["runs"][0]["note"]
    assert "# Engine tick benchmark" in capsys.readouterr().out


def test_deploy_switches_policy_and_bad_input():
    on = et.make_deploy(et.TickBenchConfig(memory_budget="256MiB"))
    off = et.make_deploy(et.TickBenchConfig(all_switches=False, speak_k=3))
    assert (on.stage0.shared_anchor_blocks, on.context_cache.duplex_context_caching,
            on.code2wav.cfm_prompt_att_sharing) == (True, True, True)
    assert (off.stage0.shared_anchor_blocks, off.context_cache.duplex_context_caching,
            off.code2wav.cfm_prompt_att_sharing) == (False, False, False)
    assert on.engine.memory_budget == 256 * 2**20 and on.model.dtype == "float32"
    assert off.engine.speak_policy.mode == "every_k_units" and off.engine.speak_policy.k == 3
    # the speed switches and the turn length reach the deploy config from the command line
    cfg, _ = parse_args(["--cuda-graphs", "off", "--ragged-kernel", "off", "--speak-k", "9",
                            "--turn-units", "9", "--code2wav-dtype", "bfloat16", "--kv-cache-dtype", "fp8_e4m3",
                            "--encoder-cache-dtype", "fp8_e4m3", "--talker-turn-tokens", "1024"])
    fast = et.make_deploy(cfg)
    assert fast.engine.cuda_graphs is False and fast.stage0.ragged_kernel is False
    for gone in ("--decode-cuda-graphs", "--ragged-step-graphs", "--encoder-cuda-graphs", "--vocoder-cuda-graphs"):
        with pytest.raises(SystemExit):   # one flag for every graph since issue 44
            parse_args([gone, "off"])
    assert fast.precision.code2wav_dtype == "bfloat16" and on.precision.code2wav_dtype == "float32"
    assert fast.precision.kv_cache_dtype == "fp8_e4m3" and on.precision.kv_cache_dtype == "auto"
    assert fast.precision.encoder_cache_dtype == "fp8_e4m3" and on.precision.encoder_cache_dtype == "auto"
    assert fast.engine.talker_turn_tokens == 1024 and on.engine.talker_turn_tokens is None
    assert fast.engine.speak_policy.turn_units == fast.engine.speak_policy.k == 9   # every unit speaks
    assert on.engine.cuda_graphs is True and on.stage0.ragged_kernel is True   # the default
    with pytest.raises(ValueError, match="turn_units"):
        et.TickBenchConfig(turn_units=0)
    with pytest.raises(ValueError, match="needs --device cuda"):
        et.TickBenchConfig("minicpmo45", "cpu")
    with pytest.raises(ValueError, match="positive"):
        et.TickBenchConfig(sessions=(0, 2))
    with pytest.raises(ValueError):
        et.TickBenchConfig(memory_budget="lots")
    with pytest.raises(SystemExit):
        parse_args(["--sessions", "1,x"])


def test_session_audio_lengths_and_seeding():
    a = et.session_audio(0, 3, 16_560, 16_000)
    assert a.dtype == np.float32 and a.shape == (16_560 + 2 * 16_000,)
    assert np.array_equal(a, et.session_audio(0, 3, 16_560, 16_000))
    assert not np.array_equal(a, et.session_audio(1, 3, 16_560, 16_000))
    assert np.abs(a).max() <= 0.3 + 1e-6 and np.abs(a).max() > 0.1


def test_steady_window_fills_to_the_middle_of_the_marks(models, tmp_path, restore_logging, monkeypatch):
    fills: list[tuple[str, int, int]] = []   # each fast-forward and the Thinker length right after it

    def tracking_fast_forward(eng, sid, **kw):
        res = fast_forward_session(eng, sid, **kw)
        info = eng.session_info(sid)
        fills.append((sid, kw["thinker_tokens"], info.thinker_tokens - info.thinker_anchor_tokens))
        return res

    monkeypatch.setattr(et, "fast_forward_session", tracking_fast_forward)
    TrackedEngine.built = []
    cfg = et.TickBenchConfig("tiny", "cpu", (1,), 1, 1, steady_window=True)
    results = et.run_benchmark(cfg, tmp_path, models=models, engine_factory=TrackedEngine)
    (eng,) = TrackedEngine.built
    w = eng.deploy.stage0.window
    mid = (w.low_tokens + w.high_tokens) // 2
    assert fills == [(eng.opened[0], mid, mid)]
    run = results["runs"][0]
    assert run["status"] == "ok" and results["config"]["steady_window"] is True
    assert "filled to (low + high) / 2" in (tmp_path / "results.md").read_text()
    assert parse_args(["--steady-window"])[0].steady_window is True


# ------------------------------------------------------------------ long runs and workloads

LONG_WARMUP, LONG_TICKS = 8, 4


def test_long_run_feeds_one_unit_per_tick(models):
    """12 units used to overflow the engine's 10 s input buffer when pushed up front."""
    TrackedEngine.built = []
    cfg = et.TickBenchConfig("tiny", "cpu", (2,), LONG_TICKS, LONG_WARMUP, workload="continuous")
    run = et.run_benchmark(cfg, models=models, engine_factory=TrackedEngine)["runs"][0]
    assert run["status"] == "ok", run["note"]
    assert run["session_errors"] == 0 and run["schedule_mismatches"] == []
    assert run["recorded_ticks"] == LONG_TICKS
    assert run["text_sessions_per_tick"] == run["scheduled_speakers_per_tick"] == [2] * LONG_TICKS
    # one endless turn: after the first unit every tick carries one chunk per session
    assert run["audio_chunks_per_tick"] == [2] * LONG_TICKS
    eng = TrackedEngine.built[0]
    assert eng.stats().ticks == LONG_WARMUP + LONG_TICKS


def test_conversation_workload_follows_its_script(models):
    n, seed = 3, 0
    units = LONG_WARMUP + LONG_TICKS
    TrackedEngine.built = []
    cfg = et.TickBenchConfig("tiny", "cpu", (n,), LONG_TICKS, LONG_WARMUP, workload="conversation", seed=seed)
    results = et.run_benchmark(cfg, models=models, engine_factory=TrackedEngine)
    run = results["runs"][0]
    assert run["status"] == "ok", run["note"]
    assert run["session_errors"] == 0 and run["schedule_mismatches"] == []
    eng = TrackedEngine.built[0]
    assert eng.deploy.engine.speak_policy.mode == "reply"
    assert len(set(eng.voices_opened)) == 3          # three voices, one more than the preset has
    assert len(models.voices) == 2                   # the caller's bundle is left as it was
    # the schedule, recomputed from the workload, has speaking and listening sessions in the
    # recorded ticks (so the run's own schedule check had something to catch)
    scripts = [et.wl.conversation_script(i, sid, units, seed) for i, sid in enumerate(eng.opened)]
    scheduled = [sum(s.speaks[u] for s in scripts) for u in range(LONG_WARMUP, units)]
    assert run["scheduled_speakers_per_tick"] == scheduled == run["text_sessions_per_tick"]
    assert any(s.speaks[u] for s in scripts for u in range(units))
    assert not all(s.speaks[u] for s in scripts for u in range(units))
    assert results["config"]["workload"] == "conversation"
    assert "reply" in results["config"]["speak_policy"]


def test_workload_flag_reaches_the_policy():
    cfg, _ = parse_args(["--workload", "conversation"])
    sp = et.make_deploy(cfg).engine.speak_policy
    assert (sp.mode, sp.reply_min_units, sp.reply_max_units) == ("reply", 2, 8)
    cfg, _ = parse_args(["--workload", "continuous"])
    sp = et.make_deploy(cfg).engine.speak_policy
    assert sp.mode == "every_k_units" and sp.k == sp.turn_units == CONTINUOUS_K   # every unit speaks
    with pytest.raises(ValueError, match="unknown workload"):
        et.TickBenchConfig(workload="chatter")


def test_warm_up_and_graph_grid_reach_the_engine(models):
    """--warm-up runs DuplexEngine.warmup() before the first tick (off: never); --graph-grid
    becomes code2wav.graph_grid with the arena sized from it."""
    cfg, _ = parse_args(["--graph-grid", "1,4", "--sessions", "1", "--ticks", "1", "--warmup-ticks", "2"])
    deploy = et.make_deploy(cfg)
    assert deploy.code2wav.graph_grid == (1, 4) and deploy.code2wav.cfm_arena_rows_from_graph_grid
    assert deploy.code2wav.arena_rows == 4
    assert et.make_deploy(et.TickBenchConfig()).code2wav.graph_grid is None   # the preset's
    for flag in ("on", "off"):
        cfg, _ = parse_args(["--warm-up", flag, "--sessions", "1", "--ticks", "1", "--warmup-ticks", "2"])
        calls = []

        class Counting(DuplexEngine):
            def warmup(self, should_stop=None):
                calls.append(self._ticks)   # before any tick
                return super().warmup(should_stop)

        run = et.run_sessions(models, et.make_deploy(cfg), 1, cfg, et._Deadline(time.perf_counter(), 300),
                              engine_factory=Counting)
        assert calls == ([0] if flag == "on" else []) and run.status == "ok"
        assert (run.warmup_s is not None) == (flag == "on") and run.tick_graph_captures == 0


def test_per_session_slope_and_floor_come_from_the_run(reduced):
    results, out, _ = reduced
    per, runs = results["per_session"], results["runs"]
    (n1, n2) = [r["sessions"] for r in runs]
    assert per["stages"]["vision"]["slope_ms"] is None   # no frames in this workload: nothing to fit
    for stage in (*et.STAGES, "wall"):
        if stage == "vision":
            continue
        p1, p2 = (1e3 * r["stages_s"][stage]["p50"] for r in runs)
        s = per["stages"][stage]
        assert s["slope_ms"] == pytest.approx((p2 - p1) / (n2 - n1))   # two counts: the line through them
        assert s["intercept_ms"] == pytest.approx(p1 - s["slope_ms"] * n1)
        assert s["slope_stderr_ms"] is None and s["floor_ms"] is None   # CPU: no device peaks
    # the floor's shapes are the recorded ticks': every session counted, the scheduled speakers
    for r in runs:
        sums = r["shape_sums_per_tick"]
        assert sums["sessions"] == [r["sessions"]] * TICKS
        assert sums["speakers"] == r["scheduled_speakers_per_tick"]
    shape = per["floor"]["shape"]
    speakers = sum(sum(r["scheduled_speakers_per_tick"]) for r in runs)
    assert shape["speaking_fraction"] == pytest.approx(speakers / (TICKS * (n1 + n2)))
    assert per["floor"]["device"] is None and per["floor"]["stages"]["thinker"]["own_bytes"] > 0
    md = (out / "results.md").read_text()
    assert "## Per-stage cost per extra session" in md and "| distance to floor |" in md


def test_floor_device_flag_reaches_the_floor(tmp_path, restore_logging):
    assert cli_main(["bench", "ticks", "--sessions", "1", "--ticks", "1", "--warmup-ticks", "1",
                     "--floor-device", "h200", "--out", str(tmp_path)]) == 0
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["config"]["floor_device"] == "h200"
    floor = results["per_session"]["floor"]
    assert floor["device"]["name"] == "H200" and floor["tick_ms"] > 0
    assert results["per_session"]["stages"]["tick"]["floor_ms"] == pytest.approx(floor["tick_ms"])
    with pytest.raises(SystemExit):
        parse_args(["--floor-device", "b200"])
