"""How a raw deploy dict (one YAML file) becomes what ``DeployConfig`` validates, and how a
failure reads: environment overrides (the one place they apply), keys retired, merged or moved
(read with a deprecation warning for one release), and validation errors named by key path.

Needs pydantic and the standard library; imports nothing of ``duplexcache.config`` (which
imports this).
"""

from __future__ import annotations

import copy
import difflib
import logging
import warnings
from typing import Any, Mapping

from pydantic import BaseModel, TypeAdapter, ValidationError

from duplexcache.config_values import GRAPH_GRID_ENV, parse_graph_grid

logger = logging.getLogger("duplexcache.config")   # the config's one logger name

API_KEY_ENV = "DUPLEXCACHE_API_KEY"


class ConfigError(ValueError):
    """A deploy config that cannot be used; the message names every offending key by path."""


def apply_env_overrides(raw: Mapping[str, Any], environ: Mapping[str, str]) -> dict[str, Any]:
    """The one place environment variables change the deploy config (returns a new dict)."""
    data = copy.deepcopy(dict(raw))
    grid = environ.get(GRAPH_GRID_ENV)
    if grid is not None and grid.strip():
        section = data.get("code2wav")
        if section is None:
            section = data["code2wav"] = {}
        if not isinstance(section, dict):
            raise ConfigError(f"code2wav: expected a mapping, got {section!r}")
        try:
            section["graph_grid"] = parse_graph_grid(grid, GRAPH_GRID_ENV)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        logger.info("%s=%s overrides code2wav.graph_grid", GRAPH_GRID_ENV, grid)
    api_key = environ.get(API_KEY_ENV)
    if api_key:
        section = data.get("server")
        if section is None:
            section = data["server"] = {}
        if not isinstance(section, dict):
            raise ConfigError(f"server: expected a mapping, got {section!r}")
        section["api_key"] = api_key
        logger.info("%s overrides server.api_key", API_KEY_ENV)
    return data


# Speed switches retired with their code path once their A/B was settled, and keys no deployment
# needs to set, now named constants or derived from another key (docs/engine.md, "Retired
# switches"): (section path, key, why). A YAML that still names one loads, with a warning, for
# one release.
RETIRED_KEYS = (
    (("server",), "switch_interval_ms", "Python's 5 ms was kept: 0.5 ms gave no gain (32 callers, H200)"),
    (("engine",), "memory_fraction", "an auto budget's first plan keeps 0.9 of the free memory "
                                     "(runtime/memory/memory_budget.py AUTO_FREE_SHARE); the re-plan after the "
                                     "warm-up uses engine.memory_headroom"),
    (("engine",), "cuda_expandable_segments", "serve always sets PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True "
                                              "unless the environment sets PYTORCH_CUDA_ALLOC_CONF"),
    (("engine",), "talker_turn_from_policy", "the Talker reserve is always the speak policy's longest turn when "
                                             "the policy bounds it (issue 43's card fill)"),
    (("engine",), "activation_margin", "the re-plan after the warm-up adds a fixed 1 GiB to the measured peak "
                                       "(runtime/memory/replan.py ACTIVATION_MARGIN)"),
    (("engine", "speak_policy"), "end_quiet_lookahead", "the reply policy always hears the quiet after the unit "
                                                        "(32 callers, H200: reply p95 2.74 -> 1.88 s)"),
    (("server",), "queue_notice_s", "queued sessions are told every 2 s (server/realtime_session.py QUEUE_NOTICE_S)"),
    (("server",), "keep_alive_timeout_s", "an idle keep-alive connection is closed after 5 s, uvicorn's own "
                                          "default (server/loopback.py KEEP_ALIVE_TIMEOUT_S)"),
    (("server",), "max_session_text_chars", "it now follows server.max_context_tokens: 4 characters per context "
                                            "token (65536 at 16384 tokens)"),
    (("stage0",), "client_window_override", "a client may always lower its own window's marks (only its own "
                                            "footprint shrinks; above stage0.window.high_tokens is refused)"),
    (("cluster",), "routing_stats_period_s", "replicas report their room and contexts every 1 s "
                                             "(cluster/app.py ROUTING_STATS_PERIOD_S)"),
    *((section, "unit_align_margin_ms", "aligned units end their largest chunk + 50 ms before a tick "
                                        "(runtime/scheduler/core.py UNIT_ALIGN_MARGIN_MS)")
      for section in (("scheduler",), ("server",))),   # server.*: the scheduler keys' spelling before 2026-12-07
    *((section, "phase_units", "units always start on the unit tick, 'home' (12 callers, CPU: reply p50 / p99 "
                               "0.86 / 1.54 s against spread's 1.03 / 1.69 s)")
      for section in (("scheduler",), ("server",))),
)

# Retired keys whose old value chose a behaviour that went with the key: only the value the code
# now always follows loads (with the warning above); any other is an error naming the key and why.
RETIRED_VALUES: dict[str, tuple[Any, str]] = {
    "phase_units": ("home", "'spread' was retired with its code path: units always start on the unit tick, "
                            "the only value left is 'home' (docs/engine.md, \"Retired switches\")"),
}


def _node(data: Mapping[str, Any], path: tuple[str, ...]) -> Any:
    """The mapping at ``path`` in ``data`` (None when a part is missing or not a mapping)."""
    node: Any = data
    for part in path:
        node = node.get(part) if isinstance(node, Mapping) else None
    return node


def _has(data: Mapping[str, Any], path: tuple[str, ...], key: str) -> bool:
    node = _node(data, path)
    return isinstance(node, Mapping) and key in node


def _copy_to(data: Mapping[str, Any], path: tuple[str, ...]) -> tuple[dict[str, Any], dict[str, Any]]:
    """A copy of ``data`` whose mappings along ``path`` are copies too (made where missing), and
    the copy at ``path``: a change there leaves the caller's dict as it was."""
    data = dict(data)
    node = data
    for depth, part in enumerate(path):
        child = node.get(part)
        if child is not None and not isinstance(child, Mapping):
            raise ValueError(f"{'.'.join(path[:depth + 1])}: expected a mapping, got {child!r}")
        node[part] = dict(child or {})
        node = node[part]
    return data, node


def _deprecated(message: str) -> None:
    """One old spelling read: a DeprecationWarning (for tests and -W error) and a log line (for operators)."""
    warnings.warn(message, DeprecationWarning, stacklevel=4)
    logger.warning("%s", message)


def drop_retired_keys(data: Mapping[str, Any]) -> Mapping[str, Any]:
    """``data`` without the keys of RETIRED_KEYS, each dropped with a deprecation warning;
    ValueError for a retired key set to a value RETIRED_VALUES no longer allows."""
    for path, key, why in RETIRED_KEYS:
        if not _has(data, path, key):
            continue
        value = _node(data, path)[key]
        kept = RETIRED_VALUES.get(key)
        if kept is not None and value != kept[0]:
            raise ValueError(f"{'.'.join(path)}.{key} {value!r}: {kept[1]}; remove the key")
        data, node = _copy_to(data, path)
        del node[key]
        _deprecated(f"deploy config: {'.'.join(path)}.{key} was retired and is ignored ({why}; docs/engine.md)")
    return data


# Switches merged into one (issue 44): (new section path, new key, old spellings as (section path,
# key)). An old spelling still loads, with a warning, for one release: the new switch is off when
# any old one was off (each old off arm was an eager reference; the merged switch has one).
MERGED_SWITCHES = (
    (("engine",), "cuda_graphs", ((("engine",), "decode_cuda_graphs"), (("engine",), "ragged_step_graphs"),
                                  (("engine",), "encoder_cuda_graphs"), (("code2wav",), "vocoder_cuda_graphs"))),
)


_BOOL = TypeAdapter(bool)


def merge_switches(data: Mapping[str, Any]) -> Mapping[str, Any]:
    """``data`` with the old spellings of MERGED_SWITCHES read as their one new switch, each with a
    deprecation warning: the new switch is off when any old one is off. ValueError when an old and
    the new spelling are both set, or an old one is not a bool."""
    for path, key, olds in MERGED_SWITCHES:
        new = ".".join((*path, key))
        found: dict[str, bool] = {}
        for old_path, old_key in olds:
            if not _has(data, old_path, old_key):
                continue
            old = ".".join((*old_path, old_key))
            data, node = _copy_to(data, old_path)
            value = node.pop(old_key)
            try:
                found[old] = _BOOL.validate_python(value)
            except ValidationError:
                raise ValueError(f"{old}: expected a bool, got {value!r} (the switch is now {new})") from None
        if not found:
            continue
        if _has(data, path, key):
            raise ValueError(f"{', '.join(found)} and {new} are both set: the old switches were merged into {new} "
                             f"(write {new} only)")
        data, node = _copy_to(data, path)
        node[key] = all(found.values())
        _deprecated(f"deploy config: {', '.join(found)} merged into {new} (read as {new}: {node[key]}); the old "
                    "spelling is read for one more release (docs/engine.md, \"Retired switches\")")
    return data


def move_keys(data: Mapping[str, Any], source: str, target: str, keys: tuple[str, ...]) -> Mapping[str, Any]:
    """``data`` with ``source.<key>`` read as ``target.<key>`` for each of ``keys`` present (a
    key that moved section), with a deprecation warning; ValueError when both are set."""
    if not isinstance(data.get(source), Mapping):
        return data
    moved = [key for key in keys if key in data[source]]
    if not moved:
        return data
    data = dict(data)
    old, new = dict(data[source]), dict(data.get(target) or {})
    both = [key for key in moved if key in new]
    if both:
        raise ValueError(f"{source}.{both[0]} and {target}.{both[0]} are both set: the key moved to "
                         f"{target} (write it there only)")
    for key in moved:
        new[key] = old.pop(key)
    message = (f"deploy config: {', '.join(f'{source}.{k}' for k in moved)} moved to the {target} section "
               f"({', '.join(f'{target}.{k}' for k in moved)}); the old spelling is read for one more release")
    _deprecated(message)
    data[source], data[target] = old, new
    return data


def _allowed_keys(model: type[BaseModel], loc: tuple[Any, ...]) -> list[str]:
    """Field names of the model that sits at ``loc`` (for 'did you mean' hints)."""
    current: Any = model
    for part in loc:
        field = getattr(current, "model_fields", {}).get(part)
        if field is None:
            return []
        current = field.annotation
    return list(getattr(current, "model_fields", {}))


def describe_validation_error(exc: ValidationError, model: type[BaseModel]) -> str:
    lines = []
    for err in exc.errors():
        loc = tuple(p for p in err["loc"] if isinstance(p, str))
        path = ".".join(str(p) for p in err["loc"]) or "<top>"
        if err["type"] == "extra_forbidden":
            allowed = _allowed_keys(model, loc[:-1])
            hint = difflib.get_close_matches(str(loc[-1]), allowed, n=1)
            msg = f"unknown key {path!r}"
            if hint:
                msg += f" (did you mean {hint[0]!r}?)"
            elif allowed:
                msg += f" (allowed: {', '.join(allowed)})"
        else:
            # Strip pydantic's "Value error, " prefix from our own messages; a whole-config check
            # (no location) names its keys itself.
            text = err['msg'].removeprefix('Value error, ')
            msg = f"{path}: {text}" if err["loc"] else text
        lines.append(msg)
    return "invalid deploy config: " + "; ".join(lines)
