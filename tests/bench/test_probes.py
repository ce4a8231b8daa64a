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
import yaml

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


def test_warm_start_report(tmp_path, capsys):
    """The warm-start probe on CPU (tiny, small budget): the report's shape and counters."""
    cfg = tmp_path / "small.yaml"
    cfg.write_text(yaml.safe_dump({"engine": {"memory_budget": "128MiB", "activation_reserve": "16MiB"},
                                   "stage0": {"window": {"high_tokens": 400, "low_tokens": 200}}}))
    assert _run("warm_start", ["--config", str(cfg), "--sessions", "2", "--ticks", "1", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "warm_start.json").read_text())
    assert result == json.loads(capsys.readouterr().out)
    assert result["config"]["sessions"] == 2 and result["config"]["planned_sessions"] == 16   # 128 MiB less the fixed bytes (an arena of new keys only, issue 43)
    assert result["warmup"]["graphs"] == 0                  # CPU: nothing to capture
    assert result["graph_captures"] == {"warmup": 0, "tick": 0}
    assert [t["tick"] for t in result["per_tick"]] == [1] and len(result["first_audio_tick"]) == 2


def test_warm_start_checks_its_configs_device_and_reports_a_bad_config(tmp_path, monkeypatch, capsys):
    """The warm-start probe has no --device: the device is the --config's model.device, checked
    before anything is built; a config that does not load, or a checkpoint that does not, is one
    line, not a traceback."""
    from duplexcache.config import DeployConfig

    warm_start = _probe("warm_start")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    built = []
    monkeypatch.setattr(warm_start, "measure", lambda *a: built.append(a) or {})

    def run(argv: list[str]) -> int:
        parser = argparse.ArgumentParser()
        warm_start.add_arguments(parser)
        return warm_start.run(parser.parse_args(argv))

    cuda_yaml = tmp_path / "cuda.yaml"
    deploy = DeployConfig.default("tiny")
    deploy.model.device = "cuda"
    cuda_yaml.write_text(deploy.to_yaml())
    assert run(["--config", str(cuda_yaml)]) == 2
    assert "but this torch" in capsys.readouterr().err and not built
    assert run(["--config", str(tmp_path / "missing.yaml")]) == 2
    assert "warm-start: error:" in capsys.readouterr().err and not built
    bad = tmp_path / "bad.yaml"
    bad.write_text("engine: {no_such_key: 1}\n")
    assert run(["--config", str(bad)]) == 2
    assert "no_such_key" in capsys.readouterr().err and not built
    cpu_yaml = tmp_path / "cpu.yaml"
    cpu_yaml.write_text(DeployConfig.default("tiny").to_yaml())
    assert run(["--config", str(cpu_yaml), "--sessions", "1"]) == 0 and len(built) == 1


def test_warm_start_checkpoint_that_does_not_load_is_one_line(tmp_path, capsys):
    """A --config whose model.checkpoint_dir is wrong: the probe says so in one line."""
    from duplexcache.config import DeployConfig

    deploy = DeployConfig.default("tiny")
    deploy.model.checkpoint_dir = str(tmp_path / "nowhere")
    path = tmp_path / "deploy.yaml"
    path.write_text(deploy.to_yaml())
    assert _run("warm_start", ["--config", str(path), "--sessions", "1", "--ticks", "1"]) == 2
    assert capsys.readouterr().err.strip() == (f"duplexcache bench warm-start: error: checkpoint: config: no checkpoint "
                                               f"at {tmp_path / 'nowhere'} (no such file or directory)")


def test_dit_conv_forms(tmp_path):
    """The DiT conv probe's GEMM form is the module's function (float64: equal to 1e-12, caches
    too) and the run reports both forms per dtype; a bad dtype is a usage error."""
    probe = _probe("dit_conv_forms")
    from duplexcache.models.flow import CausalConvBlock

    torch.manual_seed(0)
    block = CausalConvBlock(16, 16, kernel_size=3).double()
    x, cache = torch.randn(3, 7, 16, dtype=torch.float64), torch.randn(3, 32, 2, dtype=torch.float64)
    want, want_cache = block.forward_chunk(x, cache)
    got, got_cache = probe.gemm_forward_chunk(block, x, cache)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    assert torch.equal(got_cache[:, :16], want_cache[:, :16])   # conv1's cache: the input's last frames
    torch.testing.assert_close(got_cache, want_cache, rtol=1e-12, atol=1e-12)
    assert _run("dit_conv_forms", ["--preset", "tiny", "--device", "cpu", "--rows", "4", "--frames", "6",
                                   "--warmup", "0", "--repeats", "2", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "results.json").read_text())
    assert [r["dtype"] for r in result["dtypes"]] == ["bfloat16", "float32"]
    f32 = result["dtypes"][1]
    assert set(f32["timings"]) == {"module", "gemm"} and f32["timings"]["gemm"]["repeats"] == 2
    assert f32["max_abs_error_vs_float64"]["gemm"] < 1e-4 and f32["max_abs_error_vs_float64"]["module"] < 1e-4
    assert _run("dit_conv_forms", ["--dtypes", "float16", "--out", str(tmp_path)]) == 2
