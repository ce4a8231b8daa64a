"""Issue #42: the sharing equality of ``duplexcache bench memory`` at 8 sessions, in CI.

Eight sessions through the serving engine (tiny preset, CPU), two voices, three contexts, a
64/48-token window so every session's window compacts after the fast-forward; every sharing
configuration of the matrix must give each session the same text and pcm16 (``torch.equal``) as
``all_off``.

The run uses ``engine.batch_invariant: false`` on purpose: with batch-invariant kernels a session's
bits would not depend on its tick neighbours, and the check would pass whatever the schedule. Off,
it is only equal when every session's units fall on the same ticks in both arms, which is what
``EngineTarget.open_sessions`` guarantees by prefilling every context before the first unit.
2674ee4's behaviour (sessions go live as soon as their own prefill ends, so shared anchor blocks
make later sessions live ticks earlier than in ``all_off``) is the second test: it must fail.
"""
from __future__ import annotations

import pytest
import torch

from duplexcache.bench.engine_target import EngineTarget
from duplexcache.bench.matrix import config_matrix
from duplexcache.bench.runner import run_sweep
from duplexcache.config import DeployConfig
from duplexcache.runtime.bundle import build_models

SESSIONS = 8
VOICES = ("default", "alt")
CONTEXTS = 3


def _deploy() -> DeployConfig:
    data = DeployConfig.default("tiny", environ={}).to_dict()
    data["stage0"]["window"].update(high_tokens=64, low_tokens=48)
    data["engine"]["batch_invariant"] = False
    data["engine"]["memory_budget"] = "512MiB"
    data["engine"]["tick_headroom"] = 1e9        # admit by memory only: no dependence on this CPU's speed
    # A prefill chunk of 3 of these contexts: the unshared arm needs 3 ticks to prefill all 8, so
    # the schedule differs from the shared arm unless the bench holds every first unit.
    data["engine"]["prefill_chunk_tokens"] = 256
    return DeployConfig.from_dict(data, environ={})


@pytest.fixture(scope="module")
def models():
    return build_models(_deploy(), seed=0)


def _sweep(models, names: set[str] | None = None):
    configs = [c for c in config_matrix(_deploy()) if names is None or c.name in names]
    units = EngineTarget.units_to_steady(models.voices.get("default").prompt_frames)
    return run_sweep(configs, [1, SESSIONS],   # the runner fits a slope: two counts
                     lambda cfg, n: EngineTarget(models, cfg.deploy, n, voices=VOICES, contexts=CONTEXTS),
                     units=units, device=torch.device("cpu"), ff_chunk=32)


def test_every_configuration_equals_all_off_at_8_sessions(models):
    results = _sweep(models)
    assert [r.config.name for r in results][0] == "all_off"
    for r in results[1:]:
        assert r.compared_sessions == 1 + SESSIONS, r.config.name
        assert r.equal_to_all_off, (r.config.name, r.mismatches)


def test_sessions_going_live_as_their_prefill_ends_fail_the_check(models, monkeypatch):
    """The schedule of 2674ee4: no prefill before the first unit. The check must catch it."""
    monkeypatch.setattr(EngineTarget, "prefill_all", lambda self: None)
    results = _sweep(models, {"all_off", "shared_anchor_blocks"})
    shared = {r.config.name: r for r in results}["shared_anchor_blocks"]
    assert shared.mismatches, "the equality check passed with the sessions' schedules differing"
