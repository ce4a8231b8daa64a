"""``duplexcache bench BENCHMARK``: every benchmark is a subcommand that reaches its own module.

The dispatch test fails for a subcommand wired to the wrong module (or to none); the runs below
drive the benchmarks that no other test runs through the command line, briefly, on tiny/CPU
(memory, ticks, setup and serve run through it in their own test files).
"""
from __future__ import annotations

import importlib
import json
import subprocess
import sys

import pytest
import torch

from duplexcache.bench.cli import BENCHMARKS, with_default_benchmark
from duplexcache.cli import build_parser
from duplexcache.cli import main as cli_main

# The smallest arguments each benchmark's parser accepts.
REQUIRED = {"serve": ["--url", "ws://127.0.0.1:9/v1/realtime"], "soak": ["--url", "ws://127.0.0.1:9/v1/realtime"],
            "kernels": ["--out", "x"], "stage2": ["--out", "x"]}


def test_every_benchmark_is_a_subcommand():
    assert list(BENCHMARKS) == ["memory", "ticks", "serve", "soak", "setup", "kernels", "stage2",
                                "stage0-bytes"]


@pytest.mark.parametrize("name", list(BENCHMARKS))
def test_subcommand_reaches_its_module(name):
    module = importlib.import_module(BENCHMARKS[name][0])
    args = build_parser().parse_args(["bench", name, *REQUIRED.get(name, [])])
    assert args.command == "bench" and args.benchmark == name
    assert args._run is module.run


def test_no_benchmark_named_is_memory():
    """The command as it was before it had benchmarks (the commands recorded with older results)."""
    assert with_default_benchmark(["bench", "--preset", "tiny"]) == ["bench", "memory", "--preset", "tiny"]
    assert with_default_benchmark(["-v", "bench"]) == ["-v", "bench", "memory"]
    for unchanged in (["bench", "ticks", "--ticks", "1"], ["bench", "--help"], ["serve", "--config", "bench"],
                      ["-v", "demo"], []):
        assert with_default_benchmark(unchanged) == unchanged
    args = build_parser().parse_args(with_default_benchmark(["bench", "--preset", "tiny", "--sessions", "1,2"]))
    assert args.benchmark == "memory" and args.sessions == "1,2"
    assert args._run is importlib.import_module(BENCHMARKS["memory"][0]).run


def test_python_dash_m_is_an_alias_of_the_subcommand():
    """``python -m duplexcache.bench.<module>`` runs the subcommand that names that module."""
    for name, (module, _) in BENCHMARKS.items():
        source = importlib.import_module(module).__file__
        text = open(source).read()
        if '__name__ == "__main__"' in text:
            assert f'alias_main("{name}")' in text, module
    out = subprocess.run([sys.executable, "-m", "duplexcache.bench.stage0_bytes", "--preset", "tiny",
                          "--contexts", "40", "--high", "64", "--dtype", "float32"],
                         capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 0, out.stderr
    assert "Stage 0 KV per session, preset tiny, float32" in out.stdout
    assert out.stdout.count("\n| 40 |") == 2   # start and full window


def test_stage0_bytes(capsys):
    assert cli_main(["bench", "stage0-bytes", "--preset", "tiny", "--contexts", "40", "100", "--high", "64"]) == 0
    assert capsys.readouterr().out.count("| full window (+64) |") == 2
    # fp8 KV: the closed form and a real KVCacheManager over fp8 block bytes agree (the bench
    # raises otherwise), and a block costs head_dim + 4 bytes per (token, kv head) and K/V
    from duplexcache.bench.stage0_bytes import table_rows
    from duplexcache.models.thinker import ThinkerConfig

    cfg = ThinkerConfig.minicpmo45()
    fp8 = table_rows(cfg, [96], 8000, torch.bfloat16, 16, torch.float8_e4m3fn)
    exact = table_rows(cfg, [96], 8000, torch.bfloat16, 16)
    full_fp8, full_exact = fp8[1]["off"].private, exact[1]["off"].private
    assert full_fp8 * 2 * 128 == full_exact * (128 + 4)
    assert cli_main(["bench", "stage0-bytes", "--kv-cache-dtype", "fp8_e4m3", "--contexts", "96"]) == 0
    assert "74.25 KiB/token" in capsys.readouterr().out








def test_stage2_tiny_on_cpu(tmp_path, capsys):
    rc = cli_main(["bench", "stage2", "--preset", "tiny", "--device", "cpu", "--batches", "1", "--chunks", "1",
                   "--warmup", "2", "--grid", "1", "--prompt-frames", "100", "--no-grid-run", "--no-reference",
                   "--out", str(tmp_path)])
    assert rc == 0
    res = json.loads((tmp_path / "results.json").read_text())
    assert [m["sharing"] for m in res["modes"]] == [False, True]
    assert res["equality"]["all_equal"] and res["equality"]["compared"] == 3   # 1 session x (2 + 1) chunks
    assert (tmp_path / "results.md").read_text() in capsys.readouterr().out
    assert cli_main(["bench", "stage2", "--out", str(tmp_path), "--warmup", "1"]) == 2


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the kernels bench runs for minutes")
def test_kernels_says_it_needs_cuda(tmp_path, capsys):
    assert cli_main(["bench", "kernels", "--out", str(tmp_path), "--quick"]) == 1
    assert "needs CUDA" in capsys.readouterr().err
    assert cli_main(["bench", "kernels", "--out", str(tmp_path), "--repeats", "3"]) == 2


def test_gpu_bench_script_commands_parse():
    """Every `duplexcache bench` step of scripts/gpu_bench.sh and scripts/probes/gpu_probes.sh names
    a benchmark and options it has (the scripts run on a GPU machine only, where a typo would cost a run)."""
    import re
    import shlex
    from pathlib import Path

    scripts = Path(__file__).parents[2] / "scripts"
    script = "\n".join((scripts / name).read_text()
                       for name in ("gpu_bench.sh", "gpu_bench_lib.sh", "probes/gpu_probes.sh"))
    script = script.replace("\\\n", " ")
    # every script a step runs is where the step says (run from the repository root)
    paths = re.findall(r"python3 (scripts/\S+\.py)", script)
    assert paths
    for path in paths:
        assert (scripts.parent / path).is_file(), path
    shell_vars = {"out": "/tmp/out", "port": "8000", "sessions": "4", "duration": "10", "REPLY_LATENCY_S": "3.5",
                  "name": "step", "kv": "auto", "arm": "on", "admitted": "3",
                  "small": "--memory-budget 512MiB", "counts": "8,16", "formats": ""}

    def expand(text: str) -> str:   # $VAR, ${VAR} and ${VAR:-default}
        return re.sub(r"\$\{(\w+)(?::-([^}]*))?\}|\$(\w+)",
                      lambda m: shell_vars.get(m.group(1) or m.group(3), m.group(2) or ""), text)

    # the options a mode passes to `bench serve` through SERVE_EXTRA are checked with it
    extras = re.findall(r'SERVE_EXTRA="([^"]*)"', script)
    assert extras
    commands = re.findall(r"python3 -m duplexcache\.cli (bench [^\n]*)", script)
    assert len(commands) >= 15
    for line in commands:
        for extra in extras if "SERVE_EXTRA" in line else [""]:
            shell_vars["SERVE_EXTRA"] = expand(extra)
            soak = "--interval" in extra   # the soak mode's options go to `bench soak` (SERVE_BENCH=soak)
            shell_vars["SERVE_BENCH"] = "soak" if soak else "serve"
            args = build_parser().parse_args(shlex.split(expand(line.split(" >")[0].split(";;")[0])))
            assert args.benchmark in BENCHMARKS, line
            if soak:
                assert args.benchmark == "soak" and (args.window_high, args.window_low) == (1024, 512), line
            if "--long-context-callers" in extra:
                assert args.long_context_callers == 1 and args.long_context_chars == 15000, line
            if "--minicpmo-share" in extra:   # card_dialects: half the callers on each dialect
                assert args.minicpmo_share == 0.5, line


def test_gpu_benchmarks_dispatch_without_the_config_stack(tmp_path):
    """The GPU image has torch and triton but no pydantic: `duplexcache bench kernels|stage2` must
    still reach their modules (the benchmarks that need the config are listed as unavailable)."""
    code = ("import sys; sys.modules['pydantic'] = None\n"
            "from duplexcache.cli import main\n"
            f"sys.exit(main(['bench', 'kernels', '--quick', '--out', {str(tmp_path)!r}]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == (0 if torch.cuda.is_available() else 1), out.stderr
    assert torch.cuda.is_available() or "needs CUDA" in out.stderr
    code = code.replace("'kernels', '--quick'", "'ticks', '--ticks', '1'")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 2 and "unavailable" in out.stderr and "pydantic" in out.stderr


@pytest.mark.parametrize("argv", [["ticks", "--preset", "minicpmo45"],          # minicpmo45's default device
                                  ["memory", "--device", "cuda"], ["stage2", "--out", "x"],
                                  ["setup", "--preset", "minicpmo45"]])   # its default device was cpu
def test_a_cuda_benchmark_without_cuda_says_so_before_building(argv, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    ran = []
    for module, _ in BENCHMARKS.values():   # the parser takes each module's run: record, build nothing
        monkeypatch.setattr(importlib.import_module(module), "run", lambda args: ran.append(args) or 0)
    assert cli_main(["bench", *argv]) == 2
    assert "but this torch" in capsys.readouterr().err and not ran
    assert cli_main(["bench", "ticks", "--preset", "tiny"]) == 0 and len(ran) == 1   # CPU: not stopped


@pytest.mark.parametrize("argv, said", [
    (["--sessions", "1"], "--sessions needs >= 2"),
    (["--sessions", "a,b"], "comma-separated ints"),
    (["--memory-budget", "lots"], "cannot parse byte size 'lots'"),
    (["--config", "/no/such/deploy.yaml"], "No such file or directory"),
    (["--window-high", "10", "--window-low", "100"], "low_tokens (100) must be below high_tokens (10)"),
])
def test_memory_bad_options_are_one_line(argv, said, capsys):
    """`duplexcache bench memory` (the default benchmark) raised a traceback for each of these."""
    assert cli_main(["bench", "memory", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("duplexcache bench memory: error:") and said in err, err


@pytest.mark.parametrize("argv", [["memory"], ["ticks"], ["setup"], ["stage2", "--device", "cpu"],
                                  ["serve", "--url", "ws://127.0.0.1:9/v1/realtime"]])
def test_an_out_that_cannot_be_a_directory_is_refused_before_the_run(argv, tmp_path, monkeypatch, capsys):
    """Results are first written after the first step (after a warm-up and a minute of callers):
    an --out under a file must fail before anything runs, and nothing is created to find out."""
    ran = []
    for module, _ in BENCHMARKS.values():
        monkeypatch.setattr(importlib.import_module(module), "run", lambda args: ran.append(args) or 0)
    a_file = tmp_path / "results.json"
    a_file.write_text("{}")
    for out in (a_file, a_file / "sub"):
        assert cli_main(["bench", *argv, "--out", str(out)]) == 2
        assert f"{a_file} is a file, not a directory" in capsys.readouterr().err and not ran
    fresh = tmp_path / "new" / "dir"
    assert cli_main(["bench", *argv, "--out", str(fresh)]) == 0 and len(ran) == 1
    assert not (tmp_path / "new").exists()   # the benchmark creates it when it writes
