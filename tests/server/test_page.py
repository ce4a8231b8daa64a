"""The browser page: its routes, and the page itself in a real headless Chromium (Debian's
``chromium`` driven by Playwright) with a fake microphone playing espeak-ng speech, against a real
server on 127.0.0.1 with the deterministic FakeEngine behind it."""

from __future__ import annotations

import contextlib
import io
import shutil
import subprocess
import time
import wave

import httpx
import numpy as np
import pytest
from server_fakes import FakeEngine, LoopbackServers, wait_for

from duplexcache.config import OPENAI_VOICES, DeployConfig
from duplexcache.runtime.voices import VoiceRegistry
from duplexcache.server.page import voice_names

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
ESPEAK = shutil.which("espeak-ng")
TICK = 0.05
OUT_RATE = 24_000
CHUNK_MS = 40  # the page's microphone chunk (app.js CHUNK_MS)


class _VoicedEngine(FakeEngine):
    """The fake engine with a voice registry (its names are checked)."""

    def __init__(self, deploy: DeployConfig, **kwargs):
        super().__init__(deploy, **kwargs)
        self.voices = VoiceRegistry.synthetic(("default", "alt", "bright"), ref_seconds=0.2, prompt_seconds=0.2)


@pytest.fixture
def server():
    servers = LoopbackServers(TICK)

    def _start(engine_cls=FakeEngine, api_key: str | None = None, **engine_kwargs):
        return servers.start(engine_cls, server={"api_key": api_key}, **engine_kwargs)

    yield _start
    servers.stop_all()


def test_page_and_its_files_are_served(server):
    _, srv = server()
    page = httpx.get(srv.http_url("/"), timeout=10)
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert 'src="static/app.js"' in page.text
    for path, needle in [("/static/app.js", "window.duplexStats"),
                         ("/static/capture-worklet.js", 'registerProcessor("capture-processor"'),
                         ("/static/style.css", ".meter")]:
        resp = httpx.get(srv.http_url(path), timeout=10)
        assert resp.status_code == 200 and needle in resp.text, path
    assert httpx.get(srv.http_url("/static/../app.py"), timeout=10).status_code == 404
    assert httpx.get(srv.http_url("/static/nope.js"), timeout=10).status_code == 404


def test_voices_come_from_the_engine(server):
    _, plain = server()
    aliases = {name: "default" for name in OPENAI_VOICES}   # server.voice_aliases' default
    assert httpx.get(plain.http_url("/v1/voices"), timeout=10).json() == {"voices": ["default"], "default": "default",
                                                                          "aliases": aliases}
    _, voiced = server(_VoicedEngine)
    body = httpx.get(voiced.http_url("/v1/voices"), timeout=10).json()
    assert body == {"voices": ["alt", "bright", "default"], "default": "default", "aliases": aliases}


def test_voice_names_without_a_default():
    class _Engine:
        def __init__(self, names):
            self.names = names

        def voice_names(self):
            return self.names

    assert voice_names(_Engine(["alpha", "zeta"])) == ["alpha", "zeta"]
    assert voice_names(_Engine(None)) == ["default"]   # an engine that does not check names


# ------------------------------------------------------------------------------ the browser

def _mic_wav(path) -> None:
    """1 s of silence, an espeak-ng sentence, 2 s of silence: 16 kHz mono pcm16 (Chromium loops it)."""
    spoken = subprocess.run(["espeak-ng", "-v", "en-us", "-s", "160", "--stdout",
                             "Hello there. Please tell me something about the weather today."],
                            capture_output=True, check=True, timeout=60).stdout
    with wave.open(io.BytesIO(spoken)) as w:
        rate, raw = w.getframerate(), w.readframes(w.getnframes())
    with wave.open(str(path), "wb") as out:
        out.setnchannels(1)
        out.setsampwidth(2)
        out.setframerate(rate)
        out.writeframes(bytes(2 * rate) + raw + bytes(2 * 2 * rate))


@contextlib.contextmanager
def _browser(tmp_path):
    """Headless Debian Chromium whose fake microphone plays a WAV of speech, closed on exit."""
    sync_api = pytest.importorskip("playwright.sync_api")
    wav = tmp_path / "mic.wav"
    _mic_wav(wav)
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=[
            "--use-fake-ui-for-media-stream",           # grant the microphone without a prompt
            "--use-fake-device-for-media-stream",
            f"--use-file-for-fake-audio-capture={wav}",
            "--autoplay-policy=no-user-gesture-required",
        ])
        try:
            yield browser
        finally:
            browser.close()


def _wait_for_stats(page, condition: str, timeout_s: float) -> dict:
    """Poll window.duplexStats until the JS ``condition`` on ``s`` holds (generous: CI is slow)."""
    deadline = time.monotonic() + timeout_s
    while True:
        # One evaluation: the snapshot returned is the one the condition held on (two calls
        # raced the page: the condition could turn true after an older snapshot was read).
        held, stats = page.evaluate(f"(s => [Boolean({condition}), s])(window.duplexStats)")
        if held:
            return stats
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {condition}: {stats}")
        time.sleep(0.25)


@pytest.mark.skipif(CHROMIUM is None, reason="no chromium (apt-get install -y chromium, or scripts/install_browser.sh)")
@pytest.mark.skipif(ESPEAK is None, reason="no espeak-ng for the fake microphone's speech (scripts/install_browser.sh)")
def test_the_page_talks_and_plays_the_reply(server, tmp_path):
    engine, srv = server(_VoicedEngine)
    with _browser(tmp_path) as browser:
        page = browser.new_page()
        errors: list[str] = []
        page.on("pageerror", lambda exc: errors.append(str(exc)))
        page.goto(srv.http_url("/"))
        # The voice picker is filled from /v1/voices.
        page.wait_for_function("document.querySelectorAll('#voice option').length === 3")
        page.select_option("#voice", "alt")
        page.fill("#instructions", "Talk about the weather.")
        page.click("#start")
        _wait_for_stats(page, f"s.replySamplesPlayed >= {OUT_RATE} && s.sessionReady", 90)
        page.click("#stop")
        stats = _wait_for_stats(page, "!s.connected", 30)  # nothing is sent after this
    assert errors == [] and stats["errors"] == [], (errors, stats)
    assert stats["contextSampleRate"] in (OUT_RATE, 44_100, 48_000)
    assert stats["events"]["session.created"] == 1 and stats["events"]["session.updated"] >= 1
    assert stats["events"]["response.output_audio.delta"] >= 1
    assert stats["replySamplesReceived"] >= stats["replySamplesPlayed"] >= OUT_RATE
    (sid,) = engine.configs
    assert engine.configs[sid]["voice"] == "alt"
    assert engine.configs[sid]["instructions"] == "Talk about the weather."
    # What the page says it sent is what the engine got: 24 kHz pcm16 from the page, 16 kHz at the
    # engine (the server resamples). Short by at most the resampler's held-back tail (< 30 ms) and
    # the chunk in flight when the socket closed (40 ms); a wrong rate would be off by a third.
    expected = stats["bytesSent"] // 2 * 2 // 3
    assert expected > 16_000
    slack = 16 * (30 + CHUNK_MS)

    def _received() -> int:
        return sum(len(chunk) for chunk in engine.received.get(sid, []))

    wait_for(lambda: expected - slack <= _received() <= expected, timeout=20,
             what=f"the engine to receive {expected} samples less at most {slack}")
    assert np.isfinite(np.concatenate(engine.received[sid])).all()


@pytest.mark.skipif(CHROMIUM is None, reason="no chromium (apt-get install -y chromium, or scripts/install_browser.sh)")
@pytest.mark.skipif(ESPEAK is None, reason="no espeak-ng for the fake microphone's speech (scripts/install_browser.sh)")
def test_server_vad_turns_and_barge_in(server, tmp_path):
    """server_vad end to end: the server's Silero VAD hears the fake microphone's sentence, the
    reply plays, and the sentence's next loop interrupts it: playback stops and the page tells the
    server how much it heard (conversation.item.truncate), which reaches the engine's cancel."""
    engine, srv = server(_VoicedEngine, done_after_units=6)  # replies long enough to be interrupted
    with _browser(tmp_path) as browser:
        page = browser.new_page()
        page.goto(srv.http_url("/"))
        page.select_option("#turn-detection", "server_vad")
        page.uncheck("#local-barge-in")  # only the server's VAD decides here
        page.click("#start")
        stats = _wait_for_stats(page, "s.bargeIns >= 1 && (s.events['input_audio_buffer.speech_stopped'] || 0) >= 1"
                                      " && s.replySamplesPlayed > 0", 120)
        page.click("#stop")
    assert stats["errors"] == [], stats
    assert stats["events"]["input_audio_buffer.speech_started"] >= 2
    (sid,) = engine.configs
    assert engine.turn_modes[sid][-1] == "manual"  # server_vad asks for each reply itself
    wait_for(lambda: any(s == sid for s, _ in engine.cancels), timeout=20, what="the engine's cancel")


@pytest.mark.skipif(CHROMIUM is None, reason="no chromium (apt-get install -y chromium, or scripts/install_browser.sh)")
@pytest.mark.skipif(ESPEAK is None, reason="no espeak-ng for the fake microphone's speech (scripts/install_browser.sh)")
def test_api_key_rides_in_the_subprotocol(server, tmp_path):
    """A server with an API key: the page's key field gets in (subprotocol auth, the only way a
    browser can present a key); a wrong key is refused and the page says so."""
    engine, srv = server(api_key="s3cret-key")
    with _browser(tmp_path) as browser:
        wrong = browser.new_page()
        wrong.goto(srv.http_url("/"))
        wrong.fill("#api-key", "not-the-key")
        wrong.click("#start")
        refused = _wait_for_stats(wrong, "s.errors.length > 0", 30)
        right = browser.new_page()
        right.goto(srv.http_url("/"))
        right.fill("#api-key", "s3cret-key")
        right.click("#start")
        accepted = _wait_for_stats(right, "s.sessionReady && s.chunksSent > 0", 30)
        right.click("#stop")
    assert not refused["sessionReady"] and "session.created" not in refused["events"], refused
    assert "check the API key" in refused["errors"][0], refused
    assert accepted["errors"] == [] and accepted["events"]["session.created"] == 1, accepted
    assert len(engine.configs) <= 1  # only the right key's session can have reached the engine
