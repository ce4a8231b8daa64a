"""Protocol parsing and audio decoding, without sockets; metrics bookkeeping."""

from __future__ import annotations

import base64
import json
import subprocess
import sys

import numpy as np
import pytest

from duplexcache.runtime.engine_api import EngineStats, TierBytes
from duplexcache.server import protocol as proto
from duplexcache.server.metrics import ServerMetrics


def _b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode()


def test_pcm16_decodes_to_reference_floats():
    rng = np.random.default_rng(0)
    ints = rng.integers(-32768, 32767, size=1000, dtype=np.int16)
    got = proto.decode_audio(_b64(ints.astype("<i2").tobytes()), "pcm16")
    assert got.dtype == np.float32 and got.shape == (1000,)
    # independent reference: per-sample struct-style conversion
    ref = np.array([int(v) / 32768.0 for v in ints], dtype=np.float32)
    assert np.array_equal(got, ref)


def test_f32_roundtrips_bit_exactly():
    rng = np.random.default_rng(1)
    pcm = rng.uniform(-1, 1, size=777).astype(np.float32)
    got = proto.decode_audio(_b64(pcm.astype("<f4").tobytes()), "f32")
    assert np.array_equal(got, pcm)


@pytest.mark.parametrize("raw, fmt, needle", [
    (b"\x01\x02\x03", "pcm16", "even byte count"),
    (b"\x00" * 6, "f32", "multiple of 4"),
    (b"", "pcm16", "empty"),
    (b"", "f32", "empty"),
    (np.array([0.0, np.nan], dtype="<f4").tobytes(), "f32", "NaN"),
    (np.array([np.inf], dtype="<f4").tobytes(), "f32", "NaN or infinite"),
])
def test_bad_audio_is_refused(raw, fmt, needle):
    with pytest.raises(proto.ProtocolError) as info:
        proto.decode_audio(_b64(raw), fmt)
    assert info.value.code == "invalid_audio" and needle in info.value.message


def test_bad_base64_is_refused():
    with pytest.raises(proto.ProtocolError, match="base64"):
        proto.decode_audio("not base64!!", "pcm16")


@pytest.mark.parametrize("text, code", [
    ("{not json", "invalid_json"),
    ("[1, 2]", "invalid_event"),
    ('{"event_id": "e1"}', "invalid_event"),
    ('{"type": "response.create"}', "unknown_event_type"),
    ('{"type": "input_audio_buffer.append"}', "invalid_audio"),
    ('{"type": "session.update", "session": []}', "invalid_session_config"),
    ('{"type": "session.update", "session": {}, "queue_if_full": "yes"}', "invalid_event"),
    ('{"type": "session.update", "session": {"duplex_context_caching": true}}', "private_config_key"),
    ('{"type": "session.update", "session": {"window": {"mode": "off"}}}', "private_config_key"),
])
def test_malformed_events(text, code):
    with pytest.raises(proto.ProtocolError) as info:
        proto.parse_client_event(text)
    assert info.value.code == code


def test_private_key_error_names_nested_path_and_keeps_event_id():
    text = json.dumps({"type": "session.update", "event_id": "c7", "session": {"window": {"mode": "rebuild"}}})
    with pytest.raises(proto.ProtocolError) as info:
        proto.parse_client_event(text)
    assert "'window.mode'" in info.value.message and info.value.event_id == "c7"


def test_valid_events_parse():
    ev = proto.parse_client_event(json.dumps({"type": "session.update", "session": {"voice": "v"},
                                              "queue_if_full": True, "event_id": "a"}))
    assert ev == proto.SessionUpdate({"voice": "v"}, True, "a")
    assert proto.parse_client_event('{"type": "session.close"}') == proto.SessionClose(None)
    assert proto.parse_client_event('{"type": "input_audio_buffer.append", "audio": "AAA="}') == \
        proto.AudioAppend("AAA=", None)


def test_server_events_have_type_and_unique_ids():
    events = [proto.audio_delta(b"\x00\x01"), proto.text_delta("hi"), proto.response_done(),
              proto.error_event("c", "m", event_id="x")]
    assert len({e["event_id"] for e in events}) == 4
    assert events[0]["delta"] == "AAE=" and events[3]["error"] == {
        "type": "invalid_request_error", "code": "c", "message": "m", "event_id": "x"}


def _stats(ticks: int, hits: int, latency: dict) -> EngineStats:
    return EngineStats(live_sessions=3, queued_sessions=1,
                       pools={"thinker_kv": TierBytes(shared=10, private=20, free=30)},
                       context_cache_hits=hits, context_cache_misses=1, cfm_fallbacks=0, ticks=ticks,
                       stage_latency_s=latency)


def test_metrics_turn_cumulative_counts_into_increments_and_observe_each_tick_once():
    m = ServerMetrics()
    lat = {"thinker": (0.01, 0.02)}
    m.update(_stats(1, 5, lat))
    m.update(_stats(1, 5, lat))   # a scrape between ticks: nothing new
    m.update(_stats(2, 7, lat))
    get = m.registry.get_sample_value
    assert get("duplexcache_context_cache_hits_total") == 7
    assert get("duplexcache_stage_latency_seconds_count", {"stage": "thinker"}) == 4
    assert get("duplexcache_bytes", {"pool": "thinker_kv", "tier": "shared"}) == 10
    assert get("duplexcache_bytes", {"pool": "thinker_kv", "tier": "free"}) == 30
    assert get("duplexcache_live_sessions") == 3 and get("duplexcache_queued_sessions") == 1
    m.update(_stats(3, 2, lat))   # counter went backwards: new baseline, no negative increment
    m.update(_stats(4, 4, lat))
    assert get("duplexcache_context_cache_hits_total") == 9


def test_tier_bytes_rejects_negative():
    with pytest.raises(ValueError, match="private"):
        TierBytes(shared=0, private=-1, free=0)


def test_core_imports_without_web_libraries():
    code = ("import sys\n"
            "for name in ('fastapi', 'uvicorn', 'starlette', 'websockets', 'prometheus_client'):\n"
            "    sys.modules[name] = None\n"
            "import duplexcache.config, duplexcache.runtime.engine_api\n"
            "import duplexcache.server.cli\n")  # the CLI module itself imports the web stack lazily
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
