"""`duplexcache serve` argument handling and wiring, and the example client end to end."""

from __future__ import annotations

import argparse
import importlib.util
import logging
import re
import signal
import socket
import subprocess
import sys
import time
import types
import urllib.request
import wave
from pathlib import Path

import numpy as np
import pytest
import uvicorn
from server_fakes import FakeEngine

from duplexcache import cli as top_cli
from duplexcache.config import DeployConfig
from duplexcache.server import cli
from duplexcache.runtime.device import device_problem
from duplexcache.server.app import REALTIME_PATH, create_app
from duplexcache.server.loopback import WS_SIZE_HEADROOM, LoopbackServer

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "stream_wav.py"


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    return parser.parse_args(argv)


def test_no_arguments_means_tiny_preset_on_cpu():
    deploy = cli.load_deploy_config(_parse([]))
    assert deploy == DeployConfig.default("tiny")
    assert deploy.model.preset == "tiny" and deploy.model.device == "cpu"


def test_overrides_and_yaml(tmp_path):
    deploy = cli.load_deploy_config(_parse(["--preset", "minicpmo45", "--checkpoint", "/ckpt", "--host", "::1",
                                            "--port", "9100"]))
    assert (deploy.model.preset, deploy.model.checkpoint_dir) == ("minicpmo45", "/ckpt")
    assert (deploy.server.host, deploy.server.port) == ("::1", 9100)
    custom = DeployConfig.default("tiny")
    custom.server.port = 8123
    path = tmp_path / "deploy.yaml"
    path.write_text(custom.to_yaml())
    assert cli.load_deploy_config(_parse(["--config", str(path)])).server.port == 8123
    with pytest.raises(SystemExit):
        _parse(["--config", str(path), "--preset", "tiny"])


def test_bad_port_and_missing_engine_fail_clearly(monkeypatch, capsys):
    assert top_cli.main(["serve", "--port", "70000"]) == 2
    assert "port" in capsys.readouterr().err
    monkeypatch.setattr(cli, "ENGINE_MODULE", "duplexcache.runtime.no_such_engine")
    assert cli.run(_parse([])) == 2
    err = capsys.readouterr().err
    assert "duplexcache.runtime.no_such_engine is not available" in err


def test_a_port_in_use_fails_before_the_engine_is_built(monkeypatch, capsys):
    """serve used to build the engine (minicpmo45: its weights), start the warm-up, and only then
    find the port taken (uvicorn's error line, exit 3). It binds first now: one line, exit 2."""
    built = []
    monkeypatch.setattr(cli, "build_engine", lambda deploy: built.append(deploy))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert cli.run(_parse(["--port", str(port)])) == 2
    err = capsys.readouterr().err
    assert f"cannot listen on 127.0.0.1:{port}" in err and "in use" in err and "holds the port" in err and not built
    assert cli.run(_parse(["--host", "192.0.2.1", "--port", "0"])) == 2   # TEST-NET-1: no machine has it
    err = capsys.readouterr().err
    assert "cannot listen on 192.0.2.1:0" in err and "check --host" in err and not built


def test_a_wrong_checkpoint_dir_is_one_line(tmp_path, capsys):
    """--checkpoint pointing nowhere, at an empty directory, or at a config.json that is not a
    Qwen3 one: one line naming the path and what is wrong (exit 2), not a traceback; the
    missing directory used to be reported as 'no config.json at /config.json'."""
    missing = tmp_path / "nowhere"
    assert top_cli.main(["serve", "--checkpoint", str(missing), "--port", "0"]) == 2
    assert capsys.readouterr().err.strip() == (f"duplexcache serve: checkpoint: config: no checkpoint at {missing} "
                                               "(no such file or directory)")
    empty = tmp_path / "empty"
    empty.mkdir()
    assert top_cli.main(["serve", "--checkpoint", str(empty), "--port", "0"]) == 2
    assert f"no config.json at {empty / 'config.json'}" in capsys.readouterr().err
    (empty / "config.json").write_text("{}")
    assert top_cli.main(["serve", "--checkpoint", str(empty), "--port", "0"]) == 2
    assert f"thinker config: {empty}: Qwen3 config lacks" in capsys.readouterr().err


@pytest.mark.parametrize("case", ["too_small", "more_than_free"])
def test_a_memory_budget_the_machine_cannot_hold_is_one_line(tmp_path, monkeypatch, capsys, case):
    """engine.memory_budget too small for one session, or more than the device has free: found when
    the real engine starts; one line naming the numbers (exit 2), not a traceback."""
    from duplexcache.runtime.memory import memory_budget

    path = tmp_path / "deploy.yaml"
    path.write_text("engine:\n  memory_budget: 75MiB\n" if case == "too_small" else "engine:\n  memory_budget: 2GiB\n")
    if case == "more_than_free":
        monkeypatch.setattr(memory_budget, "device_free_bytes", lambda device: 2**30)
    served = []
    monkeypatch.setattr(uvicorn.Server, "run", lambda server, sockets=None: served.append(server))
    assert top_cli.main(["serve", "--config", str(path), "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("duplexcache serve: ") and not served
    if case == "too_small":
        assert "cannot hold one session" in err and "(engine.memory_budget 75MiB - engine.activation_reserve" in err
    else:
        assert "engine.memory_budget 2147483648 bytes exceeds the" in err


def test_a_talker_turn_the_tiny_talker_cannot_hold_is_one_line(tmp_path, monkeypatch, capsys):
    """The capacity example's 1024-token Talker turns on the tiny preset (max 512 positions), as a
    newcomer tried it: one line naming the key and the bounds (exit 2), not a ValueError traceback."""
    path = tmp_path / "deploy.yaml"
    path.write_text("engine:\n  talker_turn_tokens: 1024\n")
    served = []
    monkeypatch.setattr(uvicorn.Server, "run", lambda server, sockets=None: served.append(server))
    assert top_cli.main(["serve", "--config", str(path), "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and not served
    assert err.startswith("duplexcache serve: engine.talker_turn_tokens must be between 46") and "got 1024" in err


def test_a_cuda_config_without_cuda_fails_clearly(monkeypatch, capsys):
    """examples/minicpmo45-shared.yaml (model.device cuda) on a CPU machine: one line and exit 2,
    not torch's traceback from deep in model building."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    built = []
    monkeypatch.setattr(cli, "build_engine", lambda deploy: built.append(deploy))
    assert cli.run(_parse(["--device", "cuda", "--port", "0"])) == 2
    assert "device 'cuda' asked for, but this torch" in capsys.readouterr().err and not built
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert "only 1 CUDA device(s)" in device_problem("cuda:1")
    assert device_problem("cuda:0") is None and device_problem("cpu") is None


def test_voice_aliases_to_a_voice_the_engine_lacks_fail_at_start(tmp_path, monkeypatch, capsys):
    """server.voice_aliases is checked against the built engine's voices: one line, exit 2, the
    engine shut down, uvicorn never started."""
    path = tmp_path / "deploy.yaml"
    path.write_text("server:\n  voice_aliases: {alloy: default, verse: nope}\n")
    engines, served = [], []

    def fake_build(deploy):
        engine = FakeEngine(deploy)
        engine.voices = types.SimpleNamespace(names=lambda: ["default", "alt"])
        engines.append(engine)
        return engine

    monkeypatch.setattr(cli, "build_engine", fake_build)
    monkeypatch.setattr(uvicorn.Server, "run", lambda server, sockets=None: served.append(server))
    assert top_cli.main(["serve", "--config", str(path), "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "server.voice_aliases maps to voices this engine does not have: nope" in err
    assert "(it has: alt, default)" in err and not served and engines[0].shutdown_called
    path.write_text("server:\n  voice_aliases: {alloy: default, verse: alt}\n")
    assert top_cli.main(["serve", "--config", str(path), "--port", "0"]) == 0 and len(served) == 1


def test_run_builds_the_engine_and_serves_it(monkeypatch):
    seen = {}

    def fake_build(deploy):
        seen["deploy"] = deploy
        return FakeEngine(deploy)

    def fake_serve(server, sockets=None):  # stands in for uvicorn.Server.run
        seen["config"], seen["sockets"] = server.config, sockets
        seen["bound"] = [s.getsockname() for s in sockets]

    monkeypatch.setattr(cli, "build_engine", fake_build)
    monkeypatch.setattr(uvicorn.Server, "run", fake_serve)
    assert cli.run(_parse(["--port", "0"])) == 0
    config, deploy = seen["config"], seen["deploy"]
    # uvicorn serves on the socket serve bound before building: port 0 became a free port
    [(host, port)] = seen["bound"]
    assert host == "127.0.0.1" and port > 0 and (config.host, config.port) == (host, port)
    assert seen["sockets"][0].fileno() == -1   # closed once serving ended
    assert config.ws_max_size == deploy.server.max_frame_bytes + WS_SIZE_HEADROOM
    assert REALTIME_PATH in {route.path for route in config.app.routes}


def test_ctrl_c_ends_serve_without_a_traceback(monkeypatch):
    """uvicorn re-raises Ctrl-C after its graceful shutdown; serve exits with SIGINT's status."""
    def interrupted(server, sockets=None):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "build_engine", FakeEngine)
    monkeypatch.setattr(uvicorn.Server, "run", interrupted)
    try:
        status = cli.run(_parse(["--port", "0"]))
    except KeyboardInterrupt:
        pytest.fail("the interrupt escaped serve (a traceback for Ctrl-C)")
    assert status == 130


def test_sigint_stops_a_real_serve_quietly():
    """The real process: tiny on CPU, /health 200, then SIGINT. It shuts down (log line), exits 130
    and prints no traceback (it printed asyncio's KeyboardInterrupt traceback before)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "duplexcache.cli", "serve", "--port", str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as reply:
                    if reply.status == 200:
                        break
            except OSError:
                time.sleep(0.5)
        else:
            pytest.fail("serve was not healthy within 120 s")
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert "server stopped" in out, out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    assert proc.returncode == 130


@pytest.mark.parametrize("shared", [False, True])
def test_serve_logs_the_switches_that_are_on(tmp_path, monkeypatch, caplog, shared):
    deploy = DeployConfig.default("tiny")
    deploy.stage0.shared_anchor_blocks = shared
    deploy.code2wav.cfm_prompt_att_sharing = shared
    path = tmp_path / "deploy.yaml"
    path.write_text(deploy.to_yaml())
    monkeypatch.setattr(cli, "build_engine", FakeEngine)
    monkeypatch.setattr(uvicorn.Server, "run", lambda server, sockets=None: None)
    caplog.set_level(logging.INFO, logger=cli.__name__)
    assert cli.run(_parse(["--config", str(path), "--port", "0"])) == 0
    if shared:
        assert "sharing switches on: stage0.shared_anchor_blocks, code2wav.cfm_prompt_att_sharing;" in caplog.text
        assert "nothing is shared" not in caplog.text
    else:
        assert "sharing switches on: none (the unshared baseline)" in caplog.text
        assert "nothing is shared between sessions" in caplog.text
    assert "weights: random (no model.checkpoint_dir: text and audio are noise)" in caplog.text
    # where to point a client and where the page is (a newcomer found only the ws:// address)
    assert re.search(r"on ws://127\.0\.0\.1:\d+/v1/realtime; the browser page at http://127\.0\.0\.1:\d+/",
                     caplog.text), caplog.text


def _load_example():
    spec = importlib.util.spec_from_file_location("stream_wav_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve string annotations through sys.modules
    spec.loader.exec_module(module)
    return module


def _write_wav(path: Path, samples: np.ndarray, rate: int) -> None:
    with wave.open(str(path), "wb") as wav:
        wav.setnchannels(1)
        wav.setsampwidth(2)
        wav.setframerate(rate)
        wav.writeframes(samples.astype("<i2").tobytes())


def test_example_client_streams_a_wav_and_writes_the_reply(tmp_path):
    example = _load_example()
    deploy = DeployConfig.default("tiny")
    deploy.engine.tick_seconds = 0.05
    engine = FakeEngine(deploy, done_after_units=1)   # every unit is a whole reply
    inp = tmp_path / "in.wav"
    _write_wav(inp, np.random.default_rng(0).integers(-3000, 3000, 2 * 16000 + 500), 16000)
    with LoopbackServer(create_app(engine, deploy)) as srv:
        url = srv.ws_url(REALTIME_PATH)
        rc_tone = example.main(["--url", url, "--out", str(tmp_path / "tone.wav"), "--tone-seconds", "3",
                                "--fast", "--responses", "3"])
        rc_wav = example.main(["--url", url, "--in", str(inp), "--out", str(tmp_path / "reply.wav"),
                               "--chunk-ms", "40", "--fast", "--responses", "2"])
    assert rc_tone == rc_wav == 0
    for name, units in (("tone.wav", 3), ("reply.wav", 2)):  # one unit per whole second sent
        with wave.open(str(tmp_path / name), "rb") as wav:
            assert (wav.getframerate(), wav.getnchannels(), wav.getsampwidth()) == (24000, 1, 2)
            pcm = np.frombuffer(wav.readframes(wav.getnframes()), "<i2")
        assert np.array_equal(pcm, np.repeat(np.arange(1, units + 1, dtype=np.int16), 24000))
    assert engine.live == {} and len(engine.closed) == 2
    sent = np.concatenate(engine.received[engine.closed[1]])  # the WAV client's session (wire id)
    with wave.open(str(inp), "rb") as wav:
        ref = np.frombuffer(wav.readframes(wav.getnframes()), "<i2").astype(np.float32) / 32768.0
    assert np.array_equal(sent, ref)


class _StalledEngine(FakeEngine):
    """Ticks that never run a unit: the server is up, the reply never comes."""

    def tick(self, unit_tick: bool = True):
        with self._lock:
            self.ticks += 1
        return []


class _LateEngine(FakeEngine):
    """Every tick overruns its period, so the server counts it late; units run normally."""

    def __init__(self, deploy):
        super().__init__(deploy, done_after_units=1, tick_delay=2 * deploy.engine.tick_seconds)


class _GapEngine(FakeEngine):
    """One tick (the first to run a unit) holds its output back ``gap`` seconds."""

    def __init__(self, deploy, gap: float):
        super().__init__(deploy, done_after_units=1)
        self.gap = gap

    def tick(self, unit_tick: bool = True):
        events = super().tick(unit_tick=unit_tick)
        if events and self.gap:
            time.sleep(self.gap)
            self.gap = 0.0
        return events


def test_example_client_waits_for_the_reply_across_slow_ticks(tmp_path):
    """A 2.5 s silence before the first reply (longer than the old client's 2 s idle timer), then
    3 replies: the client waits for the events, not for a quiet spell."""
    example = _load_example()
    deploy = DeployConfig.default("tiny")
    deploy.engine.tick_seconds = 0.05
    with LoopbackServer(create_app(_GapEngine(deploy, gap=2.5), deploy)) as srv:
        rc = example.main(["--url", srv.ws_url(REALTIME_PATH), "--out", str(tmp_path / "r.wav"),
                           "--tone-seconds", "3", "--fast", "--responses", "3"])
    assert rc == 0
    with wave.open(str(tmp_path / "r.wav"), "rb") as wav:
        assert wav.getnframes() == 3 * 24000


@pytest.mark.parametrize("engine_cls, why", [
    # a stalled engine's ticks are quick, but on a loaded machine the server may still see one late
    (_StalledEngine, r"the server (ran \d+ ticks .* without finishing the reply|is overloaded:|has run no tick)"),
    (_LateEngine, r"the server is overloaded: \d+ of \d+ ticks ran late"),  # every tick overruns: always late
])
def test_example_client_fails_when_no_reply_comes(tmp_path, capsys, engine_cls, why):
    """No reply by the deadline: exit 1, no WAV, and the server's /metrics figures say why."""
    example = _load_example()
    deploy = DeployConfig.default("tiny")
    deploy.engine.tick_seconds = 0.05
    with LoopbackServer(create_app(engine_cls(deploy), deploy)) as srv:
        # 4 replies wanted, 2 s of audio sent: at most 2 can come, so the deadline must pass
        rc = example.main(["--url", srv.ws_url(REALTIME_PATH), "--out", str(tmp_path / "r.wav"),
                           "--tone-seconds", "2", "--fast", "--responses", "4", "--timeout", "1.5"])
    assert rc == 1
    err = capsys.readouterr().err
    assert "FAILED: no complete reply:" in err and "within --timeout 1.5 s" in err and re.search(why, err), err
    assert not (tmp_path / "r.wav").exists()


def test_example_fails_when_the_reply_has_no_audio(tmp_path, capsys, monkeypatch):
    example = _load_example()

    async def silent(url, samples, **kw):
        reply = example.Reply()
        reply.responses = 1
        return reply

    monkeypatch.setattr(example, "stream", silent)
    assert example.main(["--out", str(tmp_path / "r.wav")]) == 1
    assert "FAILED: no audio came back" in capsys.readouterr().err


def test_metrics_url_follows_the_websocket_url():
    example = _load_example()
    assert example.metrics_url("ws://127.0.0.1:8000/v1/realtime") == "http://127.0.0.1:8000/metrics"
    assert example.metrics_url("wss://h.example:443/v1/realtime?x=1") == "https://h.example:443/metrics"


def test_example_refuses_a_wav_it_cannot_stream(tmp_path):
    example = _load_example()
    path = tmp_path / "cd.wav"
    _write_wav(path, np.zeros(100, np.int16), 44100)
    with pytest.raises(ValueError, match="need 16 kHz mono"):
        example.read_wav_16k(str(path))


def test_example_fails_clearly_when_nothing_listens(capsys):
    with socket.socket() as probe:   # a port nothing listens on once closed
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    example = _load_example()
    assert example.main(["--url", f"ws://127.0.0.1:{port}/v1/realtime", "--tone-seconds", "0.2", "--fast"]) == 1
    assert f"FAILED: cannot connect to ws://127.0.0.1:{port}/v1/realtime" in capsys.readouterr().err


def test_example_fails_clearly_when_the_handshake_is_refused(tmp_path, capsys):
    deploy = DeployConfig.default("tiny")
    deploy.server.api_key = "sekrit"
    with LoopbackServer(create_app(FakeEngine(deploy), deploy)) as srv:
        url = srv.ws_url(REALTIME_PATH)
        assert _load_example().main(["--url", url, "--tone-seconds", "0.2", "--fast",
                                     "--out", str(tmp_path / "r.wav")]) == 1
    err = capsys.readouterr().err
    assert f"FAILED: the server at {url} refused the connection" in err and "401" in err
    assert "(Missing or incorrect API key" in err   # the server's words from the refusal's body


def test_a_websocket_to_a_wrong_path_is_a_404_naming_the_right_one(tmp_path, capsys):
    """Starlette answered a WebSocket to an unknown path with a bare 403 ('forbidden'), which sent
    users looking for a key problem; the server now says 404 and where the API is."""
    deploy = DeployConfig.default("tiny")
    with LoopbackServer(create_app(FakeEngine(deploy), deploy)) as srv:
        url = srv.ws_url("/v1/realtim")
        assert _load_example().main(["--url", url, "--tone-seconds", "0.2", "--fast",
                                     "--out", str(tmp_path / "r.wav")]) == 1
        with urllib.request.urlopen(srv.http_url("/health")) as reply:   # HTTP routes are unaffected
            assert reply.status == 200
    err = capsys.readouterr().err
    assert "HTTP 404" in err and f"No WebSocket endpoint at /v1/realtim; the realtime API is at {REALTIME_PATH}" in err


def test_example_sends_the_key_from_the_environment(tmp_path, monkeypatch):
    deploy = DeployConfig.default("tiny")
    deploy.server.api_key = "sekrit"
    deploy.engine.tick_seconds = 0.05
    monkeypatch.setenv("DUPLEXCACHE_API_KEY", "sekrit")
    with LoopbackServer(create_app(FakeEngine(deploy, done_after_units=1), deploy)) as srv:
        example = _load_example()
        assert example.main(["--url", srv.ws_url(REALTIME_PATH), "--tone-seconds", "1", "--fast",
                             "--timeout", "30", "--out", str(tmp_path / "r.wav")]) == 0
        assert "could not read" not in example.server_load(srv.ws_url(REALTIME_PATH))   # /metrics, behind the key


def test_serve_sets_the_allocator_conf_before_cuda_starts(monkeypatch):
    """`serve` on a CUDA deploy sets PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True before the
    device check and the engine build (here the device check fails: no CUDA)."""
    import torch

    monkeypatch.delenv(cli.ALLOC_CONF, raising=False)
    seen = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: seen.append(cli.os.environ.get(cli.ALLOC_CONF)) or False)
    monkeypatch.setattr(cli, "build_engine", lambda deploy: pytest.fail("no engine without CUDA"))
    assert cli.run(_parse(["--device", "cuda", "--port", "0"])) == 2
    assert seen and seen[0] == cli.EXPANDABLE
    monkeypatch.delenv(cli.ALLOC_CONF, raising=False)


def test_example_keeps_only_the_replies_it_waits_for():
    """A newcomer saw '2 response(s)' with --responses 1: the server's next reply can finish before
    our session.close is read. Only the wanted replies are counted and written."""
    import base64

    example = _load_example()
    reply = example.Reply(wanted=1)
    pcm = base64.b64encode(b"\x01\x00" * 4).decode()
    for event in ({"type": example.AUDIO_DELTA, "delta": pcm}, {"type": example.REPLY_DONE},
                  {"type": example.AUDIO_DELTA, "delta": pcm}, {"type": example.REPLY_DONE}):
        example._take(reply, event)
    assert reply.responses == 1 and len(reply.audio) == 8
