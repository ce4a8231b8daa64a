"""The Stage-2 GPU benchmark's shape-only parts and its import hygiene (no GPU needed)."""
import subprocess
import sys

from duplexcache.bench.gpu_stage2 import arena_bytes
from duplexcache.cfm import Code2WavConfig
from duplexcache.models.flow import FlowConfig


def test_arena_bytes_rows_from_grid_halves_the_arena():
    cfg = Code2WavConfig(max_num_seqs=32)
    res = arena_bytes(FlowConfig.minicpmo45(), cfg, 24, (1, 4, 8, 16))
    off, on = res["off"], res["on"]
    assert (off["rows"], on["rows"]) == (32, 16)
    # attention slots dominate: 10 steps x 16 layers x 2 cfg x 8 heads x 128 x 4 B = 1.25 MiB per frame,
    # a row's keys = the 56-frame chunk's new keys (the prompt is read from the bank, the private
    # delta from the session's own storage)
    frame = 10 * 16 * 2 * 8 * 128 * 4
    att_per_row = frame * 56
    assert att_per_row * 32 < off["bytes"] < att_per_row * 32 * 1.1   # + conv caches, mel buffers (~8 %)
    # per-row buffers halve; the bank's zero frame and the adaLN outputs per (step, layer) are per arena
    fixed = frame + (10 * 16 * 9 + 10 * 2) * 512 * 4
    assert 2 * (on["bytes"] - fixed) == off["bytes"] - fixed
    assert on["replay_groups"] == [[0, 16, 16], [16, 8, 8]]


def test_bench_imports_neither_config_nor_web_libraries():
    code = ("import sys, duplexcache.bench.gpu_stage2, duplexcache.cfm; "
            "bad = [m for m in sys.modules if m.split('.')[0] in ('pydantic', 'fastapi', 'yaml', 'starlette') "
            "or m == 'duplexcache.config']; print(bad); sys.exit(1 if bad else 0)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 0, out.stdout + out.stderr


def test_args():
    from duplexcache.cli import build_parser

    a = build_parser().parse_args(["bench", "stage2", "--out", "x", "--batches", "32,1,8"])
    assert a.batches == [1, 8, 32] and a.grid == (1, 4, 8, 16, 32)
