"""The probe scripts of scripts/probes/ that measure (runs of an earlier round: docs/results/HISTORY.md),
driven through their own argument parsers, briefly, on tiny/CPU: prefill isolation (the slack
between ticks) and the capacity mode's fp8 K/V error; and the GIL profile's parser."""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest
import torch

PROBES = Path(__file__).parents[2] / "scripts" / "probes"


def _probe(name: str):
    """scripts/probes/<name>.py as a module (its siblings importable, as when run as a script)."""
    if str(PROBES) not in sys.path:
        sys.path.insert(0, str(PROBES))
    spec = importlib.util.spec_from_file_location(f"probe_{name}", PROBES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run(name: str, argv: list[str]) -> int:
    module = _probe(name)
    parser = argparse.ArgumentParser()
    module.add_arguments(parser)
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:   # a refused option: argparse's exit code
        return int(exc.code)
    return module.run(args)


def test_prefill(tmp_path):
    """A context of 300 tokens in chunks of 128 opens after ceil(300 / 128) ticks, and the live
    sessions speak in every one of them."""
    torch.set_num_threads(1)
    rc = _run("prefill_isolation", ["--sessions", "2", "--warmup-ticks", "1", "--baseline-ticks", "1",
                   "--max-context-tokens", "300", "--prefill-chunk-tokens", "128", "--memory-budget", "256MiB",
                   "--threshold-ms", "1e9", "--out", str(tmp_path)])
    assert rc == 0
    result = json.loads((tmp_path / "results.json").read_text())
    assert result["max_context_tokens"] == 300 and result["ok"] is True
    assert len(result["prefill_ms"]["ticks"]) == math.ceil(300 / 128)
    assert result["sessions_with_events_per_prefill_tick"] == [2] * math.ceil(300 / 128)
    worst, base = max(result["prefill_ms"]["ticks"]), max(result["baseline_ms"]["ticks"])
    assert result["added_ms"] == pytest.approx(worst - base)    # like with like: max vs max (ms)
    assert _run("prefill_isolation", ["--baseline-ticks", "0"]) == 2


def test_prefill_between_ticks(tmp_path):
    """--between-ticks: the server's pacing emulated; the live sessions' ticks run no chunk
    while the slack has room (a 1000 s period leaves plenty), and every chunk is counted."""
    torch.set_num_threads(1)
    rc = _run("prefill_isolation", ["--sessions", "2", "--warmup-ticks", "1", "--baseline-ticks", "1",
                   "--max-context-tokens", "300", "--prefill-chunk-tokens", "128", "--memory-budget", "256MiB",
                   "--threshold-ms", "1e9", "--between-ticks", "--tick-seconds", "1000", "--out", str(tmp_path)])
    assert rc == 0
    result = json.loads((tmp_path / "results.json").read_text())
    assert result["prefill_between_ticks"] is True
    # the first tick leaves the new session to the slack, which then runs every chunk
    assert len(result["prefill_ms"]["ticks"]) == 1
    assert [len(c) for c in result["between_ticks_chunk_ms"]] == [math.ceil(300 / 128)]
    assert result["periods_overrun"] == 0


def test_kv_precision_tiny_on_cpu(tmp_path, capsys):
    """fp8 Thinker K/V against exact on the same weights and tokens: the arms really differ (KL
    > 0) but stay close (top-1 mostly kept), fp8 bytes per token are about half, and bad windows
    are refused before anything is built."""
    rc = _run("kv_precision", ["--preset", "tiny", "--sessions", "2", "--windows", "40,100",
                   "--decode", "4", "--chunk", "32", "--encoder-chunks", "4", "--out", str(tmp_path)])
    assert rc == 0
    res = json.loads((tmp_path / "results.json").read_text())
    assert [w["window"] for w in res["windows"]] == [40, 100] and all(w["steps"] == 8 for w in res["windows"])
    for w in res["windows"]:
        assert 0 < w["kl_mean"] <= w["kl_max"] < 0.5 and w["top1_agreement"] >= 0.5
        assert 0 < w["logits_rel_error_mean"] < 0.2
    b = res["bytes_per_token"]
    assert 0.5 < b["fp8_e4m3"] / b["auto"] < 0.6 or 0.25 < b["fp8_e4m3"] / b["auto"] < 0.35   # bf16 / float32 model
    enc = res["encoder"]   # the audio encoder's cache arm: 4 chunks of 2 sessions, fp8 vs exact
    assert enc["chunks"] == 4 and 0 < enc["rel_error_mean"] <= enc["rel_error_max"] < 0.05
    assert enc["bytes_per_session"]["fp8_e4m3"] < enc["bytes_per_session"]["auto"]
    assert (tmp_path / "results.md").read_text() in capsys.readouterr().out
    assert _run("kv_precision", ["--preset", "tiny", "--windows", "100,40", "--out", str(tmp_path)]) == 2
