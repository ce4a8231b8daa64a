"""duplexcache/verify/common.py: the error measure, exit-code policy, source arguments and table."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import torch

from duplexcache.verify import common


def test_relative_error_definition():
    ref = torch.tensor([[1.0, -4.0], [2.0, 0.5]], dtype=torch.float64)  # exact differences
    ours = ref + torch.tensor([[0.0, 0.0], [0.002, -0.001]], dtype=torch.float64)
    assert common.relative_error(ours, ref) == pytest.approx(0.002 / 4.0, rel=1e-9)
    assert common.relative_error(ref, ref) == 0.0
    assert common.relative_error(ours[:1], ref) == float("inf")  # never broadcast
    nan = ours.clone()
    nan[0, 0] = float("nan")
    assert not common.relative_error(nan, ref) <= 1.0  # NaN fails every tolerance


def test_report_prints_table_and_returns_exit_code(capsys):
    code = common.report("thing", "/ckpt (x)", {"dense": 2e-6, "paged prefill": 3e-5}, 1e-5, "1e-05, float32")
    assert code == common.EXIT_FAIL == 1
    assert capsys.readouterr().out.splitlines() == [
        "verify thing: /ckpt (x); relative error = max|ours - ref| / max|ref|",
        "  dense          2.000e-06  ok",
        "  paged prefill  3.000e-05  FAIL",
        "verify thing: FAIL (tolerance 1e-05, float32)",
    ]
    assert common.report("thing", "p", {"a": 1e-5}, 1e-5, "1e-05") == common.EXIT_PASS == 0  # bound is inclusive
    assert capsys.readouterr().out.splitlines()[-1] == "verify thing: PASS (tolerance 1e-05)"
    with pytest.raises(ValueError, match="no compared paths"):
        common.report("thing", "p", {}, 1e-5, "1e-05")


def test_exit_unusable(capsys):
    assert common.exit_unusable("thing", "cannot load /x: broken") == common.EXIT_UNUSABLE == 2
    assert capsys.readouterr().out == "verify thing: cannot load /x: broken\n"


def _parse(argv):
    parser = argparse.ArgumentParser()
    common.add_source_arguments(parser, {"tiny": None, "big": None}, checkpoint_help="a dir")
    return parser.parse_args(argv)


def test_source_arguments_and_errors():
    args = _parse(["--preset", "tiny", "--random-weights", "--seed", "3"])
    assert (args.preset, args.random_weights, args.seed, args.checkpoint) == ("tiny", True, 3, None)
    assert common.source_error(args) is None
    assert common.source_error(_parse(["--checkpoint", "/x"])) is None
    assert "--preset needs --random-weights" in common.source_error(_parse(["--preset", "tiny"]))
    assert "--random-weights needs --preset" in common.source_error(_parse(["--checkpoint", "/x", "--random-weights"]))
    for argv in (["--checkpoint", "/x", "--preset", "tiny"], [], ["--preset", "huge"]):
        with pytest.raises(SystemExit):
            _parse(argv)


def test_run_on_source_saves_random_weights_to_a_temp_dir_then_removes_it():
    seen = {}

    def save(config, path, seed):
        seen.update(config=config, seed=seed)
        (Path(path) / "weights").write_text("w")

    def verify_dir(path):
        seen["path"] = Path(path)
        seen["files"] = sorted(p.name for p in Path(path).iterdir())
        return 7

    args = _parse(["--preset", "tiny", "--random-weights", "--seed", "4"])
    assert common.run_on_source("thing", args, {"tiny": lambda: "cfg"}, save, verify_dir) == 7
    assert (seen["config"], seen["seed"], seen["files"]) == ("cfg", 4, ["weights"])
    assert seen["path"].name.startswith("duplexcache-thing-") and not seen["path"].exists()
    checkpoint = _parse(["--checkpoint", "/some/dir"])
    assert common.run_on_source("thing", checkpoint, {}, save, lambda p: p) == "/some/dir"
