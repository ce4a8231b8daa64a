"""Protocol parsing, session.update shapes and input audio (decode, resample), without sockets;
metrics bookkeeping."""

from __future__ import annotations

import base64
import json
import re
import subprocess
import sys

import numpy as np
import pytest

from duplexcache.runtime.engine_api import EngineStats, TierBytes
from duplexcache.server import audio_io
from duplexcache.server import protocol as proto
from duplexcache.server.audio_io import InputAudio, InputFormat
from duplexcache.server.metrics import ServerMetrics
from duplexcache.server.session_config import SessionSettings, TurnDetection, apply_update, to_wire


def _b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode()


PCM16_16K = InputFormat("pcm16", 16000)
F32 = InputFormat("f32", 16000)


def test_pcm16_decodes_to_reference_floats():
    rng = np.random.default_rng(0)
    ints = rng.integers(-32768, 32767, size=1000, dtype=np.int16)
    got = audio_io.decode(_b64(ints.astype("<i2").tobytes()), PCM16_16K)
    assert got.dtype == np.float32 and got.shape == (1000,)
    # independent reference: per-sample struct-style conversion
    ref = np.array([int(v) / 32768.0 for v in ints], dtype=np.float32)
    assert np.array_equal(got, ref)


def test_f32_roundtrips_bit_exactly_and_16k_passes_through_untouched():
    rng = np.random.default_rng(1)
    pcm = rng.uniform(-1, 1, size=777).astype(np.float32)
    assert np.array_equal(audio_io.decode(_b64(pcm.astype("<f4").tobytes()), F32), pcm)
    stream = InputAudio(F32)
    assert np.array_equal(stream.push(_b64(pcm.astype("<f4").tobytes())), pcm)
    edge = np.array([-1.0, 1.0], dtype=np.float32)  # full scale is allowed, only beyond it is refused
    assert np.array_equal(audio_io.decode(_b64(edge.tobytes()), F32), edge)


def test_output_audio_g711_does_not_depend_on_chunking_and_flushes_its_tail():
    """24 kHz pcm16 -> G.711 at 8 kHz: the same audio however the engine's audio was chunked
    (soxr's int16 rounding moves a few samples by one step: under 1 % of them), a third as many
    samples once flushed, and nothing of one reply left in the next (bit for bit)."""
    rng = np.random.default_rng(3)
    pcm = (np.sin(np.arange(30_000) * 0.05) * 9000 + rng.normal(0, 500, 30_000)).astype("<i2")
    for kind in ("pcmu", "pcma"):
        outs = []
        for cut in (24_000, 7_001, 30_000):
            stream = audio_io.OutputAudio(kind)
            out = b"".join(stream.encode(pcm[i:i + cut].tobytes()) for i in range(0, pcm.size, cut))
            outs.append(out + stream.flush())
        assert all(len(out) == pcm.size // 3 for out in outs)
        for out in outs[1:]:
            differ = np.frombuffer(out, np.uint8) != np.frombuffer(outs[0], np.uint8)
            assert differ.mean() < 0.01
            linear = [np.frombuffer(audio_io.audioop.ulaw2lin(o, 2) if kind == "pcmu" else
                                    audio_io.audioop.alaw2lin(o, 2), "<i2").astype(int) for o in (out, outs[0])]
            assert np.abs(linear[0] - linear[1]).max() <= 512   # one companding step near these levels
        assert stream.bytes_per_second == 8000 and stream.rate == 8000
        # after a flush (or a reset) the stream starts afresh: the same reply gives the same bytes
        again = stream.encode(pcm.tobytes()) + stream.flush()
        assert again == outs[2]
        stream.encode(pcm[:5000].tobytes())
        stream.reset()
        assert stream.encode(pcm.tobytes()) + stream.flush() == outs[2]
    plain = audio_io.OutputAudio("pcm16")
    assert plain.encode(pcm.tobytes()) == pcm.tobytes() and plain.flush() == b"" and plain.bytes_per_second == 48_000
    with pytest.raises(ValueError, match="unknown output audio kind"):
        audio_io.OutputAudio("f32")


@pytest.mark.parametrize("raw, fmt, needle", [
    (b"\x01\x02\x03", PCM16_16K, "multiple of 2"),
    (b"\x00" * 6, F32, "multiple of 4"),
    (b"", PCM16_16K, "empty"),
    (b"", F32, "empty"),
    (np.array([0.0, np.nan], dtype="<f4").tobytes(), F32, "NaN"),
    (np.array([np.inf], dtype="<f4").tobytes(), F32, "NaN or infinite"),
    (np.array([0.0, 1.01], dtype="<f4").tobytes(), F32, "1.01"),
    (np.array([-1.0000001], dtype="<f4").tobytes(), F32, "[-1, 1]"),
])
def test_bad_audio_is_refused(raw, fmt, needle):
    with pytest.raises(audio_io.AudioError, match=re.escape(needle)):
        audio_io.decode(_b64(raw), fmt)


def test_bad_base64_is_refused():
    with pytest.raises(audio_io.AudioError, match="base64"):
        audio_io.decode("not base64!!", PCM16_16K)


def _g711_reference(codes: np.ndarray, law: str) -> np.ndarray:
    """ITU-T G.711 expansion written from the standard's segment/quantisation rule (independent of audioop)."""
    out = []
    for code in codes.tolist():
        if law == "u":
            c = ~code & 0xFF
            sign, exponent, mantissa = c & 0x80, (c >> 4) & 7, c & 0x0F
            mag = (((mantissa << 3) + 0x84) << exponent) - 0x84
        else:
            c = code ^ 0x55
            sign, exponent, mantissa = (c & 0x80) ^ 0x80, (c >> 4) & 7, c & 0x0F
            mag = (mantissa << 4) + 8 if exponent == 0 else ((mantissa << 4) + 0x108) << (exponent - 1)
        out.append(-mag if sign else mag)
    return np.array(out, dtype=np.float32) / 32768.0


@pytest.mark.parametrize("kind, law", [("pcmu", "u"), ("pcma", "a")])
def test_g711_decodes_like_the_standard(kind, law):
    codes = np.arange(256, dtype=np.uint8)
    got = audio_io.decode(_b64(codes.tobytes()), InputFormat(kind, 8000))
    np.testing.assert_array_equal(got, _g711_reference(codes, law))


@pytest.mark.parametrize("rate", [24000, 8000])
def test_streaming_resampler_is_chunking_invariant_and_tracks_a_tone(rate):
    fmt = InputFormat("pcm16", rate) if rate == 24000 else InputFormat("pcmu", 8000)
    t = np.arange(rate * 2) / rate
    tone = 0.25 * np.sin(2 * np.pi * 300 * t)
    if fmt.kind == "pcm16":
        raw = (tone * 32767).astype("<i2").tobytes()
    else:  # mu-law encode through audioop, the library the decoder uses too
        import audioop
        raw = audioop.lin2ulaw((tone * 32767).astype("<i2").tobytes(), 2)
    width = 2 if fmt.kind == "pcm16" else 1
    outs = []
    for chunk_samples in (160, 1000, rate):  # 20 ms (8 kHz) ... 1 s chunks
        stream = InputAudio(fmt)
        step = chunk_samples * width
        outs.append(np.concatenate([stream.push(_b64(raw[i:i + step])) for i in range(0, len(raw), step)]))
        assert stream.ms_in == 2000
    n = min(o.size for o in outs)
    assert n > 31000
    for other in outs[1:]:
        assert np.array_equal(outs[0][:n], other[:n])  # no clicks or drift at chunk boundaries
    # soxr compensates its filter delay: the output is the same tone sampled at 16 kHz
    ref = 0.25 * np.sin(2 * np.pi * 300 * np.arange(n) / 16000)
    tol = 2e-3 if fmt.kind == "pcm16" else 2e-2  # mu-law quantisation noise
    np.testing.assert_allclose(outs[0][200:n - 200], ref[200:n - 200], atol=tol)


@pytest.mark.parametrize("kind, rate", [("pcm16", 44100), ("pcmu", 16000), ("opus", 48000)])
def test_unsupported_formats_are_named(kind, rate):
    with pytest.raises(ValueError, match=kind):
        InputFormat(kind, rate)


# ---------------------------------------------------------------------------- events

@pytest.mark.parametrize("text, code", [
    ("{not json", "invalid_json"),
    ("[1, 2]", "invalid_event"),
    ('{"event_id": "e1"}', "invalid_event"),
    ('{"type": "response.function_call_arguments.delta"}', "unknown_event_type"),
    ('{"type": 7}', "invalid_event"),
    ('{"type": "session.update", "event_id": 3}', "invalid_event"),
])
def test_malformed_events(text, code):
    with pytest.raises(proto.ProtocolError) as info:
        proto.parse_client_event(text)
    assert info.value.code == code


def test_echoed_client_strings_are_bounded():
    huge = "x" * 100_000
    with pytest.raises(proto.ProtocolError) as info:
        proto.parse_client_event(json.dumps({"type": huge, "event_id": huge}))
    event = proto.error_event(info.value.code, info.value.message, event_id=info.value.event_id,
                              param=info.value.param)
    assert len(proto.encode(event)) < 1000
    assert event["error"]["event_id"].startswith("x" * 64) and "(100000 chars)" in event["error"]["event_id"]
    with pytest.raises(proto.ProtocolError) as info:
        apply_update(SessionSettings(), {huge: 1}, "e", audio_started=False)
    assert len(info.value.message) < 300 and len(info.value.param) < 120


def test_valid_events_parse():
    ev = proto.parse_client_event(json.dumps({"type": "input_audio_buffer.append", "audio": "AAA=",
                                              "event_id": "a"}))
    assert (ev.type, ev.event_id, proto.field(ev, "audio", str)) == ("input_audio_buffer.append", "a", "AAA=")
    with pytest.raises(proto.ProtocolError) as info:
        proto.field(proto.parse_client_event('{"type": "conversation.item.truncate", "audio_end_ms": true}'),
                    "audio_end_ms", int)
    assert info.value.code == "invalid_value"  # a bool is not an int here


def test_server_events_have_type_and_unique_ids():
    events = [proto.event("session.updated"), proto.event("session.updated"),
              proto.error_event("c", "m", event_id="x")]
    assert len({e["event_id"] for e in events}) == 3
    assert events[2]["error"] == {"type": "invalid_request_error", "code": "c", "message": "m", "param": None,
                                  "event_id": "x"}


# ---------------------------------------------------------------------------- session.update shapes

def test_ga_beta_and_our_shapes_reach_the_same_settings():
    ga = {"type": "realtime", "instructions": "hi", "output_modalities": ["audio"],
          "audio": {"input": {"format": {"type": "audio/pcm", "rate": 16000},
                              "turn_detection": {"type": "server_vad", "threshold": 0.7, "silence_duration_ms": 300,
                                                 "prefix_padding_ms": 100, "create_response": False}},
                    "output": {"format": {"type": "audio/pcm", "rate": 24000}, "voice": "alt"}}}
    beta = {"instructions": "hi", "voice": "alt", "input_audio_format": "pcm16", "input_sample_rate": 16000,
            "output_audio_format": "pcm16", "modalities": ["audio", "text"], "temperature": 0.8,
            "turn_detection": {"type": "server_vad", "threshold": 0.7, "silence_duration_ms": 300,
                               "prefix_padding_ms": 100, "create_response": False}}
    a, changed = apply_update(SessionSettings(), ga, None, audio_started=False)
    b, _ = apply_update(SessionSettings(), beta, None, audio_started=False)
    assert a == b
    assert set(changed) == {"instructions", "voice", "input_rate", "turn_detection"}
    assert a.turn == TurnDetection("server_vad", 0.7, 300, 100, create_response=False)
    assert a.engine_session() == {"instructions": "hi", "voice": "alt"}


@pytest.mark.parametrize("session, openai_client, want", [
    ({}, True, ("pcm16", 24000)),                           # OpenAI's default for its clients
    ({}, False, ("pcm16", 16000)),                          # our original clients
    ({"input_audio_format": "pcm16"}, True, ("pcm16", 24000)),   # beta pcm16 is 24 kHz
    ({"input_audio_format": "pcm16"}, False, ("pcm16", 16000)),  # ours is 16 kHz
    ({"input_audio_format": "g711_ulaw"}, True, ("pcmu", 8000)),
    ({"audio": {"input": {"format": {"type": "audio/pcma"}}}}, True, ("pcma", 8000)),
    ({"audio": {"input": {"format": {"type": "audio/pcm"}}}}, False, ("pcm16", 24000)),  # GA: explicit
    ({"input_audio_format": "f32"}, True, ("f32", 16000)),
])
def test_input_format_defaults(session, openai_client, want):
    settings, _ = apply_update(SessionSettings(), session, None, audio_started=False)
    fmt = settings.input_format(openai_client)
    assert (fmt.kind, fmt.rate) == want


@pytest.mark.parametrize("session, kind, wire", [
    ({}, "pcm16", ("pcm16", {"type": "audio/pcm", "rate": 24000}, 24000)),
    ({"output_audio_format": "g711_ulaw"}, "pcmu", ("g711_ulaw", {"type": "audio/pcmu"}, 8000)),
    ({"audio": {"output": {"format": {"type": "audio/pcma"}}}}, "pcma", ("g711_alaw", {"type": "audio/pcma"}, 8000)),
    ({"audio": {"output": {"format": {"type": "audio/pcm", "rate": 24000}}}}, "pcm16",
     ("pcm16", {"type": "audio/pcm", "rate": 24000}, 24000)),
])
def test_output_formats_telephony_included(session, kind, wire):
    settings, _ = apply_update(SessionSettings(), session, None, audio_started=False)
    assert settings.output_kind == kind
    shown = to_wire("s", settings, settings.input_format(True), "default", None)
    assert (shown["output_audio_format"], shown["audio"]["output"]["format"], shown["output_sample_rate"]) == wire
    # the output format is one the session streams in: fixed once its audio started
    other = {"output_audio_format": "g711_alaw" if kind != "pcma" else "pcm16"}
    with pytest.raises(proto.ProtocolError) as info:
        apply_update(settings, other, None, audio_started=True)
    assert (info.value.code, info.value.param) == ("session_field_fixed", "session.output_audio_format")


@pytest.mark.parametrize("session, code, param", [
    ({"audio": {"input": {"format": {"type": "audio/pcm", "rate": 44100}}}}, "invalid_value",
     "session.audio.input.format.rate"),
    ({"audio": {"output": {"format": {"type": "audio/pcm", "rate": 16000}}}}, "invalid_value",
     "session.audio.output.format"),
    ({"output_audio_format": "f32"}, "invalid_value", "session.output_audio_format"),
    ({"input_audio_format": "opus"}, "invalid_value", "session.input_audio_format"),
    ({"turn_detection": {"type": "push_to_talk"}}, "invalid_value", "session.turn_detection.type"),
    ({"turn_detection": {"type": "server_vad", "threshold": 2}}, "invalid_value", "session.turn_detection.threshold"),
    ({"tools": [{"type": "function", "name": "f"}]}, "invalid_value", "session.tools"),
    ({"output_modalities": ["video"]}, "invalid_value", "session.output_modalities"),
    ({"modalities": []}, "invalid_value", "session.modalities"),
    ({"modalities": "text"}, "invalid_value", "session.modalities"),
    ({"voice": 3}, "invalid_value", "session.voice"),
    # a lone surrogate (JSON's "\\ud800") that no tokenizer encodes: refused here, not at the open
    ({"instructions": "hi \ud800"}, "invalid_value", "session.instructions"),
    ({"initial_user_text": "\udc00"}, "invalid_value", "session.initial_user_text"),
    ({"type": "realtime", "audio": {"output": {"voice": "a\ud800"}}}, "invalid_value", "session.audio.output.voice"),
    ({"colour": "red"}, "unknown_parameter", "session.colour"),
    ({"window": {"mode": "off"}}, "private_config_key", "session.window.mode"),
])
def test_bad_session_fields_are_named(session, code, param):
    with pytest.raises(proto.ProtocolError) as info:
        apply_update(SessionSettings(), session, "ev", audio_started=False)
    assert (info.value.code, info.value.param, info.value.event_id) == (code, param, "ev")


def test_text_modality_turns_the_engine_audio_output_off():
    """OpenAI's text-only modality (GA output_modalities, beta modalities) is the engine's
    ``audio_output: false``; audio (with or without text) leaves the engine's default."""
    for session in ({"output_modalities": ["text"]}, {"modalities": ["text"]}):
        settings, changed = apply_update(SessionSettings(), session, None, audio_started=False)
        assert changed == ["audio_output"] and settings.engine_session()["audio_output"] is False
    for session in ({"output_modalities": ["audio"]}, {"modalities": ["audio", "text"]}):
        settings, _ = apply_update(SessionSettings(), session, None, audio_started=False)
        assert "audio_output" not in settings.engine_session()


def test_fixed_fields_refused_once_audio_started_turn_detection_not():
    settings, _ = apply_update(SessionSettings(), {"voice": "alt", "instructions": "x"}, None, audio_started=False)
    for session, name in (({"voice": "default"}, "voice"), ({"instructions": "y"}, "instructions"),
                          ({"audio": {"output": {"voice": "v2"}}}, "voice"),
                          ({"input_audio_format": "g711_alaw"}, "input_audio_format"),
                          ({"initial_user_text": "hello"}, "initial_user_text"),
                          ({"modalities": ["text"]}, "output_modalities")):
        with pytest.raises(proto.ProtocolError) as info:
            apply_update(settings, session, None, audio_started=True)
        assert info.value.code == "session_field_fixed" and info.value.param == f"session.{name}"
    same, changed = apply_update(settings, {"voice": "alt", "turn_detection": None}, None, audio_started=True)
    assert changed == ["turn_detection"] and same.turn.type == "none"
    semantic, _ = apply_update(settings, {"turn_detection": {"type": "semantic_vad"}}, None, audio_started=True)
    assert semantic.turn.type == "duplex"


def test_wire_session_has_ga_and_beta_views():
    settings, _ = apply_update(SessionSettings(), {"voice": "alt", "input_audio_format": "g711_ulaw"}, None,
                               audio_started=False)
    wire = to_wire("sess_1", settings, settings.input_format(True), "default", "m")
    assert wire["audio"]["input"]["format"] == {"type": "audio/pcmu"}
    assert wire["audio"]["output"] == {"format": {"type": "audio/pcm", "rate": 24000}, "voice": "alt"}
    assert (wire["voice"], wire["input_audio_format"], wire["output_audio_format"]) == ("alt", "g711_ulaw", "pcm16")
    assert wire["turn_detection"] == {"type": "duplex", "interrupt_response": True}


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
