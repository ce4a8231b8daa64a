"""The probe scripts of scripts/probes/ that measure (runs of an earlier round: docs/results/HISTORY.md),
driven through their own argument parsers, briefly, on tiny/CPU: prefill isolation (the slack
between ticks), the capacity mode's fp8 K/V error and Code2Wav-in-bfloat16 error; and the GIL profile's parser."""

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


def test_precision_tiny_on_cpu(tmp_path, capsys):
    """Code2Wav in bfloat16 against float32 on the same weights: the error is measured per session
    (non-zero: the arms really differ), the bytes halve where the flow's format decides them."""
    rc = _run("code2wav_precision", ["--preset", "tiny", "--sessions", "2", "--chunks", "4", "--batches", "1,2",
                                     "--warmup", "2", "--timed-chunks", "1", "--prompt-frames", "100", "--out", str(tmp_path)])
    assert rc == 0
    res = json.loads((tmp_path / "results.json").read_text())
    f32, bf16 = res["arms"]
    assert (f32["code2wav_dtype"], bf16["code2wav_dtype"]) == ("float32", "bfloat16")
    assert [r["session"] for r in res["error"]] == [0, 1]
    for r in res["error"]:
        assert 0 < r["mel_rel_error"] < 1 and math.isfinite(r["pcm_snr_db"]) and r["seconds"] == pytest.approx(4, abs=0.5)
    # the arena's int64 row indexes (its prompt-bank frame map) keep their size
    assert bf16["arena_index_bytes"] == f32["arena_index_bytes"] > 0
    assert (bf16["arena_bytes"] - bf16["arena_index_bytes"]) * 2 == f32["arena_bytes"] - f32["arena_index_bytes"]
    assert bf16["voice_bytes"] * 2 == f32["voice_bytes"]
    # the vocoder's caches stay float32: the stream's bytes fall by less than half
    assert f32["steady_private_bytes"] / 2 < bf16["steady_private_bytes"] < f32["steady_private_bytes"]
    assert bf16["admission_bytes"]["steady"]["private"] == bf16["steady_private_bytes"]
    assert [t["batch"] for t in f32["times"]] == [1, 2]
    assert (tmp_path / "results.md").read_text() in capsys.readouterr().out
    assert _run("code2wav_precision", ["--out", str(tmp_path), "--warmup", "1"]) == 2
