"""duplexcache bench: fits, ceiling, floor, config matrix, and reduced end-to-end runs.

Reduced runs: tiny models, a 64/48-token window, Code2Wav max_num_seqs 4 and sessions 1, 2, so
all six configurations run on CPU in seconds, through the engine via the CLI (one module-scoped
run that several tests read).
"""

from __future__ import annotations

import json

import pytest
import torch

from duplexcache.bench import memory_sweep as bench_cli
from duplexcache.cli import main as cli_main
from duplexcache.runtime.memory.floor import session_floor
from duplexcache.bench.matrix import (
    SWITCHES,
    config_matrix,
    default_graph_grid,
    with_switches,
)
from duplexcache.bench.memory import (
    MIB,
    Tier,
    ceiling_from_fit,
    fit_slope,
    held_bytes,
    measured_ceiling,
)
from duplexcache.bench.report import (
    format_table,
    validate_report,
)
from duplexcache.bench.runner import compare_outputs
from duplexcache.cfm.config import Code2WavShape
from duplexcache.config import DeployConfig
from duplexcache.models.audio_encoder import AudioEncoderConfig
from duplexcache.models.thinker import ThinkerConfig

# ----------------------------------------------------------------------------- pure arithmetic



def assert_savings(by: dict) -> None:
    """all_on beats all_off per session; each sharing switch alone saves per-session bytes at
    setup; the arena switch saves fixed bytes (the arena), not per-session ones."""
    assert by["all_on"]["steady_slope_mib"] < by["all_off"]["steady_slope_mib"]
    assert by["all_on"]["setup_slope_mib"] < by["all_off"]["setup_slope_mib"]
    assert by["shared_anchor_blocks"]["setup_slope_mib"] < by["all_off"]["setup_slope_mib"]
    assert by["cfm_prompt_att_sharing"]["setup_slope_mib"] < by["all_off"]["setup_slope_mib"]
    arena = lambda name: by[name]["bytes_per_tier"]["steady"]["cfm_arena"]["shared"]  # noqa: E731
    assert arena("cfm_arena_rows_from_graph_grid") < arena("all_off")

def test_fit_slope_exact_line_and_spread():
    ns = [1, 2, 4, 8]
    held = [10 * MIB + 3 * MIB * n for n in ns]
    fit = fit_slope(ns, held)
    assert fit.slope_mib == pytest.approx(3.0) and fit.intercept_mib == pytest.approx(10.0)
    assert fit.step_min_mib == pytest.approx(3.0) == fit.step_max_mib
    assert fit.repeats == 3 and fit.max_residual_mib == pytest.approx(0.0, abs=1e-9)


def test_fit_slope_spread_shows_uneven_steps():
    # steps of 2, 4 MiB/session per added session -> lsq between them
    fit = fit_slope([1, 2, 3], [0, 2 * MIB, 6 * MIB])
    assert (fit.step_min_mib, fit.step_max_mib) == (pytest.approx(2.0), pytest.approx(4.0))
    assert fit.slope_mib == pytest.approx(3.0)


@pytest.mark.parametrize("ns,held", [([1], [5]), ([2, 2], [1, 2]), ([1, 2], [1])])
def test_fit_slope_rejects_bad_input(ns, held):
    with pytest.raises(ValueError):
        fit_slope(ns, held)


def test_ceiling_from_fit_and_measured():
    fit = fit_slope([1, 2], [12 * MIB, 14 * MIB])          # 10 MiB + 2 MiB/session
    assert ceiling_from_fit(fit, 30 * MIB) == 10           # 10 + 10*2 = 30 fits, 11 does not
    assert ceiling_from_fit(fit, 5 * MIB) == 0
    flat = fit_slope([1, 2], [MIB, MIB])
    with pytest.raises(ValueError, match="not positive"):
        ceiling_from_fit(flat, 30 * MIB)
    assert measured_ceiling([1, 2, 4], [10, 20, 40], 25) == 2
    assert measured_ceiling([1, 2, 4], [10, 20, 40], 45, tick_max_s=[0.5, 0.9, 1.2], realtime_s=1.0) == 2


def test_held_bytes_excludes_free_capacity():
    pools = {"a": Tier(shared=5, private=7, free=1000), "b": Tier(shared=0, private=3)}
    assert held_bytes(pools) == 15
    with pytest.raises(ValueError):
        Tier(shared=-1, private=0)


def test_floor_matches_hand_arithmetic_for_minicpmo45_shapes():
    # Qwen3-8B KV: 2 * 36 * 8 * 128 * 2 bytes = 144 KiB per token (SPEC section 1).
    # Estimator: 10 steps * 16 layers * 2 cfg * 8 heads * 128 * 4 bytes = 1.25 MiB per frame (SPEC section 3).
    f = session_floor(ThinkerConfig.minicpmo45(), 8000, Code2WavShape.minicpmo45(), 300,
                      AudioEncoderConfig.minicpmo45(), "bfloat16")
    assert f.thinker_window == 8000 * 144 * 1024
    assert f.code2wav_delta == 300 * 10 * 16 * 2 * 8 * 128 * 4  # Code2Wav stays float32 beside a bf16 Thinker
    assert f.audio_encoder_cache == 2 * 24 * 1500 * 1024 * 2
    assert f.total == f.thinker_window + f.code2wav_delta + f.audio_encoder_cache
    f32 = session_floor(ThinkerConfig.minicpmo45(), 8000, Code2WavShape.minicpmo45(), 300,
                        AudioEncoderConfig.minicpmo45(), torch.float32)
    assert f32.code2wav_delta == 300 * int(1.25 * MIB)
    # precision.kv_cache_dtype fp8_e4m3: 2 * 36 * 8 * (128 + 4) bytes = 74.25 KiB per token (scales included)
    fp8 = session_floor(ThinkerConfig.minicpmo45(), 8000, Code2WavShape.minicpmo45(), 300,
                        AudioEncoderConfig.minicpmo45(), "bfloat16", kv_storage_dtype=torch.float8_e4m3fn)
    assert fp8.thinker_window == 8000 * 2 * 36 * 8 * 132 and fp8.code2wav_delta == f.code2wav_delta


# ----------------------------------------------------------------------------- config matrix


def test_config_matrix_turns_on_exactly_one_switch_each():
    cfgs = config_matrix(DeployConfig.default("tiny", environ={}))
    assert [c.name for c in cfgs] == ["all_off", *SWITCHES, "all_on"]
    for c in cfgs:
        on = {name for name, (sec, key) in SWITCHES.items() if getattr(getattr(c.deploy, sec), key)}
        assert on == set(c.switches_on)
        # one grid in every configuration: only the arena switch changes the arena rows
        assert c.deploy.code2wav.graph_grid == (1, 2, 4, 8)
    rows = {c.name: c.deploy.code2wav.arena_rows for c in cfgs}
    assert rows["all_off"] == 16 and rows["cfm_arena_rows_from_graph_grid"] == 8 == rows["all_on"]


def test_config_matrix_errors():
    with pytest.raises(ValueError, match="unknown switch"):
        with_switches(DeployConfig.default("tiny", environ={}), ("no_such_switch",))
    with pytest.raises(ValueError, match="no graph tier"):
        default_graph_grid(1)
    assert default_graph_grid(32) == (1, 2, 4, 8, 16)


@pytest.mark.parametrize("text", ["1", "2,1", "1,1,2", "0,2", "a,b"])
def test_parse_sessions_rejects(text):
    with pytest.raises(ValueError):
        bench_cli.parse_sessions(text)


# ----------------------------------------------------------------------------- reduced sweep

def _small_base() -> DeployConfig:
    data = DeployConfig.default("tiny", environ={}).to_dict()
    data["stage0"]["window"].update(high_tokens=64, low_tokens=48)
    data["code2wav"]["max_num_seqs"] = 4
    return DeployConfig.from_dict(data, environ={})


def test_equality_check_can_fail():
    from duplexcache.bench.engine_target import SessionOutput

    a = {"s0": SessionOutput([1, 2], [torch.zeros(4)])}
    b = {"s0": SessionOutput([1, 2], [torch.tensor([0.0, 0.0, 0.0, 1e-9])])}
    assert compare_outputs("x", 1, a, b) == ["x n=1 s0: audio differs"]
    c = {"s0": SessionOutput([1, 3], [torch.zeros(4)])}
    assert compare_outputs("x", 1, c, a) == ["x n=1 s0: text differs"]


def test_cli_rejects_bad_budget_before_running(capsys):
    assert cli_main(["bench", "memory", "--memory-budget", "80 parsecs"]) == 2
    assert "unknown byte unit 'parsecs'" in capsys.readouterr().err


# ----------------------------------------------------------------------------- through the engine


@pytest.fixture(scope="module")
def engine_models():
    from duplexcache.runtime.bundle import build_models

    return build_models(_small_base())


@pytest.fixture(scope="module")
def engine_run(tmp_path_factory, engine_models):
    """One reduced run of ``duplexcache bench`` with no benchmark named (the memory benchmark
    through the engine): its output folder and its report."""
    from duplexcache.runtime import bundle

    out = tmp_path_factory.mktemp("bench")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(bundle, "build_models", lambda deploy, seed=0: engine_models)
        config = out / "deploy.yaml"
        config.write_text(_small_base().to_yaml())
        assert cli_main(["bench", "--preset", "tiny", "--config", str(config), "--sessions", "1,2",
                         "--memory-budget", "1GiB", "--realtime", "--out", str(out)]) == 0
    return out, json.loads((out / "report.json").read_text())


def test_cli_runs_reduced_engine(engine_run):
    """The three outputs, schema, PASS, savings."""
    tmp_path, report = engine_run
    assert (tmp_path / "memory.png").stat().st_size > 0
    validate_report(report)
    assert "all_off" in format_table(report)
    assert report["repeat_count"] == 1 and {"preset", "device", "hardware", "date"} <= set(report)
    # the card waterfall of the deploy config as given (issue 43): parts add up, PNG beside it
    wf = report["waterfall"]
    assert sum(p["bytes"] for p in wf["parts"]) == wf["total_bytes"] == wf["parts_sum_bytes"]
    assert wf["admitted"] > 0 and 0 < wf["admitted_over_floor_limited"]
    assert (tmp_path / "waterfall.png").stat().st_size > 0
    assert report["target"] == "engine" and report["all_equal"] is True
    assert report["budget_includes_weights"] is True
    assert report["available_bytes"] == 2**30 - report["weight_bytes"] - report["activation_reserve_bytes"]
    by = {c["name"]: c for c in report["configs"]}
    assert list(by) == ["all_off", *SWITCHES, "all_on"]
    for c in report["configs"]:
        assert c["equal_to_all_off"] is True and c["equality"] == "PASS", c["mismatches"]
        assert c["ceiling_realtime_sessions"] is not None
        assert c["measured_over_floor"] >= 1.0, c["name"]
        # the Talker at a full turn and the Code2Wav state are in the engine's pools
        steady = c["bytes_per_tier"]["steady"]
        assert steady["talker_kv"]["private"] > 0 and steady["code2wav"]["private"] > 0
    assert_savings(by)


def test_steady_state_is_reached(engine_run):
    _, report = engine_run
    all_off = {c["name"]: c for c in report["configs"]}["all_off"]
    # at steady state every session's Thinker table covers prefix + high tokens: the KV slope
    # is at least the floor's window part; measured >= floor overall
    kv = [p["steady"]["thinker_kv"] for p in all_off["points"]]
    per_session = (kv[1]["private"] + kv[1]["shared"]) - (kv[0]["private"] + kv[0]["shared"])
    assert per_session >= report["floor"]["thinker_window"]


def test_talker_turn_tokens_reaches_the_engine_the_bench_builds(tmp_path, monkeypatch, engine_models):
    """--talker-turn-tokens sets engine.talker_turn_tokens in every configuration's deploy
    config: the steady sample holds that many tokens' Talker blocks per session, not a
    max_position_embeddings turn."""
    from duplexcache.runtime import bundle

    monkeypatch.setattr(bundle, "build_models", lambda deploy, seed=0: engine_models)
    config = tmp_path / "deploy.yaml"
    config.write_text(_small_base().to_yaml())
    assert cli_main(["bench", "--preset", "tiny", "--config", str(config), "--sessions", "1,2",
                     "--memory-budget", "1GiB", "--talker-turn-tokens", "320", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["workload"]["talker_turn_tokens"] == 320 and "320 tokens" in report["workload"]["fast_forward"]
    bs = _small_base().stage0.block_size
    tc = engine_models.talker.config
    block = 2 * tc.num_hidden_layers * bs * tc.num_key_value_heads * tc.head_dim * 4
    assert tc.max_position_embeddings > 320   # 320: the run's units fit one turn (a cap inside the run would restart it)
    for c in report["configs"]:
        assert c["equality"] == "PASS"
        assert c["bytes_per_tier"]["steady"]["talker_kv"]["private"] == 2 * -(-320 // bs) * block


def test_engine_target_refuses_to_call_an_early_state_steady(engine_models):
    from duplexcache.bench.engine_target import EngineTarget

    cfg = config_matrix(_small_base())[0]
    target = EngineTarget(engine_models, cfg.deploy, 1)
    try:
        target.open_sessions(1)   # 2 ticks: the Code2Wav cache holds P + 50 frames, not P + 100
        with pytest.raises(RuntimeError, match="steady"):
            target.fast_forward_window(32)
    finally:
        target.close()


def test_engine_target_gets_always_speak_from_the_deploy_config(engine_models):
    from duplexcache.bench.engine_target import ALWAYS_SPEAK_K, EngineTarget

    target = EngineTarget(engine_models, config_matrix(_small_base())[0].deploy, 1)
    try:
        sp = target.engine.deploy.engine.speak_policy
        assert (sp.mode, sp.k, sp.turn_units) == ("every_k_units", ALWAYS_SPEAK_K, ALWAYS_SPEAK_K)
        assert all(target.engine.policy.speaks(u) for u in range(50))   # no policy swapped in
    finally:
        target.close()


def test_bench_uses_no_private_attribute_of_another_object():
    """The bench measures what serving runs only if it drives the engine through its public
    API: no ``obj._name`` access in duplexcache/bench (``self._name`` is the object's own)."""
    import ast
    from pathlib import Path

    import duplexcache.bench as bench_pkg

    found = []
    for path in sorted(Path(bench_pkg.__file__).parent.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
                if not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                    found.append(f"{path.name}:{node.lineno}: {ast.unparse(node)}")
    assert found == []
