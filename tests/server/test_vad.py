"""SileroVAD on real speech (espeak-ng), checked against the silero-vad package's own streaming
iterator (its torch wrapper around the same ONNX model) as the independent reference."""

from __future__ import annotations

import io
import shutil
import subprocess
import wave

import numpy as np
import pytest
from scipy.signal import resample_poly

from duplexcache.server.vad import SAMPLE_RATE, WINDOW, SileroVAD, VadEvent, model_path

pytest.importorskip("onnxruntime")

SILENCE_1S = np.zeros(SAMPLE_RATE, dtype=np.float32)


def _speak(text: str) -> np.ndarray:
    """espeak-ng's voice for ``text`` at 16 kHz float32, trimmed of its own leading/trailing silence."""
    wav = subprocess.run(["espeak-ng", "-v", "en-us", "-s", "160", "--stdout", text],
                         capture_output=True, check=True, timeout=60).stdout
    with wave.open(io.BytesIO(wav)) as w:
        rate, raw = w.getframerate(), w.readframes(w.getnframes())
    pcm = np.frombuffer(raw, dtype="<i2").astype(np.float32) / 32768.0
    g = np.gcd(rate, SAMPLE_RATE)
    pcm = resample_poly(pcm, SAMPLE_RATE // g, rate // g).astype(np.float32)
    loud = np.flatnonzero(np.abs(pcm) > 0.01)
    return pcm[loud[0]:loud[-1] + 1]


@pytest.fixture(scope="module")
def phrase() -> np.ndarray:
    if shutil.which("espeak-ng") is None:
        pytest.skip("espeak-ng is not installed (apt-get install -y espeak-ng, or scripts/install_browser.sh): "
                    "the speech tests need real speech")
    return _speak("Hello there. This is a short test of the voice activity detector.")


def _feed_chunked(vad: SileroVAD, pcm: np.ndarray, chunk: int) -> list[VadEvent]:
    events: list[VadEvent] = []
    for i in range(0, len(pcm), chunk):
        events += vad.feed(pcm[i:i + chunk])
    return events


def _ms(samples: int) -> int:
    return samples * 1000 // SAMPLE_RATE


def test_model_ships_with_the_package():
    assert model_path().name == "silero_vad.onnx"


def test_silence_and_noise_give_no_events():
    vad = SileroVAD()
    assert vad.feed(np.zeros(5 * SAMPLE_RATE, dtype=np.float32)) == []
    noise = np.random.default_rng(0).normal(0, 0.01, 5 * SAMPLE_RATE).astype(np.float32)
    assert vad.feed(noise) == []
    assert not vad.speaking


def test_speech_then_silence_starts_and_stops_at_plausible_times(phrase):
    audio = np.concatenate([SILENCE_1S, phrase, SILENCE_1S, SILENCE_1S])
    speech_start, speech_end = _ms(SAMPLE_RATE), _ms(SAMPLE_RATE + len(phrase))
    events = SileroVAD(threshold=0.5, silence_duration_ms=500, prefix_padding_ms=300).feed(audio)
    assert [e.kind for e in events] == ["speech_started", "speech_stopped"], events
    started, stopped = events
    # Detection lags the onset by at most a few windows; the padding moves it 300 ms earlier.
    assert speech_start - 300 - 2 * 32 <= started.audio_ms <= speech_start - 300 + 300, events
    # The stop includes the 500 ms of silence (OpenAI's audio_end_ms does too).
    assert speech_end + 500 - 100 <= stopped.audio_ms <= speech_end + 500 + 300, events


def test_settings_move_the_events(phrase):
    audio = np.concatenate([SILENCE_1S, phrase, SILENCE_1S, SILENCE_1S])
    base = SileroVAD(silence_duration_ms=500, prefix_padding_ms=300).feed(audio)
    other = SileroVAD(silence_duration_ms=1000, prefix_padding_ms=0).feed(audio)
    assert other[0].audio_ms - base[0].audio_ms == 300
    # The stop fires on a window boundary, so a longer silence moves it by 500 ms +- one window.
    assert abs(other[1].audio_ms - base[1].audio_ms - 500) <= 32
    # Padding never goes before the stream's first sample.
    assert SileroVAD(prefix_padding_ms=5000).feed(audio)[0].audio_ms == 0


def test_two_utterances_give_two_pairs(phrase):
    audio = np.concatenate([SILENCE_1S, phrase, SILENCE_1S, SILENCE_1S, phrase, SILENCE_1S])
    events = SileroVAD().feed(audio)
    assert [e.kind for e in events] == ["speech_started", "speech_stopped"] * 2, events
    assert all(a.audio_ms < b.audio_ms for a, b in zip(events, events[1:]))


def test_chunking_does_not_change_the_events(phrase):
    audio = np.concatenate([SILENCE_1S, phrase, SILENCE_1S, phrase, SILENCE_1S, SILENCE_1S])
    whole = SileroVAD().feed(audio)
    assert len(whole) == 4
    for chunk in (160, 3200, 333, WINDOW, 1):  # 10 ms, 200 ms, odd, exactly one window, one sample
        if chunk == 1:
            audio_part = audio[: 3 * SAMPLE_RATE]  # sample by sample is slow in Python: a prefix is enough
            assert _feed_chunked(SileroVAD(), audio_part, 1) == SileroVAD().feed(audio_part)
            continue
        assert _feed_chunked(SileroVAD(), audio, chunk) == whole, chunk
    assert SileroVAD().feed(np.zeros(0, dtype=np.float32)) == []


def test_reset_forgets_the_stream(phrase):
    audio = np.concatenate([SILENCE_1S, phrase, SILENCE_1S])
    vad = SileroVAD()
    first = vad.feed(audio[: SAMPLE_RATE + SAMPLE_RATE // 2])  # stop mid-speech
    assert [e.kind for e in first] == ["speech_started"] and vad.speaking
    vad.reset()
    assert not vad.speaking
    assert vad.feed(audio) == SileroVAD().feed(audio)  # times restart at 0


def test_matches_the_silero_package_iterator(phrase):
    """The package's VADIterator (torch wrapper, same model, its own context/state handling) finds
    the same speech start; our stop is its end plus the silence we wait (OpenAI's convention)."""
    torch = pytest.importorskip("torch")
    from silero_vad.utils_vad import OnnxWrapper, VADIterator

    audio = np.concatenate([SILENCE_1S, phrase, SILENCE_1S, SILENCE_1S, phrase[: len(phrase) // 2],
                            SILENCE_1S, SILENCE_1S])
    silence_ms = 400
    ref = VADIterator(OnnxWrapper(str(model_path()), force_onnx_cpu=True), threshold=0.5,
                      min_silence_duration_ms=silence_ms, speech_pad_ms=0)
    ref_events = []
    for i in range(0, len(audio) - WINDOW + 1, WINDOW):
        out = ref(torch.from_numpy(audio[i:i + WINDOW].copy()))
        if out:
            ref_events.append(out)
    ours = SileroVAD(threshold=0.5, silence_duration_ms=silence_ms, prefix_padding_ms=0).feed(audio)
    assert len(ref_events) == len(ours) == 4, (ref_events, ours)
    for ref_event, event in zip(ref_events, ours):
        if "start" in ref_event:
            assert event.kind == "speech_started" and event.audio_ms == _ms(ref_event["start"])
        else:
            # Theirs is the start of the first silent window; ours is where the silence reached its length.
            assert event.kind == "speech_stopped"
            assert silence_ms <= event.audio_ms - _ms(ref_event["end"]) <= silence_ms + 32, (ref_event, event)


@pytest.mark.parametrize("bad, error", [
    (np.zeros((2, 160), dtype=np.float32), ValueError),
    (np.zeros(160, dtype=np.int16), ValueError),
    (np.array([0.0, np.nan], dtype=np.float32), ValueError),
    ([0.0] * 160, TypeError),
])
def test_bad_input_is_refused(bad, error):
    with pytest.raises(error):
        SileroVAD().feed(bad)


@pytest.mark.parametrize("kwargs", [{"threshold": 0.0}, {"threshold": 1.0}, {"silence_duration_ms": -1},
                                    {"prefix_padding_ms": -5}])
def test_bad_settings_are_refused(kwargs):
    with pytest.raises(ValueError):
        SileroVAD(**kwargs)
