"""Voices from clients' reference recordings (runtime/reference_voices.py): one per recording,
shared by every session that sends it, at most ``engine.max_reference_voices`` held, the least
recently used unheld one evicted for a new one."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from duplexcache.config import DeployConfig, packaged_config_path
from duplexcache.context.builder import ReferenceAudioError
from duplexcache.runtime.reference_voices import ReferenceVoices, ReferenceVoicesFull
from duplexcache.runtime.voices import synthetic_voice


def _rec(freq: float, seconds: float = 0.5) -> np.ndarray:
    t = np.arange(int(16_000 * seconds)) / 16_000
    return (0.2 * np.sin(2 * np.pi * freq * t)).astype(np.float32)


class _Host:
    def __init__(self, limit: int) -> None:
        self.now = 0.0
        self.registered: list[str] = []
        self.unregistered: list[str] = []
        self.held: set[str] = set()
        self.voices = ReferenceVoices(limit, synthetic_voice("default"), lambda v: self.registered.append(v.name),
                                      self.unregistered.append, lambda: self.held, clock=lambda: self.now,
                                      grace_s=10.0)


def test_one_voice_per_recording_shared_and_lru_eviction():
    host = _Host(limit=2)
    a = host.voices.add(_rec(200))
    assert host.voices.add(_rec(200).copy()) == a and host.registered == [a]   # same recording: shared
    assert (host.voices.added, host.voices.reuses) == (1, 1)
    b = host.voices.add(_rec(300))
    host.held = {b}
    with pytest.raises(ReferenceVoicesFull):          # a is unheld but inside its grace period
        host.voices.add(_rec(400))
    host.now = 11.0
    c = host.voices.add(_rec(400))                    # a is evicted (b is held)
    assert host.unregistered == [a] and host.registered == [a, b, c] and len(host.voices) == 2
    host.held = {b, c}
    host.now = 30.0
    with pytest.raises(ReferenceVoicesFull, match="max_reference_voices"):
        host.voices.add(_rec(500))
    with pytest.raises(ReferenceAudioError, match="too short"):
        host.voices.add(_rec(200, seconds=0.01))


def test_max_reference_voices_reaches_the_engine_from_yaml(tmp_path):
    from duplexcache.runtime.engine import build_engine

    torch.set_num_threads(1)
    path = tmp_path / "deploy.yaml"
    shipped = packaged_config_path("tiny").read_text()
    assert "  max_reference_voices: 8 " in shipped
    path.write_text(shipped.replace("  max_reference_voices: 8 ", "  max_reference_voices: 0 "))
    deploy = DeployConfig.from_yaml(path)
    assert deploy.engine.max_reference_voices == 0
    engine = build_engine(deploy)
    with pytest.raises(ReferenceAudioError, match="max_reference_voices: 0"):
        engine.add_reference_voice(_rec(200))
    engine.shutdown()
