"""``duplexcache bench serve`` against a real tiny server (real engine, reply policy) on 127.0.0.1,
plus the pure pieces (reply splitting, playback gaps, counters) on hand-made inputs."""

from __future__ import annotations

import json

import pytest
import torch

from duplexcache.bench import serve
from duplexcache.cli import main as cli_main
from duplexcache.bench.serve_client import SessionTrace, Wire, playback_gaps, session_row, split_replies
from duplexcache.bench.workload import continuous_script
from duplexcache.config import DeployConfig
from duplexcache.runtime.bundle import build_models
from duplexcache.runtime.engine import DuplexEngine
from duplexcache.runtime.engine_api import AdmissionError
from duplexcache.server.app import REALTIME_PATH, create_app
from duplexcache.server.loopback import LoopbackServer

torch.set_num_threads(1)  # 2 shared cores

REPLY = (2, 3)
DURATION = 7          # units: user turn 0-1, reply from unit 2 (2..3 units), done by unit 5


def _deploy() -> DeployConfig:
    deploy = DeployConfig.default("tiny")
    deploy.engine.speak_policy.mode = "reply"
    deploy.engine.speak_policy.reply_min_units, deploy.engine.speak_policy.reply_max_units = REPLY
    deploy.engine.tick_seconds = 0.25
    # admission by time measures this machine's ticks: a busy CI box must not refuse a session here
    deploy.engine.tick_headroom = 1e9
    return deploy


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    out = tmp_path_factory.mktemp("serve")
    deploy = _deploy()
    engine = DuplexEngine(deploy, build_models(deploy, seed=0))
    with LoopbackServer(create_app(engine, deploy)) as srv:
        argv = ["--url", srv.ws_url(REALTIME_PATH), "--sessions", "1,2", "--duration", str(DURATION),
                "--ramp", "0.5", "--user-units", "2,2", "--max-lead-units", "0", "--reply-min-units", str(REPLY[0]),
                "--reply-max-units", str(REPLY[1]), "--drain", "8", "--out", str(out)]
        import argparse

        parser = argparse.ArgumentParser()
        serve.add_arguments(parser)
        rc = serve.run(parser.parse_args(argv), argv)
        # a refused session is an error row, not a hang or a crash
        def full(*args, **kwargs):
            raise AdmissionError("memory budget full (test)", code="capacity_memory")

        engine.open_session = full   # the instance attribute the server calls
        try:
            bad = ["--url", srv.ws_url(REALTIME_PATH), "--sessions", "1", "--duration", "2",
                   "--out", str(out / "refused")]
            assert cli_main(["bench", "serve", *bad]) == 0   # through the command line
        finally:
            del engine.open_session
    return rc, out, argv


def test_a_refused_session_is_reported(sweep):
    _, out, _ = sweep
    step = json.loads((out / "refused" / "results.json").read_text())["steps"][0]
    (row,) = step["per_session"]
    # the OpenAI-style server names the session on connect, before the engine refuses it
    assert not row["got_audio"]
    assert row["errors"] and row["errors"][0].startswith("capacity_memory")
    assert step["sessions_with_errors"] == 1 and step["realtime"] is False
    assert not any(e.startswith("timeout") for e in row["errors"])   # it did not wait out the session timeout


def test_results_schema_and_every_session_got_its_reply(sweep):
    rc, out, argv = sweep
    assert rc == 0
    results = json.loads((out / "results.json").read_text())
    assert (out / "reply_latency.png").stat().st_size > 0
    assert results["command"] == "duplexcache bench serve " + " ".join(argv)
    assert isinstance(results["hardware"], str) and results["hardware"]
    assert set(results["criterion"]) >= {"every_session_received_audio", "late_ticks", "reply_latency_p99_max_s",
                                         "text"}
    assert [s["sessions"] for s in results["steps"]] == [1, 2]
    for step in results["steps"]:
        n = step["sessions"]
        for key in ("reply_latency_s", "max_gap_s", "audio_received_ratio"):
            assert set(step[key]) == {"p50", "p95", "p99", "max", "n"}
        assert isinstance(step["late_ticks"], float)          # the server exports duplexcache_late_ticks
        assert step["graph_captures"] is None or step["graph_captures"] >= 0
        assert isinstance(step["catch_up_ticks"], float) and step["catch_up_ticks"] >= 0
        # each short context is one chunk, run in the slack (or by a tick that had none: a busy machine)
        assert 0 <= step["prefill_chunks_between_ticks"] <= n
        assert set(step["reply_latency_growth_s"]) == {"p50", "p95", "p99", "max", "n"}
        # the server's per-stage timers over the step's ticks (its stage histogram on /metrics)
        means = step["stage_ms_mean"]
        assert set(means) == {"encoder", "vision", "thinker", "talker", "code2wav", "tick"} and means["tick"] > 0
        assert all(0 <= v <= means["tick"] for v in means.values())
        # two phases (the default): timed when a tick between unit ticks answered a turn early
        assert step["between_tick_ms_mean"] is None or step["between_tick_ms_mean"] > 0
        assert len(step["per_session"]) == n and step["sessions_with_audio"] == n
        assert step["sessions_with_errors"] == 0, [row["errors"] for row in step["per_session"]]
        for row in step["per_session"]:
            assert row["got_audio"] and row["errors"] == [] and row["units_sent"] == DURATION
            # one user turn of 2 units then quiet: exactly one reply, as long as the server's
            # reply_units(sid, 0) says (1 s per unit, plus the final chunk: 0.12 s and the 0.16 s tail)
            assert row["replies_scheduled"] == row["replies_done"] == row["replies_with_audio"] == 1
            assert row["audio_scheduled_s"] in REPLY
            assert row["audio_received_s"] == pytest.approx(row["audio_scheduled_s"] + 0.12 + 0.16)
            (latency,) = row["reply_latency_s"]
            # the reply cannot start before the policy has heard end_quiet_ms of quiet after the
            # turn (the units are aligned to the ticks, so it may start in the unit that holds the
            # turn's end: the whole quiet unit of 1 s is no bound); the rest is the server's speed
            assert latency > _deploy().engine.speak_policy.end_quiet_ms / 1000
        want = step["realtime"]
        assert want == (step["late_ticks"] == 0 and step["reply_latency_s"]["p99"] <= 1.5)
    best = [s["sessions"] for s in results["steps"] if s["realtime"]]
    assert results["largest_realtime_sessions"] == (max(best) if best else None)


def test_split_replies_and_gaps():
    t = SessionTrace(0, "default")
    rate = Wire.OUTPUT_RATE
    # reply 1: 1 s chunks at 10.0, 11.0, 12.5 (the last one 0.5 s late), done at 12.6;
    # reply 2: one chunk at 20.0, no done yet
    t.audio = [(10.0, rate), (11.0, rate), (12.5, rate), (20.0, rate // 2)]
    t.dones = [12.6]
    replies = split_replies(t)
    assert [len(r) for r in replies] == [3, 1]
    assert playback_gaps(replies[0]) == [pytest.approx(0.5)]
    assert playback_gaps([(0.0, rate), (0.9, rate), (2.05, rate)]) == [pytest.approx(0.05)]
    t.script, t.units_sent = continuous_script("sess_1", 5), 5
    row = session_row(t)
    assert row["gaps_over_200ms"] == 1 and row["max_gap_s"] == pytest.approx(0.5)
    assert row["audio_scheduled_s"] == 5.0 and row["audio_received_s"] == pytest.approx(3.5)
    assert row["reply_latency_s"] == []


def test_a_callers_repeated_refusals_are_one_entry_with_a_count():
    t = SessionTrace(0, "default")
    t.errors = ["capacity_memory: full"] * 3 + ["idle timeout"] + ["capacity_memory: full"]
    assert session_row(t)["errors"] == ["capacity_memory: full (x3)", "idle timeout", "capacity_memory: full"]


def test_each_reply_answers_the_latest_turn_before_it():
    from duplexcache.bench.serve_client import pair_replies

    ends = {0: 10.0, 1: 20.0, 2: 30.0}
    assert pair_replies(ends, [11.0, 21.5, 30.8]) == [(0, 1.0), (1, 1.5), (2, pytest.approx(0.8))]
    # the reply to turn 1 never came: the next reply is turn 2's, not a 20.8 s answer to turn 1
    assert pair_replies(ends, [11.0, 30.8]) == [(0, 1.0), (2, pytest.approx(0.8))]
    assert pair_replies(ends, [5.0, 11.0]) == [(0, 1.0)]            # audio before any turn ended
    assert pair_replies(ends, [11.0, 12.0]) == [(0, 1.0)]           # a second reply to one turn
    assert pair_replies({}, [3.0]) == []


def test_counters_from_prometheus_text():
    text = ("# TYPE duplexcache_late_ticks counter\nduplexcache_late_ticks_total 3.0\n"
            "# TYPE duplexcache_graph_captures counter\n"
            "duplexcache_graph_captures_total{model=\"thinker\"} 2.0\n"
            "duplexcache_graph_captures_total{model=\"talker\"} 5.0\n"
            "# TYPE duplexcache_catch_up_ticks counter\nduplexcache_catch_up_ticks_total 4.0\n"
            "# TYPE duplexcache_early_closes counter\nduplexcache_early_closes_total 6.0\n"
            "# TYPE duplexcache_live_sessions gauge\nduplexcache_live_sessions 4.0\n")
    assert serve.counters(text) == {"late_ticks": 3.0, "graph_captures": 7.0, "catch_up_ticks": 4.0,
                                    "prefill_chunks_between_ticks": None, "early_closes": 6.0}
    assert serve.counters("# TYPE x counter\nx_total 1.0\n") == dict.fromkeys(serve.COUNTERS)


def test_stage_means_from_the_servers_histogram():
    """Each stage's mean ms per tick over a step: the histogram's sum and count differences."""
    def text(enc_sum, enc_n, c2w_sum, c2w_n):
        return ("# TYPE duplexcache_stage_latency_seconds histogram\n"
                f'duplexcache_stage_latency_seconds_bucket{{le="+Inf",stage="encoder"}} {enc_n}\n'
                f'duplexcache_stage_latency_seconds_count{{stage="encoder"}} {enc_n}\n'
                f'duplexcache_stage_latency_seconds_sum{{stage="encoder"}} {enc_sum}\n'
                f'duplexcache_stage_latency_seconds_bucket{{le="+Inf",stage="code2wav"}} {c2w_n}\n'
                f'duplexcache_stage_latency_seconds_count{{stage="code2wav"}} {c2w_n}\n'
                f'duplexcache_stage_latency_seconds_sum{{stage="code2wav"}} {c2w_sum}\n')
    before, after = serve.stage_totals(text(1.0, 10, 4.0, 10)), serve.stage_totals(text(3.0, 30, 16.0, 30))
    assert before == {"stage_count:encoder": 10.0, "stage_sum:encoder": 1.0, "stage_count:code2wav": 10.0,
                      "stage_sum:code2wav": 4.0}
    assert serve.stage_ms_mean(before, after) == {"encoder": 100.0, "code2wav": 600.0}
    assert serve.stage_ms_mean(before, before) is None          # no tick in the step
    assert serve.stage_totals("# TYPE x counter\nx_total 1.0\n") == {}


def test_the_mean_tick_between_unit_ticks_from_its_histogram():
    """between_tick_ms_mean: the server's ticks between unit ticks that ran units, mean ms over a
    step; None when it ran none or exports no such histogram."""
    def text(total, n):
        return ("# TYPE duplexcache_between_tick_duration_seconds histogram\n"
                f'duplexcache_between_tick_duration_seconds_bucket{{le="+Inf"}} {n}\n'
                f"duplexcache_between_tick_duration_seconds_count {n}\n"
                f"duplexcache_between_tick_duration_seconds_sum {total}\n")
    before, after = serve.stage_totals(text(0.5, 2)), serve.stage_totals(text(2.0, 5))
    assert before == {"between_sum": 0.5, "between_count": 2.0}
    assert serve.between_tick_ms_mean(before, after) == 500.0
    assert serve.between_tick_ms_mean(before, before) is None
    assert serve.between_tick_ms_mean({}, {}) is None


def test_url_and_arguments_are_checked():
    assert serve.http_base("ws://127.0.0.1:9/v1/realtime") == "http://127.0.0.1:9"
    assert serve.http_base("wss://h:1/x") == "https://h:1"
    for bad in ("http://127.0.0.1:9/", "ws:///nohost", "ws://:9/x"):
        with pytest.raises(ValueError, match="ws:// or wss://"):
            serve.http_base(bad)
    for bad in ("ws://127.0.0.1:99999/v1/realtime", "ws://h:port/x"):   # a traceback from the connect before
        with pytest.raises(ValueError, match="needs a port from 0 to 65535"):
            serve.http_base(bad)
    import argparse

    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    for bad in (["--sessions", "0"], ["--sessions", "1,x"], ["--duration", "0"], ["--ramp", "-1"],
                ["--user-units", "3,2"], ["--long-context-callers", "1.5"], ["--long-context-chars", "0"]):
        with pytest.raises(SystemExit):
            parser.parse_args(["--url", "ws://127.0.0.1:9/v1/realtime", *bad])


def test_rate_limited_callers_are_counted_and_named(caplog):
    """Every caller of the benchmark shares one address: a per-address cap must not pass for an
    engine limit (an H200 run measured the cap of 8 instead of 32 sessions)."""
    def row(errors):
        return {"reply_latency_s": [], "audio_received_ratio": None, "max_gap_s": 0.0, "gaps_over_200ms": 0,
                "got_audio": not errors, "errors": errors, "replies_scheduled": 0, "replies_done": 0}

    counters = {"late_ticks": 0.0, "graph_captures": 0.0, "catch_up_ticks": 0.0}
    rows = [row([]), row(["rate_limit_exceeded: too many sessions from this client address"])]
    with caplog.at_level("WARNING", logger="duplexcache.bench.serve"):
        step = serve.summarize_step(2, rows, counters, counters, 1.0, 3.5, "conversation")
    assert step["sessions_rate_limited"] == 1 and step["realtime"] is False
    assert "max_sessions_per_client" in caplog.text
    assert serve.summarize_step(1, rows[:1], counters, counters, 1.0, 3.5, "conversation")["sessions_rate_limited"] == 0


def test_sessions_without_errors_are_summarised_apart_when_some_were_refused():
    """A card that holds fewer sessions than the step's callers: the refused callers' late
    replies set the step's p99; the admitted callers' figures come apart (the H100 runs of
    2026-12-06 cut them from per_session by hand)."""
    def row(latencies, errors=(), gaps=0):
        return {"reply_latency_s": latencies, "audio_received_ratio": 1.0, "max_gap_s": 0.0,
                "gaps_over_200ms": gaps, "got_audio": bool(latencies), "errors": list(errors),
                "replies_scheduled": len(latencies), "replies_done": len(latencies)}

    counters = {"late_ticks": 0.0, "graph_captures": 0.0, "catch_up_ticks": 0.0}
    rows = [row([0.8, 1.1], gaps=1), row([0.9]), row([12.0], ["capacity_memory: full (x40)"], gaps=2)]
    step = serve.summarize_step(3, rows, counters, counters, 1.0, 3.5, "conversation")
    assert step["reply_latency_s"]["max"] == 12.0
    clean = step["without_errors"]
    assert clean["sessions"] == clean["sessions_with_audio"] == 2 and clean["gaps_over_200ms"] == 1
    assert clean["reply_latency_s"]["n"] == 3 and clean["reply_latency_s"]["max"] == 1.1
    assert "without_errors" not in serve.summarize_step(2, rows[:2], counters, counters, 1.0, 3.5, "conversation")


def test_latency_growth_is_the_last_reply_less_the_first_per_session():
    """A server that falls behind and never catches up makes every later reply later (issue 10)."""
    def row(latencies):
        return {"reply_latency_s": latencies, "audio_received_ratio": 1.0, "max_gap_s": 0.0, "gaps_over_200ms": 0,
                "got_audio": True, "errors": [], "replies_scheduled": len(latencies), "replies_done": len(latencies)}

    before = {"late_ticks": 1.0, "graph_captures": 0.0, "catch_up_ticks": 2.0}
    after = {"late_ticks": 4.0, "graph_captures": 0.0, "catch_up_ticks": 7.0}
    step = serve.summarize_step(3, [row([3.0, 4.0, 6.5]), row([3.5, 3.0]), row([2.0])], before, after, 1.0, 3.5,
                                "conversation")
    assert step["reply_latency_growth_s"]["n"] == 2       # a single reply has no growth
    assert step["reply_latency_growth_s"]["max"] == 3.5 and step["reply_latency_growth_s"]["p50"] == 1.5
    assert step["catch_up_ticks"] == 5.0 and step["late_ticks"] == 3.0


def test_long_context_callers_are_summarised_apart():
    """--long-context-callers: the step's figures stay those of the regular callers (comparable
    with a run without them); the long-context callers get their own summary, refusals named."""
    def row(latencies, errors=(), long=False):
        r = {"reply_latency_s": latencies, "audio_received_ratio": 1.0 if latencies else None, "max_gap_s": 0.1,
             "gaps_over_200ms": 0, "got_audio": bool(latencies), "errors": list(errors),
             "replies_scheduled": len(latencies), "replies_done": len(latencies)}
        return {**r, "long_context": True} if long else r

    counters = {"late_ticks": 0.0, "graph_captures": 0.0, "catch_up_ticks": 0.0}
    rows = [row([2.0]), row([3.0]), row([9.0], long=True),
            row([], ["context_length_exceeded: 9000 tokens > 8192"], long=True)]
    step = serve.summarize_step(2, rows, counters, counters, 1.0, 3.5, "conversation")
    assert step["reply_latency_s"]["max"] == 3.0 and step["sessions_with_audio"] == 2
    assert step["sessions_with_errors"] == 0 and step["realtime"] is True
    assert step["long_context"]["callers"] == 2 and step["long_context"]["with_audio"] == 1
    assert step["long_context"]["first_errors"] == ["context_length_exceeded: 9000 tokens > 8192"]
    assert step["long_context"]["reply_latency_s"]["max"] == 9.0
    assert len(step["per_session"]) == 4
    assert "long_context" not in serve.summarize_step(2, rows[:2], counters, counters, 1.0, 3.5, "conversation")
    assert len(serve.long_instructions(1234)) == 1234


def test_a_long_context_caller_joins_a_live_step_over_the_wire(tmp_path):
    deploy = _deploy()
    deploy.engine.prefill_chunk_tokens = 128   # the 600-token context opens over several chunks
    engine = DuplexEngine(deploy, build_models(deploy, seed=0))
    with LoopbackServer(create_app(engine, deploy)) as srv:
        argv = ["bench", "serve", "--url", srv.ws_url(REALTIME_PATH), "--sessions", "1", "--duration", str(DURATION),
                "--ramp", "0", "--user-units", "2,2", "--max-lead-units", "0", "--reply-min-units", str(REPLY[0]),
                "--reply-max-units", str(REPLY[1]), "--drain", "8", "--long-context-callers", "1",
                "--long-context-chars", "600", "--long-context-at", "1", "--out", str(tmp_path)]
        assert cli_main(argv) == 0
    (step,) = json.loads((tmp_path / "results.json").read_text())["steps"]
    regular, long = step["per_session"]
    assert "long_context" not in regular and long["long_context"] is True
    assert regular["got_audio"] and regular["errors"] == []
    assert step["long_context"]["callers"] == 1 and step["long_context"]["with_errors"] == 0, long["errors"]
    assert long["got_audio"] and long["units_sent"] == DURATION - 1   # joined 1 s in, ended with the others


def test_push_to_talk_callers_get_their_replies(tmp_path):
    """``--workload push_to_talk``: the conversation of a caller that sends only its own turn's
    units and nothing while the server replies. The server hears silence once the caller has
    been quiet for ``scheduler.fill_silence_after_ms``, so each reply comes whole; without that,
    the session would run no unit after the turn and the reply would never start."""
    deploy = _deploy()
    engine = DuplexEngine(deploy, build_models(deploy, seed=0))
    with LoopbackServer(create_app(engine, deploy)) as srv:
        argv = ["--url", srv.ws_url(REALTIME_PATH), "--sessions", "1", "--duration", str(DURATION),
                "--workload", "push_to_talk", "--user-units", "2,2", "--max-lead-units", "0",
                "--reply-min-units", str(REPLY[0]), "--reply-max-units", str(REPLY[1]), "--drain", "8",
                "--out", str(tmp_path)]
        assert cli_main(["bench", "serve", *argv]) == 0
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["config"]["workload"] == "push_to_talk"
    (row,) = results["steps"][0]["per_session"]
    assert row["errors"] == [] and row["units_sent"] == DURATION
    assert row["replies_scheduled"] == row["replies_done"] == row["replies_with_audio"] == 1
    assert row["audio_received_s"] == pytest.approx(row["audio_scheduled_s"] + 0.12 + 0.16)
    (latency,) = row["reply_latency_s"]
    assert latency > 0.5   # the server waits out the caller's quiet before it hears the silence
    assert results["criterion"]["reply_latency_p99_max_s"] is not None   # replies, so latency counts


def test_callers_of_both_dialects_get_their_replies(tmp_path):
    """``--minicpmo-share 0.5``: every other caller speaks the MiniCPM-o Realtime dialect
    (session.init with a reference recording of its voice, float32 in and out) on the same
    server; each hears its reply, and the step sums callers per dialect."""
    deploy = _deploy()
    engine = DuplexEngine(deploy, build_models(deploy, seed=0))
    with LoopbackServer(create_app(engine, deploy)) as srv:
        argv = ["--url", srv.ws_url(REALTIME_PATH), "--sessions", "2", "--duration", str(DURATION),
                "--ramp", "0", "--user-units", "2,2", "--max-lead-units", "0", "--reply-min-units", str(REPLY[0]),
                "--reply-max-units", str(REPLY[1]), "--drain", "8", "--minicpmo-share", "0.5", "--out", str(tmp_path)]
        assert cli_main(["bench", "serve", *argv]) == 0
        added = engine.stats().reference_voices_added
    results = json.loads((tmp_path / "results.json").read_text())
    (step,) = results["steps"]
    assert results["config"]["minicpmo_share"] == 0.5
    assert [row["dialect"] for row in step["per_session"]] == ["openai", "minicpmo"]
    for row in step["per_session"]:
        assert row["errors"] == [] and row["replies_done"] == row["replies_with_audio"] == 1, row
        assert row["audio_received_s"] == pytest.approx(row["audio_scheduled_s"] + 0.12 + 0.16)
    assert step["sessions_by_dialect"] == {"openai": {"sessions": 1, "with_audio": 1, "with_errors": 0},
                                           "minicpmo": {"sessions": 1, "with_audio": 1, "with_errors": 0}}
    assert added == 1   # the MiniCPM-o caller's voice came from its reference recording
    assert [serve.caller_dialect(i, 0.25) for i in range(8)].count("minicpmo") == 2


def _parsed(argv: list[str]):
    import argparse

    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    return parser.parse_args(argv)


def test_nothing_listening_fails_at_once(tmp_path, capsys):
    """A wrong --url used to run the whole sweep and report "errors in N sessions", exit 0."""
    import socket

    with socket.socket() as probe:   # a port nothing listens on once closed
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    args = _parsed(["--url", f"ws://127.0.0.1:{port}/v1/realtime", "--duration", "30", "--out", str(tmp_path)])
    assert serve.run(args, []) == 1
    assert f"nothing answers at http://127.0.0.1:{port}" in capsys.readouterr().err
    assert not (tmp_path / "results.json").exists()


def _health_app(answers: list[int], failed: bool = False):
    """/health answers 503 "warming" (or "warmup_failed") while ``answers`` says 503, then 200 (the
    last answer repeats)."""
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse

    app, asked = FastAPI(), []

    @app.get("/health")
    async def health() -> JSONResponse:
        code = answers[min(len(asked), len(answers) - 1)]
        asked.append(code)
        if code == 503 and failed:
            return JSONResponse({"status": "warmup_failed", "error": "CUDA out of memory"}, status_code=503)
        return JSONResponse({"status": "warming" if code == 503 else "ok"}, status_code=code)

    return app, asked


def test_a_warming_server_is_waited_for():
    import asyncio

    import httpx

    app, asked = _health_app([503, 503, 200])
    srv = LoopbackServer(app).start(wait_ready=False)
    try:
        async def wait() -> None:
            async with httpx.AsyncClient() as client:
                await serve.wait_ready(client, f"http://127.0.0.1:{srv.port}", timeout=30, poll_s=0.05)

        asyncio.run(wait())
    finally:
        srv.stop()
    assert asked == [503, 503, 200]


def test_a_server_still_warming_after_ready_timeout_fails(tmp_path, capsys):
    app, asked = _health_app([503])
    srv = LoopbackServer(app).start(wait_ready=False)
    try:
        args = _parsed(["--url", srv.ws_url(REALTIME_PATH), "--ready-timeout", "1", "--out", str(tmp_path)])
        assert serve.run(args, []) == 1
    finally:
        srv.stop()
    assert "still warming up after 1 s (--ready-timeout)" in capsys.readouterr().err
    # the wait starts at the first "warming" answer: one more poll a second later, then it gives up
    assert len(asked) == 2


def test_voices_the_server_lacks_fail_before_the_first_step(tmp_path, capsys):
    """Every caller asking for a voice the server does not have would be refused at its
    session.update; the bench says so at once (exit 2) instead of running the sweep."""
    import asyncio

    import httpx
    from fastapi.responses import JSONResponse

    app, _ = _health_app([200])

    @app.get("/v1/voices")
    async def voices() -> JSONResponse:
        return JSONResponse({"voices": ["alt", "default"], "default": "default", "aliases": {"marin": "default"}})

    bare, _ = _health_app([200])   # a server without /v1/voices is not checked
    srv, srv_bare = LoopbackServer(app).start(), LoopbackServer(bare).start()
    try:
        args = _parsed(["--url", srv.ws_url(REALTIME_PATH), "--voices", "default,alloy", "--out", str(tmp_path)])
        assert serve.run(args, []) == 2

        async def check(port: int, voices: list[str]) -> None:
            async with httpx.AsyncClient() as client:
                await serve.check_voices(client, f"http://127.0.0.1:{port}", voices)

        asyncio.run(check(srv.port, ["default", "alt", "marin"]))   # an alias the server maps is fine
        asyncio.run(check(srv_bare.port, ["alloy"]))
    finally:
        srv.stop()
        srv_bare.stop()
    err = capsys.readouterr().err
    assert "has no voice 'alloy' (it has: alt, default); pick from those with --voices" in err
    assert not (tmp_path / "results.json").exists()


def test_a_steps_most_common_errors_count_sessions():
    rows = [{"errors": ["capacity_memory: full (x40)", "timeout"]}, {"errors": ["capacity_memory: full"]},
            {"errors": ["capacity_memory: full (x3)", "capacity_memory: full"]}, {"errors": []}]
    assert serve.top_errors(rows) == [["capacity_memory: full", 3], ["timeout", 1]]
    assert serve.top_errors(rows, limit=1) == [["capacity_memory: full", 3]]


def test_a_server_with_a_key_is_benchmarked_with_the_key_from_the_environment(tmp_path, monkeypatch):
    """DUPLEXCACHE_API_KEY, the variable serve reads, reaches the callers' WebSockets and /metrics;
    without it every caller is turned away (401) and the results say so; the key is never written."""
    deploy = _deploy()
    deploy.server.api_key = "sekrit-key"
    engine = DuplexEngine(deploy, build_models(deploy, seed=0))
    argv = ["--sessions", "1", "--duration", "3", "--ramp", "0", "--user-units", "1,1", "--max-lead-units", "0",
            "--reply-min-units", str(REPLY[0]), "--reply-max-units", str(REPLY[1]), "--drain", "4"]
    with LoopbackServer(create_app(engine, deploy)) as srv:
        url = srv.ws_url(REALTIME_PATH)
        monkeypatch.delenv("DUPLEXCACHE_API_KEY", raising=False)
        assert serve.run(_parsed(["--url", url, *argv, "--out", str(tmp_path / "without")]), argv) == 0
        monkeypatch.setenv("DUPLEXCACHE_API_KEY", "sekrit-key")
        assert serve.run(_parsed(["--url", url, *argv, "--out", str(tmp_path / "with")]), argv) == 0
    without = json.loads((tmp_path / "without" / "results.json").read_text())
    (row,) = without["steps"][0]["per_session"]
    assert "401" in row["errors"][0] and without["config"]["api_key"] is False
    assert "(Missing or incorrect API key" in row["errors"][0]   # the server's words, from the refusal's body
    text = (tmp_path / "with" / "results.json").read_text()
    results = json.loads(text)
    (row,) = results["steps"][0]["per_session"]
    assert row["sid"] is not None and not row["errors"], row["errors"]
    assert results["steps"][0]["late_ticks"] is not None      # /metrics, behind the key, was read
    assert results["config"]["api_key"] is True and "sekrit-key" not in text


def test_a_server_whose_warm_up_failed_fails_at_once(tmp_path, capsys):
    app, asked = _health_app([503], failed=True)
    srv = LoopbackServer(app).start(wait_ready=False)
    try:
        assert serve.run(_parsed(["--url", srv.ws_url(REALTIME_PATH), "--out", str(tmp_path)]), []) == 1
    finally:
        srv.stop()
    assert "failed its warm-up: CUDA out of memory" in capsys.readouterr().err and len(asked) == 1
