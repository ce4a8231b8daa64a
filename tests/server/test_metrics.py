"""/metrics fed from a real (tiny, CPU) engine: counters that say whether turn starts stay cheap."""
from __future__ import annotations

import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from duplexcache.config import DeployConfig
from duplexcache.runtime.bundle import build_models
from duplexcache.runtime.engine import DuplexEngine
from duplexcache.runtime.engine_api import AudioDelta, ResponseDone
from duplexcache.server.metrics import ServerMetrics


def _samples(text: str, name: str) -> dict[str, float]:
    """voice label -> value of every sample called ``name``."""
    return {s.labels.get("voice", ""): s.value for fam in text_string_to_metric_families(text)
            for s in fam.samples if s.name == name}


def test_prompt_passes_counter_counts_one_pass_per_voice_however_many_turns():
    deploy = DeployConfig.default("tiny")
    deploy.engine.speak_policy.k = deploy.engine.speak_policy.turn_units = 1   # every unit ends a turn
    deploy.engine.tick_headroom = 1e9   # admission by time would depend on this machine's speed
    engine = DuplexEngine(deploy, build_models(deploy, seed=0))
    metrics = ServerMetrics()
    metrics.update(engine.stats())
    at_start = _samples(metrics.render()[0].decode(), "duplexcache_cfm_prompt_passes_total")
    assert at_start == {voice: 1.0 for voice in engine.voices.names()} and len(at_start) >= 2

    sids = [engine.open_session({"voice": v}) for v in engine.voices.names()]
    rng = np.random.default_rng(0)
    for sid in sids:
        engine.push_audio(sid, rng.uniform(-0.3, 0.3, 16_560 + 3 * 16_000).astype(np.float32))
    events = [e for _ in range(5) for e in engine.tick()]
    assert sum(isinstance(e, ResponseDone) for e in events) >= 2 * len(sids)   # several turn starts each
    assert any(isinstance(e, AudioDelta) for e in events)
    metrics.update(engine.stats())
    after = _samples(metrics.render()[0].decode(), "duplexcache_cfm_prompt_passes_total")
    assert after == at_start   # turn starts took the registered state: no pass in a tick
    engine.shutdown()


def test_window_compactions_are_counted_on_metrics():
    """Issue 46: how often the Thinker windows compacted, for a soak's record. A 64/48-token
    window compacts within a few units; the counter is the engine's, exported as a counter."""
    data = DeployConfig.default("tiny").to_dict()
    data["stage0"]["window"].update(high_tokens=64, low_tokens=48)
    data["engine"]["tick_headroom"] = 1e9
    deploy = DeployConfig.from_dict(data, environ={})
    engine = DuplexEngine(deploy, build_models(deploy, seed=0))
    metrics = ServerMetrics()
    metrics.update(engine.stats())
    assert _samples(metrics.render()[0].decode(), "duplexcache_window_compactions_total") == {"": 0.0}
    sids = [engine.open_session({"voice": "default", "instructions": f"compact {i}"}) for i in range(2)]
    rng = np.random.default_rng(1)
    for sid in sids:
        engine.push_audio(sid, rng.uniform(-0.3, 0.3, 16_560 + 7 * 16_000).astype(np.float32))
    for _ in range(9):
        engine.tick()
    per_session = [engine.stage0.sessions[sid].num_compactions for sid in sids]
    assert min(per_session) >= 1
    stats = engine.stats()
    assert stats.window_compactions == sum(per_session)
    metrics.update(stats)
    assert _samples(metrics.render()[0].decode(), "duplexcache_window_compactions_total") == {"": sum(per_session)}
    engine.shutdown()
