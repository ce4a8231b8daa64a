"""Shared pieces of the engine tests: one tiny model bundle per test session, YAML deploys."""
from __future__ import annotations

import numpy as np
import torch
import yaml

from duplexcache.config import DeployConfig
from duplexcache.runtime.bundle import ModelBundle, build_models
from duplexcache.runtime.engine import DuplexEngine
from duplexcache.runtime.engine_api import (
    AudioDelta,
    ResponseDone,
    SessionError,
    TextDelta,
)

torch.set_num_threads(1)  # 2 shared cores: avoid oversubscription

_MODELS: dict[str, ModelBundle] = {}
FIRST = 16_560
UNIT = 16_000


def tiny_models() -> ModelBundle:
    """Built once (seeded); engines only read models, so tests share them."""
    if "tiny" not in _MODELS:
        _MODELS["tiny"] = build_models(DeployConfig.default("tiny"), seed=0)
    return _MODELS["tiny"]


# Admission by time measures this machine's ticks; tests must not depend on its speed, so
# the engines of these tests admit by memory only unless a test sets engine.tick_headroom.
NO_COMPUTE_LIMIT = 1e9
# Nor on its free RAM: ``memory_budget: auto`` on CPU is capped by what the host has available
# at start-up, so the tests' engines get the budget auto gives on a roomy machine unless a test
# sets engine.memory_budget (test_memory_budget.py tests auto itself).
TEST_MEMORY_BUDGET = "512MiB"


def deploy_from_yaml(tmp_path, name: str, sections: dict) -> DeployConfig:
    """Write ``sections`` as a deploy YAML and load it the way `duplexcache serve` does
    (``engine.tick_headroom`` defaults to ``NO_COMPUTE_LIMIT`` and ``engine.memory_budget`` to
    ``TEST_MEMORY_BUDGET`` here)."""
    defaults = {"tick_headroom": NO_COMPUTE_LIMIT, "memory_budget": TEST_MEMORY_BUDGET}
    sections = {**sections, "engine": {**defaults, **sections.get("engine", {})}}
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(sections))
    return DeployConfig.from_yaml(path, environ={})


def engine(tmp_path, name: str, sections: dict | None = None, models: ModelBundle | None = None) -> DuplexEngine:
    return DuplexEngine(deploy_from_yaml(tmp_path, name, sections or {}), models or tiny_models())


def audio(seed: int, units: int) -> np.ndarray:
    """Synthetic 16 kHz input for ``units`` units (the first is 1.035 s)."""
    n = FIRST + UNIT * (units - 1)
    return np.random.default_rng(seed).uniform(-0.3, 0.3, n).astype(np.float32)


def collect(events) -> dict:
    """sid -> {"audio": [pcm16 bytes...], "text": [...], "done": n, "errors": [...]}."""
    out: dict = {}
    for e in events:
        d = out.setdefault(e.sid, {"audio": [], "text": [], "done": 0, "errors": []})
        if isinstance(e, AudioDelta):
            d["audio"].append(e.pcm16)
        elif isinstance(e, TextDelta):
            d["text"].append(e.text)
        elif isinstance(e, ResponseDone):
            d["done"] += 1
        elif isinstance(e, SessionError):
            d["errors"].append(e)
    return out


def record_sdpa(monkeypatch, record) -> None:
    """Make torch's SDPA call ``record(q, k)`` before it runs. The real function runs with the patch
    lifted: a ``torch.nn.attention.bias.CausalBias`` mask dispatches only when it sees the real
    function (a patched one hands it the bias object as if it were a mask tensor)."""
    functional = torch.nn.functional
    real = functional.scaled_dot_product_attention

    def recording(q, k, v, *args, **kwargs):
        record(q, k)
        functional.scaled_dot_product_attention = real
        try:
            return real(q, k, v, *args, **kwargs)
        finally:
            functional.scaled_dot_product_attention = recording

    monkeypatch.setattr(functional, "scaled_dot_product_attention", recording)


def record_taken(eng: DuplexEngine) -> list[np.ndarray]:
    """Wrap ``eng.scheduler.take_units`` so that every unit's PCM it hands out is appended to the
    returned list (what the model heard, unit by unit)."""
    taken: list[np.ndarray] = []
    real = eng.scheduler.take_units

    def recording(*args, **kwargs):
        units = real(*args, **kwargs)
        taken.extend(u.pcm for u in units)
        return units

    eng.scheduler.take_units = recording
    return taken
