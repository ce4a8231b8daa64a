"""``duplexcache bench soak`` (issue 46) against a real tiny server (real engine, reply policy) on
127.0.0.1: a short soak with a tiny Thinker window compacts every caller's window at least
twice, records a row per interval with the server's figures, and writes the JSON, CSV and plot.
Plus the pure pieces (the /metrics reading, the window option) on hand-made inputs."""

from __future__ import annotations

import csv
import json

import pytest
import torch

from duplexcache.bench import soak
from duplexcache.cli import main as cli_main
from duplexcache.config import DeployConfig
from duplexcache.runtime.bundle import build_models
from duplexcache.runtime.engine import DuplexEngine
from duplexcache.server.app import REALTIME_PATH, create_app
from duplexcache.server.loopback import LoopbackServer
from duplexcache.server.metrics import ServerMetrics

torch.set_num_threads(1)  # 2 shared cores

SECONDS = 16
WINDOW = (48, 32)   # high, low: a block of 16 tokens dropped at each compaction


def test_a_short_soak_compacts_every_window_and_records_rows(tmp_path, capsys):
    deploy = DeployConfig.default("tiny")
    deploy.engine.speak_policy.mode = "reply"
    deploy.engine.speak_policy.reply_min_units, deploy.engine.speak_policy.reply_max_units = 2, 3
    deploy.engine.tick_seconds = 0.25
    deploy.engine.tick_headroom = 1e9   # admission by memory: a busy CI box must not refuse a caller
    engine = DuplexEngine(deploy, build_models(deploy, seed=0))
    with LoopbackServer(create_app(engine, deploy)) as srv:
        argv = ["bench", "soak", "--url", srv.ws_url(REALTIME_PATH), "--sessions", "2", "--duration", str(SECONDS),
                "--interval", "4", "--ramp", "0", "--window-high", str(WINDOW[0]), "--window-low", str(WINDOW[1]),
                "--reply-min-units", "2", "--reply-max-units", "3", "--out", str(tmp_path)]
        assert cli_main(argv) == 0
        compactions = engine.stats().window_compactions
    results = json.loads((tmp_path / "soak.json").read_text())
    rows = results["rows"]
    assert len(rows) >= SECONDS // 4 and [r["interval"] for r in rows] == list(range(len(rows)))
    assert results["config"]["window"] == {"high_tokens": WINDOW[0], "low_tokens": WINDOW[1]}
    assert results["sessions_with_errors"] == 0, results["errors_first"]
    # every window compacted at least twice; the soak's count is the server's own (per caller)
    assert results["compactions_per_session"] >= 2
    assert results["compactions_per_session"] == pytest.approx(compactions / 2)
    per_session = [r["compactions_per_session"] for r in rows]
    assert per_session == sorted(per_session)   # cumulative
    # the server's figures reached each row: memory in use, bytes per pool, late ticks, replies
    for row in rows:
        assert row["memory_bytes"] > 0 and row["memory_resident_bytes"] == row["memory_bytes"]
        assert row["pool_thinker_kv_bytes"] >= 0 and row["late_ticks"] is not None
    assert sum(r["replies"] for r in rows) >= 2 and any(r["reply_latency_p50_s"] for r in rows)
    assert set(results["first_vs_last"]) == set(soak.COMPARED)
    with open(tmp_path / "soak.csv") as f:
        table = list(csv.DictReader(f))
    assert len(table) == len(rows) and "compactions_per_session" in table[0]
    assert (tmp_path / "soak.png").stat().st_size > 10_000
    printed = capsys.readouterr().out
    assert "reply_latency_p99_s" in printed and "first" in printed and "compactions per session" in printed


def test_metrics_text_is_read_into_a_rows_figures():
    """From the server's own exposition (server/metrics.py), not a hand-written imitation."""
    metrics = ServerMetrics()
    metrics.late_ticks.inc(3)
    metrics.window_compactions.inc(10)
    metrics.live_sessions.set(4)
    for tier, value in (("shared", 100), ("private", 50), ("free", 999)):
        metrics.bytes.labels(pool="thinker_kv", tier=tier).set(value)
    metrics.memory_in_use.labels(kind="device_used").set(7)
    metrics.memory_in_use.labels(kind="reserved").set(5)
    text = metrics.render()[0].decode()
    figures = soak.server_figures(text)
    assert figures == {"late_ticks": 3.0, "compactions": 10.0, "live_sessions": 4.0, "pools": {"thinker_kv": 150.0},
                       "memory": {"device_used": 7.0, "reserved": 5.0}}
    assert soak.memory_of(figures) == 7.0   # the card's used bytes on CUDA
    before = {**figures, "late_ticks": 1.0}
    row = soak.make_row(0, 0.0, 1.0, [], before, figures, callers=4, since=0.0)
    assert row["late_ticks"] == 2.0 and row["compactions_per_session"] == 2.5 and row["held_bytes"] == 150.0
    assert row["replies"] == 0 and row["reply_latency_p50_s"] is None


def test_window_options_are_checked(capsys):
    url = ["--url", "ws://127.0.0.1:9/v1/realtime"]
    assert cli_main(["bench", "soak", *url, "--window-low", "8"]) == 2
    assert "--window-low needs --window-high" in capsys.readouterr().err
    assert cli_main(["bench", "soak", *url, "--window-high", "64", "--window-low", "64"]) == 2
    assert "must be below" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli_main(["bench", "soak", *url, "--window-high", "0"])
    wire = soak.windowed_wire({"high_tokens": 64, "low_tokens": 32})
    assert json.loads(wire.session_update("default", "hi"))["session"]["window"] == {"high_tokens": 64,
                                                                                      "low_tokens": 32}
