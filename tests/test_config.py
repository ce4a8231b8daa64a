"""Deploy config: shipped YAMLs, round trip of every switch, unknown keys, byte sizes, env
override, and the server-side plugin (private keys refused, switches reach the runtime config)."""

from __future__ import annotations

import logging

import pytest
import yaml

from duplexcache.config import (
    GRAPH_GRID_ENV,
    PRESETS,
    ConfigError,
    DeployConfig,
    packaged_config_path,
    parse_bytes,
)
from duplexcache.config_loading import RETIRED_KEYS
from duplexcache.runtime_config import (
    PRIVATE_RUNTIME_CONFIG_KEYS,
    PrivateConfigKeyError,
    SessionConfigError,
    build_runtime_config,
)

NO_ENV: dict[str, str] = {}

# Every switch set to a value different from its default.
NON_DEFAULT = {
    "model": {"preset": "minicpmo45", "checkpoint_dir": "/ckpt", "revision": "abc123",
              "dtype": "bfloat16", "device": "cuda:1", "vision": True},
    "stage0": {"block_size": 32, "window": {"mode": "rebuild", "high_tokens": 4000, "low_tokens": 3000},
               "shared_anchor_blocks": True, "ragged_kernel": False},
    "context_cache": {"duplex_context_caching": True, "capacity": 7},
    "code2wav": {"cfm_prompt_att_sharing": True, "cfm_arena_rows_from_graph_grid": True,
                 "max_num_seqs": 24, "graph_grid": [1, 4, 8]},
    "precision": {"code2wav_dtype": "bfloat16", "kv_cache_dtype": "fp8_e4m3", "encoder_cache_dtype": "fp8_e4m3"},
    "engine": {"memory_budget": "80GiB", "activation_reserve": "3GiB", "tick_seconds": 0.5, "cuda_graphs": False,
               "batch_invariant": True,
               "talker_turn_tokens": 1024, "max_reference_voices": 2,
               "activation_from_warmup": True,
               "memory_headroom": "2GiB",
               "tick_headroom": 0.5, "prefill_chunk_tokens": 256,
               "speak_policy": {"mode": "model", "k": 3, "turn_units": 1, "speech_rms": 0.02,
                                "reply_min_units": 3, "reply_max_units": 5, "end_quiet_ms": 300}},
    "server": {"host": "0.0.0.0", "port": 9001, "max_frame_bytes": "1MiB", "api_key": "sk-test",
               "allowed_origins": ["https://app.example"], "idle_timeout_s": 30.0, "max_session_s": 600.0,
               "max_outbox_bytes": 2**20, "close_timeout_s": 2.0, "header_timeout_s": 3.0,
               "trusted_proxies": ["10.0.0.0/8"],
               "max_connections_per_client": 3, "max_sessions_per_client": 2, "max_context_tokens": 4096,
               "compute_threads": 3, "voice_aliases": {"alloy": "alt"},
               "resume_window_s": 7.5},
    "scheduler": {"catch_up_ticks": False, "prefill_between_ticks": False, "align_units_to_ticks": False,
                  "tick_phases": 1, "fill_silence_after_ms": 1500.0},
    "cluster": {"replicas": 2, "max_replicas": 4, "target_utilisation": 0.5, "drain_timeout_s": 60.0},
}


# Switches whose value is a mapping with the deployment's own keys: one leaf, not a section.
MAPPING_VALUES = {"server.voice_aliases"}


def _leaves(d: dict, prefix: str = "") -> dict[str, object]:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict) and f"{prefix}{k}" not in MAPPING_VALUES:
            out.update(_leaves(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


@pytest.mark.parametrize("preset", PRESETS)
def test_shipped_yaml_writes_out_every_switch_with_its_default(preset):
    raw = yaml.safe_load(packaged_config_path(preset).read_text())
    default = DeployConfig.default(preset, environ=NO_ENV)
    assert set(_leaves(raw)) == set(_leaves(default.to_dict()))
    assert DeployConfig.from_packaged_yaml(preset, environ=NO_ENV) == default
    assert default.context_cache.duplex_context_caching is False
    assert default.stage0.shared_anchor_blocks is False
    assert default.code2wav.cfm_prompt_att_sharing is False
    assert default.code2wav.cfm_arena_rows_from_graph_grid is False
    # the speed switches and the budget default on: the fast path, sized from the free memory
    assert default.stage0.ragged_kernel is True and default.engine.cuda_graphs is True
    assert default.engine.memory_budget == "auto"


def test_memory_budget_auto_or_bytes():
    auto = DeployConfig.from_dict({"engine": {"memory_budget": "AUTO"}}, environ=NO_ENV)
    assert auto.engine.memory_budget == "auto" and auto.to_dict()["engine"]["memory_budget"] == "auto"
    assert DeployConfig.from_dict(auto.to_dict(), environ=NO_ENV) == auto
    sized = DeployConfig.from_dict({"engine": {"memory_budget": "2GiB"}}, environ=NO_ENV)
    assert sized.engine.memory_budget == 2 * 2**30
    # an auto budget is checked against the reserve when it is resolved, a fixed one at once
    DeployConfig.from_dict({"engine": {"memory_budget": "auto", "activation_reserve": "1TiB"}}, environ=NO_ENV)
    with pytest.raises(ConfigError, match="activation_reserve"):
        DeployConfig.from_dict({"engine": {"memory_budget": "1GiB", "activation_reserve": "1TiB"}}, environ=NO_ENV)
    with pytest.raises(ConfigError, match="engine.memory_budget"):
        DeployConfig.from_dict({"engine": {"memory_budget": "automatic"}}, environ=NO_ENV)


def test_api_key_env_overrides_yaml_and_packaged_configs_bind_loopback():
    cfg = DeployConfig.from_dict({"server": {"api_key": "from-yaml"}}, environ={"DUPLEXCACHE_API_KEY": "from-env"})
    assert cfg.server.api_key == "from-env"
    assert DeployConfig.from_dict({}, environ=NO_ENV).server.api_key is None
    for preset in PRESETS:  # never 0.0.0.0 unless the deployment says so (--host)
        assert DeployConfig.from_packaged_yaml(preset, environ=NO_ENV).server.host == "127.0.0.1"


def test_a_written_config_leaves_the_key_out_and_the_environment_brings_it_back(tmp_path):
    """A key from DUPLEXCACHE_API_KEY must not land in a YAML a tool writes next to its results."""
    cfg = DeployConfig.default("tiny", environ={"DUPLEXCACHE_API_KEY": "sk-secret"})
    assert cfg.server.api_key == "sk-secret"
    text = cfg.to_yaml()
    assert "sk-secret" not in text and "sk-secret" in cfg.to_yaml(include_secrets=True)
    path = tmp_path / "written.yaml"
    path.write_text(text)
    assert DeployConfig.from_yaml(path, environ=NO_ENV).server.api_key is None
    assert DeployConfig.from_yaml(path, environ={"DUPLEXCACHE_API_KEY": "sk-secret"}) == cfg


def test_every_switch_round_trips_through_yaml(tmp_path):
    default_leaves = _leaves(DeployConfig.default("tiny", environ=NO_ENV).to_dict())
    assert set(_leaves(NON_DEFAULT)) == set(default_leaves), "NON_DEFAULT must name every switch"
    cfg = DeployConfig.from_dict(NON_DEFAULT, environ=NO_ENV)
    for path, value in _leaves(cfg.to_dict()).items():
        assert value != default_leaves[path], f"{path} is not exercised with a non-default value"
    path = tmp_path / "deploy.yaml"
    path.write_text(cfg.to_yaml(include_secrets=True))
    again = DeployConfig.from_yaml(path, environ=NO_ENV)
    assert again == cfg
    assert _leaves(again.to_dict()) == _leaves(NON_DEFAULT)
    assert again.engine.memory_budget == 80 * 2**30 and again.code2wav.graph_grid == (1, 4, 8)


@pytest.mark.parametrize("raw,path,hint", [
    ({"stage0": {"windw": {}}}, "stage0.windw", "window"),
    ({"stage0": {"window": {"hgh_tokens": 10}}}, "stage0.window.hgh_tokens", "high_tokens"),
    ({"context_cache": {"duplex_context_cachng": True}}, "context_cache.duplex_context_cachng",
     "duplex_context_caching"),
    ({"code2wav": {"cfm_prompt_att_share": True}}, "code2wav.cfm_prompt_att_share", "cfm_prompt_att_sharing"),
    ({"egine": {}}, "egine", "engine"),
])
def test_unknown_key_error_names_key_path(raw, path, hint):
    with pytest.raises(ConfigError) as info:
        DeployConfig.from_dict(raw, environ=NO_ENV)
    assert f"unknown key {path!r}" in str(info.value)
    assert hint in str(info.value)


def test_yaml_typo_error_names_file_and_key(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("engine:\n  memory_budgett: 1GiB\n")
    with pytest.raises(ConfigError, match=r"bad\.yaml.*engine\.memory_budgett"):
        DeployConfig.from_yaml(path, environ=NO_ENV)


@pytest.mark.parametrize("text,expected", [
    ("80GiB", 80 * 2**30), ("512MiB", 512 * 2**20), ("1.5GiB", 3 * 2**29), ("4096", 4096),
    ("10GB", 10**10), ("1kib", 1024), ("7 B", 7), (123, 123), ("0", 0),
])
def test_parse_bytes(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("bad,message", [
    ("80GiBs", "unknown byte unit"), ("abc", "cannot parse"), ("", "cannot parse"),
    ("-1GiB", "cannot parse"), (-1, ">= 0"), ("1.5B", "whole number"), (True, "int or a string"),
    (None, "int or a string"), (3.5, "int or a string"),
])
def test_parse_bytes_errors(bad, message):
    with pytest.raises(ValueError, match=message):
        parse_bytes(bad)


def test_bad_byte_size_in_config_names_key():
    with pytest.raises(ConfigError, match=r"engine\.memory_budget.*unknown byte unit"):
        DeployConfig.from_dict({"engine": {"memory_budget": "80 gigs"}}, environ=NO_ENV)


@pytest.mark.parametrize("raw,message", [
    ({"engine": {"memory_budget": "1GiB", "activation_reserve": "1GiB"}}, "activation_reserve"),
    ({"stage0": {"window": {"high_tokens": 100, "low_tokens": 100}}}, "low_tokens"),
    ({"model": {"preset": "huge"}}, r"model\.preset"),
    ({"code2wav": {"graph_grid": "1,0"}}, "positive"),
    ({"server": {"port": 70000}}, r"server\.port"),
    ({"model": {"device": "gpu"}}, r"model\.device"),
    ({"precision": {"kv_cache_dtype": "fp8"}}, r"precision\.kv_cache_dtype.*fp8_e4m3"),
    ({"scheduler": {"tick_phases": 2, "align_units_to_ticks": False}},
     r"scheduler\.tick_phases 2 .*needs scheduler\.align_units_to_ticks"),
    ({"scheduler": {"align_units_to_ticks": False}}, r"scheduler\.tick_phases 2 .*scheduler\.align_units_to_ticks"),
    ({"scheduler": {"tick_phases": 4, "align_units_to_ticks": False}}, r"scheduler\.tick_phases 4 "),
    ({"scheduler": {"phase_units": "spread"}}, r"scheduler\.phase_units 'spread': 'spread' was retired"),
    ({"scheduler": {"phase_units": "near"}}, r"scheduler\.phase_units 'near'"),
])
def test_invalid_values_name_their_key(raw, message):
    with pytest.raises(ConfigError, match=message):
        DeployConfig.from_dict(raw, environ=NO_ENV)


def test_not_a_mapping(tmp_path):
    path = tmp_path / "list.yaml"
    path.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="mapping"):
        DeployConfig.from_yaml(path, environ=NO_ENV)
    with pytest.raises(ConfigError, match="unknown preset"):
        DeployConfig.default("huge")


def test_graph_grid_env_overrides_yaml(tmp_path):
    path = tmp_path / "deploy.yaml"
    path.write_text("code2wav:\n  graph_grid: [2]\n  max_num_seqs: 32\n")
    cfg = DeployConfig.from_yaml(path, environ={GRAPH_GRID_ENV: "16, 1,8,4"})
    assert cfg.code2wav.graph_grid == (1, 4, 8, 16)
    assert DeployConfig.from_yaml(path, environ=NO_ENV).code2wav.graph_grid == (2,)


def test_graph_grid_env_read_from_process_environment(monkeypatch):
    monkeypatch.setenv(GRAPH_GRID_ENV, "1,4")
    assert DeployConfig.default("tiny").code2wav.graph_grid == (1, 4)
    monkeypatch.setenv(GRAPH_GRID_ENV, "1,four")
    with pytest.raises(ConfigError, match=GRAPH_GRID_ENV):
        DeployConfig.default("tiny")


def test_arena_rows_switch_acts_or_errors(caplog):
    on = {"cfm_arena_rows_from_graph_grid": True, "max_num_seqs": 16}
    cfg = DeployConfig.from_dict({"code2wav": on}, environ={GRAPH_GRID_ENV: "1,4,8"})
    assert cfg.code2wav.arena_rows == 8
    off = DeployConfig.from_dict({"code2wav": {"max_num_seqs": 16}}, environ={GRAPH_GRID_ENV: "1,4,8"})
    assert off.code2wav.arena_rows == 16
    # On without any grid would change nothing: an error, not a silent no-op.
    with pytest.raises(ConfigError, match="would change nothing"):
        DeployConfig.from_dict({"code2wav": on}, environ=NO_ENV)
    # A grid as wide as max_num_seqs saves nothing: a warning.
    with caplog.at_level(logging.WARNING, logger="duplexcache.config"):
        DeployConfig.from_dict({"code2wav": on}, environ={GRAPH_GRID_ENV: "1,16"})
    assert "saves nothing" in caplog.text


# ---- server-side plugin -----------------------------------------------------------------


def test_runtime_config_merges_client_fields_with_server_switches():
    deploy = DeployConfig.from_dict(NON_DEFAULT, environ=NO_ENV)
    rt = build_runtime_config(deploy, {"instructions": "Be kind.", "voice": "alice", "initial_user_text": "hi",
                                       "input_audio_format": "f32", "window": {"high_tokens": 2000, "low_tokens": 1000}})
    assert (rt.instructions, rt.voice, rt.initial_user_text, rt.input_audio_format) == ("Be kind.", "alice", "hi", "f32")
    assert (rt.window_high_tokens, rt.window_low_tokens, rt.window_mode) == (2000, 1000, "rebuild")
    # Server-owned switches come from the deploy YAML (the review's "flag nothing sets" trap).
    assert rt.duplex_context_caching is True and rt.context_cache_capacity == 7
    assert rt.cfm_prompt_att_sharing is True and rt.cfm_arena_rows_from_graph_grid is True
    assert rt.shared_anchor_blocks is True and rt.block_size == 32 and rt.model_revision == "abc123"


def test_kv_cache_dtype_defaults_to_the_model_dtype():
    assert DeployConfig.default("tiny", environ=NO_ENV).precision.kv_cache_dtype == "auto"


def test_runtime_config_defaults():
    rt = build_runtime_config(DeployConfig.default("tiny", environ=NO_ENV), {})
    assert (rt.instructions, rt.voice, rt.initial_user_text, rt.input_audio_format) == ("", "default", None, "pcm16")
    assert (rt.window_high_tokens, rt.window_low_tokens) == (8000, 6000)
    assert not rt.duplex_context_caching and not rt.shared_anchor_blocks
    assert build_runtime_config(DeployConfig.default("tiny", environ=NO_ENV), None) == rt


@pytest.mark.parametrize("key", sorted(PRIVATE_RUNTIME_CONFIG_KEYS))
def test_client_setting_a_private_key_is_refused_by_name(key):
    deploy = DeployConfig.default("tiny", environ=NO_ENV)
    with pytest.raises(PrivateConfigKeyError, match=key) as info:
        build_runtime_config(deploy, {"instructions": "x", key: True})
    assert info.value.key == key and isinstance(info.value, ValueError)


def test_nested_private_key_is_refused_with_its_path():
    deploy = DeployConfig.default("tiny", environ=NO_ENV)
    with pytest.raises(PrivateConfigKeyError, match=r"window\.mode"):
        build_runtime_config(deploy, {"window": {"mode": "off"}})


def test_private_keys_cover_the_spec_switches():
    for key in ("duplex_context_caching", "cfm_prompt_att_sharing", "cfm_arena_rows_from_graph_grid",
                "shared_anchor_blocks", "memory_budget", "activation_reserve"):
        assert key in PRIVATE_RUNTIME_CONFIG_KEYS


@pytest.mark.parametrize("session,message", [
    ({"instrucions": "x"}, "unknown session key 'instrucions'"),
    ({"instructions": 5}, "must be a string"),
    ({"input_audio_format": "mp3"}, "input_audio_format"),
    ({"window": {"high_tokens": 9000}}, "exceeds the server limit"),
    ({"window": {"high_tokens": 100, "low_tokens": 100}}, "below high_tokens"),
    ({"window": {"low_tokens": -3}}, "positive int"),
    ({"window": {"hgh": 1}}, "window.hgh"),
    ({"window": 5}, "must be an object"),
])
def test_bad_client_session(session, message):
    with pytest.raises(SessionConfigError, match=message):
        build_runtime_config(DeployConfig.default("tiny", environ=NO_ENV), session)


def test_a_client_may_always_lower_its_window_and_never_raise_it():
    """stage0.client_window_override is retired: a YAML that still turns it off loads with a
    warning, and its clients may lower their own window's marks (only their own footprint
    shrinks); above the server's high mark is refused as before."""
    with pytest.warns(DeprecationWarning, match=r"stage0\.client_window_override was retired"):
        deploy = DeployConfig.from_dict({"stage0": {"client_window_override": False}}, environ=NO_ENV)
    assert deploy == DeployConfig.default("tiny", environ=NO_ENV)
    rt = build_runtime_config(deploy, {"window": {"high_tokens": 100, "low_tokens": 50}})
    assert (rt.window_high_tokens, rt.window_low_tokens) == (100, 50)
    assert build_runtime_config(deploy, {}).window_high_tokens == 8000
    with pytest.raises(SessionConfigError, match="exceeds the server limit 8000"):
        build_runtime_config(deploy, {"window": {"high_tokens": 8001, "low_tokens": 50}})


def test_example_serving_config_turns_every_sharing_switch_on():
    """examples/minicpmo45-shared.yaml is what the README tells users to serve with."""
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "examples" / "minicpmo45-shared.yaml"
    d = DeployConfig.from_yaml(path, environ={})
    assert d.model.preset == "minicpmo45"
    assert d.stage0.shared_anchor_blocks and d.context_cache.duplex_context_caching
    assert d.code2wav.cfm_prompt_att_sharing and d.code2wav.cfm_arena_rows_from_graph_grid
    assert d.code2wav.graph_grid == (1, 4, 8, 12, 16, 20, 24, 28, 32) and d.code2wav.arena_rows == 32
    assert d.stage0.window.mode == "basic"
    assert d.stage0.ragged_kernel and d.engine.cuda_graphs and d.engine.memory_budget == "auto"
    # The preset's prefill chunk and context limit, written out (a missing key would fall back
    # to the field default, not the preset's).
    preset = DeployConfig.default("minicpmo45", environ={})
    assert d.engine.prefill_chunk_tokens == preset.engine.prefill_chunk_tokens == 1024
    assert d.server.max_context_tokens == preset.server.max_context_tokens == 16384


def test_capacity_example_is_the_shared_example_plus_the_capacity_switches():
    """examples/minicpmo45-capacity.yaml differs from the shared example only in the capacity
    switches (a drift in any other key would make the A/B between the two files unfair)."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1] / "examples"
    shared = DeployConfig.from_yaml(root / "minicpmo45-shared.yaml", environ={}).to_dict()
    capacity = DeployConfig.from_yaml(root / "minicpmo45-capacity.yaml", environ={}).to_dict()
    assert capacity["precision"] == {"code2wav_dtype": "bfloat16", "kv_cache_dtype": "fp8_e4m3",
                                     "encoder_cache_dtype": "auto"}   # not measured on the GPU yet
    assert capacity["engine"]["talker_turn_tokens"] == 1024
    shared["precision"], shared["engine"]["talker_turn_tokens"] = capacity["precision"], 1024
    assert shared == capacity


# ----------------------------------------------------------------------------- scheduler keys' old spelling

def test_the_scheduler_section_is_read_as_written():
    d = DeployConfig.from_dict({"scheduler": {"tick_phases": 1, "catch_up_ticks": False}}, environ={})
    assert (d.scheduler.tick_phases, d.scheduler.catch_up_ticks) == (1, False)
    assert "tick_phases" not in d.to_dict()["server"] and d.to_dict()["scheduler"]["tick_phases"] == 1


def test_old_server_spelling_of_a_scheduler_key_is_read_with_a_deprecation_warning(caplog):
    """Until the release after 2026-12-07, ``server.tick_phases`` (and the other six) still
    configure the scheduler, with a warning naming the new key; both spellings at once is an error."""
    with pytest.warns(DeprecationWarning, match=r"server\.tick_phases.*scheduler\.tick_phases"):
        d = DeployConfig.from_dict({"server": {"tick_phases": 1, "fill_silence_after_ms": None, "port": 9}},
                                   environ={})
    assert (d.scheduler.tick_phases, d.scheduler.fill_silence_after_ms, d.server.port) == (1, None, 9)
    assert "moved to the scheduler section" in caplog.text
    # the same deploy as the new spelling, key for key
    assert d == DeployConfig.from_dict({"server": {"port": 9},
                                        "scheduler": {"tick_phases": 1, "fill_silence_after_ms": None}}, environ={})
    with pytest.raises(ConfigError, match=r"server\.tick_phases and scheduler\.tick_phases"):
        DeployConfig.from_dict({"server": {"tick_phases": 1}, "scheduler": {"tick_phases": 2}}, environ={})


def test_an_old_yaml_still_loads_its_scheduler_keys(tmp_path):
    """An old YAML file (``server.tick_phases: 4`` ...) loads into ``scheduler``, which is what the
    server hands the engine's pacing setters (tests/server/test_server.py checks that road)."""
    import warnings

    path = tmp_path / "old.yaml"
    path.write_text("server:\n  tick_phases: 1\n  align_units_to_ticks: false\n  catch_up_ticks: false\n")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        d = DeployConfig.from_yaml(path, environ={})
    assert (d.scheduler.tick_phases, d.scheduler.align_units_to_ticks, d.scheduler.catch_up_ticks) == (1, False, False)


# ----------------------------------------------------------------------------- engine keys retired in issue 44

OLD_GRAPH_SWITCHES = ("engine.decode_cuda_graphs", "engine.ragged_step_graphs", "engine.encoder_cuda_graphs",
                      "code2wav.vocoder_cuda_graphs")


def _nested(dotted: str, value: object) -> dict:
    section, key = dotted.split(".")
    return {section: {key: value}}


@pytest.mark.parametrize("old", OLD_GRAPH_SWITCHES)
@pytest.mark.parametrize("value", [False, True])
def test_an_old_graph_switch_is_read_as_cuda_graphs_with_a_warning(old, value, caplog):
    """The four graph switches merged into ``engine.cuda_graphs``: an old YAML still loads for one
    release, each old key with a warning naming the new one; one off turns the new switch off."""
    with pytest.warns(DeprecationWarning, match=old.replace(".", r"\.") + r" merged into engine\.cuda_graphs"):
        d = DeployConfig.from_dict(_nested(old, value), environ=NO_ENV)
    assert d.engine.cuda_graphs is value
    assert old in caplog.text and "engine.cuda_graphs" in caplog.text
    assert d == DeployConfig.from_dict({"engine": {"cuda_graphs": value}}, environ=NO_ENV)
    assert old.rpartition(".")[2] not in str(d.to_dict())


def test_any_old_graph_switch_off_turns_cuda_graphs_off():
    import warnings

    raw = {"engine": {"decode_cuda_graphs": True, "ragged_step_graphs": "true", "encoder_cuda_graphs": True},
           "code2wav": {"vocoder_cuda_graphs": False, "max_num_seqs": 8}}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        d = DeployConfig.from_dict(raw, environ=NO_ENV)
    assert d.engine.cuda_graphs is False and d.code2wav.max_num_seqs == 8
    assert raw["code2wav"] == {"vocoder_cuda_graphs": False, "max_num_seqs": 8}   # the caller's dict untouched
    messages = [str(w.message) for w in caught if issubclass(w.category, DeprecationWarning)]
    assert len(messages) == 1 and all(old in messages[0] for old in OLD_GRAPH_SWITCHES)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        on = DeployConfig.from_dict({"engine": {"decode_cuda_graphs": True, "encoder_cuda_graphs": True}},
                                    environ=NO_ENV)
        assert on.engine.cuda_graphs is True
        with pytest.raises(ConfigError, match=r"engine\.encoder_cuda_graphs: expected a bool"):
            DeployConfig.from_dict({"engine": {"encoder_cuda_graphs": "sometimes"}}, environ=NO_ENV)


@pytest.mark.parametrize("old", OLD_GRAPH_SWITCHES)
def test_an_old_graph_switch_beside_cuda_graphs_is_an_error_naming_both(old):
    raw = _nested(old, False)
    raw.setdefault("engine", {})["cuda_graphs"] = True
    with pytest.raises(ConfigError, match=old.replace(".", r"\.") + r" and engine\.cuda_graphs are both set"):
        DeployConfig.from_dict(raw, environ=NO_ENV)


def test_an_old_yaml_with_the_graph_switches_loads(tmp_path):
    path = tmp_path / "old.yaml"
    path.write_text("engine:\n  decode_cuda_graphs: true\n  ragged_step_graphs: false\n"
                    "code2wav:\n  vocoder_cuda_graphs: true\n")
    with pytest.warns(DeprecationWarning, match=r"engine\.cuda_graphs"):
        d = DeployConfig.from_yaml(path, environ=NO_ENV)
    assert d.engine.cuda_graphs is False


@pytest.mark.parametrize("key, value", [
    ("memory_fraction", 0.5), ("cuda_expandable_segments", False), ("talker_turn_from_policy", False),
    ("activation_margin", "256MiB"),
])
def test_an_engine_key_retired_in_issue_44_is_ignored_with_a_warning(key, value, caplog):
    """Retired with their code path (docs/engine.md, "Retired switches"): an old YAML that sets one
    loads as the defaults do (what each did at its default is what the code now always does)."""
    with pytest.warns(DeprecationWarning, match=rf"engine\.{key} was retired"):
        d = DeployConfig.from_dict({"engine": {key: value, "tick_seconds": 0.5}}, environ=NO_ENV)
    assert f"engine.{key}" in caplog.text
    assert d == DeployConfig.from_dict({"engine": {"tick_seconds": 0.5}}, environ=NO_ENV)
    assert key not in d.to_dict()["engine"] and not hasattr(d.engine, key)


@pytest.mark.parametrize("raw, key", [
    ({"server": {"switch_interval_ms": 0.5}}, "server.switch_interval_ms"),
    ({"engine": {"speak_policy": {"mode": "reply", "end_quiet_lookahead": False}}}, "engine.speak_policy.end_quiet_lookahead"),
    ({"server": {"queue_notice_s": 0.5}}, "server.queue_notice_s"),
    ({"server": {"keep_alive_timeout_s": 2.0}}, "server.keep_alive_timeout_s"),
    ({"server": {"max_session_text_chars": 1000}}, "server.max_session_text_chars"),
    ({"stage0": {"client_window_override": False}}, "stage0.client_window_override"),
    ({"cluster": {"routing_stats_period_s": 0.5}}, "cluster.routing_stats_period_s"),
    ({"scheduler": {"unit_align_margin_ms": 80.0}}, "scheduler.unit_align_margin_ms"),
    ({"server": {"unit_align_margin_ms": 80.0}}, "server.unit_align_margin_ms"),   # the spelling before 2026-12-07
    ({"scheduler": {"phase_units": "home"}}, "scheduler.phase_units"),
    ({"server": {"phase_units": "home"}}, "server.phase_units"),
])
def test_a_retired_switch_is_ignored_with_a_warning_naming_it(raw, key, caplog):
    """Speed switches retired once their A/B was settled (docs/engine.md, "Retired switches"): an
    old YAML that still sets one loads, the key is dropped, and the warning says so."""
    with pytest.warns(DeprecationWarning, match=key.replace(".", r"\.") + " was retired"):
        d = DeployConfig.from_dict(raw, environ={})
    assert key in caplog.text
    assert d == DeployConfig.from_dict({"engine": {"speak_policy": {"mode": "reply"}}} if "engine" in raw else {},
                                       environ={})
    assert key.rpartition(".")[2] not in str(d.to_dict())


def test_the_session_text_limit_follows_the_context_limit(caplog):
    """server.max_session_text_chars (retired) is 4 characters per token of max_context_tokens:
    65536 at minicpmo45's 16384 tokens, as the key's default was; an old YAML's value is ignored
    with a warning saying what it follows now."""
    assert DeployConfig.default("minicpmo45", environ=NO_ENV).server.max_session_text_chars == 65536
    assert DeployConfig.default("tiny", environ=NO_ENV).server.max_session_text_chars == 4 * 8192
    d = DeployConfig.from_dict({"server": {"max_context_tokens": 100}}, environ=NO_ENV)
    assert d.server.max_session_text_chars == 400
    with pytest.warns(DeprecationWarning, match="follows server.max_context_tokens"):
        old = DeployConfig.from_dict({"server": {"max_context_tokens": 100, "max_session_text_chars": 5}},
                                     environ=NO_ENV)
    assert old == d and "server.max_session_text_chars" in caplog.text


@pytest.mark.parametrize("section", ["scheduler", "server"])   # server: the scheduler keys' spelling before 2026-12-07
def test_phase_units_spread_was_retired_and_home_only_warns(section, caplog):
    """scheduler.phase_units is retired with its spread arm: units always start on the unit tick.
    An old YAML with home (what the code always does now) loads with a warning; spread, the
    behaviour that went, is an error saying so, not a silent change of pacing."""
    with pytest.warns(DeprecationWarning, match=section + r"\.phase_units was retired"):
        raw = {"scheduler": {"tick_phases": 4}}
        raw.setdefault(section, {})["phase_units"] = "home"
        d = DeployConfig.from_dict(raw, environ=NO_ENV)
    assert d.scheduler.tick_phases == 4 and "phase_units" not in str(d.to_dict())
    assert f"{section}.phase_units" in caplog.text
    with pytest.raises(ConfigError, match=section + r"\.phase_units 'spread': 'spread' was retired .*unit tick"):
        DeployConfig.from_dict({section: {"phase_units": "spread"}}, environ=NO_ENV)


# Leaf keys of DeployConfig.default("minicpmo45") when issue 44 asked for fewer (dc10603, 2026-12-06),
# server.voice_aliases counted as one: a new key must retire another or raise this on purpose.
KEYS_AT_ISSUE_44 = 66


@pytest.mark.parametrize("preset", PRESETS)
def test_the_deploy_config_has_fewer_keys_than_when_issue_44_was_filed(preset):
    keys = _leaves(DeployConfig.default(preset, environ=NO_ENV).to_dict())
    assert len(keys) < KEYS_AT_ISSUE_44, sorted(keys)
    retired = {".".join((*path, key)) for path, key, _ in RETIRED_KEYS}
    assert not retired & set(keys)
