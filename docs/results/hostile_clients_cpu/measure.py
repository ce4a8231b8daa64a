"""Issue 48: a well-behaved caller streaming 20 s of audio in real time beside each hostile client,
through a real tiny server (`duplexcache serve`, CPU, its own process). For each attack: the
caller's reply audio (s), the largest gap between its audio deltas (s), its server_behind errors,
and the server's RSS before / after; plus what the attack itself got.

    CODE=<checkout> python measure.py [attack ...]     # attacks: none big_instructions
                                                       # outbox_flood deep_json xff half_sent

CODE picks the code to serve (default: this checkout); output is one JSON line per attack.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import socket
import subprocess
import sys
import time

import httpx
import numpy as np
import websockets
import yaml

HERE = os.path.dirname(os.path.abspath(__file__))
CODE = os.environ.get("CODE", os.path.abspath(os.path.join(HERE, "..", "..", "..")))
STREAM_S = 20
TAIL_S = 3.0       # the caller keeps listening this long after its last chunk


def start_server() -> tuple[subprocess.Popen, int]:
    config = yaml.safe_load(open(os.path.join(CODE, "duplexcache/configs/tiny.yaml")))
    config["engine"]["tick_headroom"] = 1.0e9      # admit by memory only, as the run did
    config["server"]["idle_timeout_s"] = 20.0
    path = f"/tmp/hostile_{os.getpid()}.yaml"
    yaml.safe_dump(config, open(path, "w"))
    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()
    proc = subprocess.Popen([sys.executable, "-m", "duplexcache.cli", "serve", "--config", path, "--port", str(port)],
                            cwd=CODE, env={**os.environ, "PYTHONPATH": CODE}, stdout=subprocess.DEVNULL,
                            stderr=open(f"/tmp/hostile_serve_{port}.log", "w"))
    for _ in range(600):
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                return proc, port
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError("server did not start")


def rss_mb(proc: subprocess.Popen) -> float:
    with open(f"/proc/{proc.pid}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


async def bystander(port: int) -> dict:
    rng = np.random.default_rng(0)
    t = np.arange(STREAM_S * 16000) / 16000
    pcm = ((0.2 * np.sin(2 * np.pi * 180 * t) + rng.normal(0, 0.02, t.size)).clip(-1, 1) * 32767).astype(np.int16)
    audio = 0
    behind = 0
    errors: dict[str, int] = {}
    arrivals: list[float] = []
    async with websockets.connect(f"ws://127.0.0.1:{port}/v1/realtime", max_size=None, open_timeout=60) as ws:
        await ws.recv()

        async def reader() -> None:
            nonlocal audio, behind
            async for message in ws:
                event = json.loads(message)
                if event["type"] == "response.output_audio.delta":
                    audio += len(base64.b64decode(event["delta"])) // 2
                    arrivals.append(time.monotonic())
                elif event["type"] == "error":
                    code = event["error"]["code"]
                    errors[code] = errors.get(code, 0) + 1

        reading = asyncio.create_task(reader())
        start = time.monotonic()
        for i in range(0, pcm.size, 1600):
            await ws.send(json.dumps({"type": "input_audio_buffer.append",
                                      "audio": base64.b64encode(pcm[i:i + 1600].tobytes()).decode()}))
            await asyncio.sleep(max(0.0, start + (i + 1600) / 16000 - time.monotonic()))
        await asyncio.sleep(TAIL_S)
        reading.cancel()
    gaps = np.diff(arrivals) if len(arrivals) > 1 else np.array([0.0])
    return {"audio_s": round(audio / 24000, 2), "largest_gap_s": round(float(gaps.max()), 2),
            "server_behind": errors.get("server_behind", 0), "errors": errors}


class Raw:
    """A WebSocket client that never reads (4 KiB receive buffer)."""

    def __init__(self, port: int, headers: str = ""):
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        self.sock.settimeout(10)
        self.sock.connect(("127.0.0.1", port))
        key = base64.b64encode(os.urandom(16)).decode()
        self.sock.sendall((f"GET /v1/realtime HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                           f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n{headers}\r\n").encode())
        head = b""
        while b"\r\n\r\n" not in head:
            head += self.sock.recv(1)
        self.status = int(head.split()[1])

    def send(self, event: dict) -> None:
        payload = json.dumps(event).encode()
        n, mask = len(payload), os.urandom(4)
        header = (bytes([0x81, 0x80 | n]) if n < 126 else bytes([0x81, 0xFE]) + n.to_bytes(2, "big") if n < 2**16
                  else bytes([0x81, 0xFF]) + n.to_bytes(8, "big"))
        body = np.frombuffer(payload, np.uint8) ^ np.resize(np.frombuffer(mask, np.uint8), n)
        self.sock.sendall(header + mask + body.tobytes())


def silence_b64(seconds: float) -> str:
    return base64.b64encode(np.zeros(int(seconds * 16000), np.int16).tobytes()).decode()


async def big_instructions(port: int) -> dict:
    """20 fresh connections, 4 at a time, each 3.9 MB of instructions and one append."""
    big = "y" * 3_900_000
    gate = asyncio.Semaphore(4)
    answers: dict[str, int] = {}

    async def one(i: int) -> None:
        async with gate, websockets.connect(f"ws://127.0.0.1:{port}/v1/realtime", max_size=None,
                                            open_timeout=60) as ws:
            await ws.recv()
            await ws.send(json.dumps({"type": "session.update", "session": {"instructions": f"{i} {big}"}}))
            await ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": silence_b64(0.1)}))
            while True:
                event = json.loads(await asyncio.wait_for(ws.recv(), 120))
                if event["type"] == "error":
                    answers[event["error"]["code"]] = answers.get(event["error"]["code"], 0) + 1
                    break

    await asyncio.sleep(2)
    await asyncio.gather(*(one(i) for i in range(20)))
    return {"answers": answers}


async def outbox_flood(port: int) -> dict:
    """250 session.updates with distinct 3.5 MB instructions from a client that never reads."""
    await asyncio.sleep(2)
    big = "u" * 3_500_000

    def flood() -> dict:
        client = Raw(port)
        sent = 0
        try:
            for i in range(250):
                client.send({"type": "session.update", "session": {"instructions": f"{i} {big}"}})
                sent += 1
        except OSError as exc:
            return {"sent": sent, "ended": type(exc).__name__}
        finally:
            time.sleep(2)
            client.sock.close()
        return {"sent": sent, "ended": "no"}

    return await asyncio.to_thread(flood)


async def deep_json(port: int) -> dict:
    """50 session.updates nested ~960 deep, on one connection."""
    await asyncio.sleep(2)
    codes: dict[str, int] = {}
    async with websockets.connect(f"ws://127.0.0.1:{port}/v1/realtime", max_size=None) as ws:
        await ws.recv()
        try:
            for _ in range(50):
                await ws.send('{"type":"session.update","session":{"window":{"a":' + "[" * 960 + "]" * 960 + "}}}")
                event = json.loads(await asyncio.wait_for(ws.recv(), 30))
                key = event["error"]["code"] if event["type"] == "error" else event["type"]
                codes[key] = codes.get(key, 0) + 1
        except websockets.ConnectionClosed as exc:
            codes[f"closed {exc.rcvd.code if exc.rcvd else None}"] = 1
    return {"answers": codes}


async def xff(port: int) -> dict:
    """Connections from 127.0.0.1, each naming a new address in X-Forwarded-For (cap: 16)."""
    await asyncio.sleep(2)
    clients = [Raw(port, f"X-Forwarded-For: 10.1.{i // 250}.{i % 250 + 1}\r\n") for i in range(40)]
    opened = sum(c.status == 101 for c in clients)
    await asyncio.sleep(3)
    for c in clients:
        c.sock.close()
    return {"opened_of_40": opened}


async def half_sent(port: int) -> dict:
    """300 connections that send half a request line and wait; how many are still open after 15 s."""
    await asyncio.sleep(2)
    socks = []
    for _ in range(300):
        s = socket.create_connection(("127.0.0.1", port))
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: ")
        s.setblocking(False)
        socks.append(s)
    await asyncio.sleep(15)
    still_open = 0
    for s in socks:
        try:
            still_open += s.recv(1) != b""
        except BlockingIOError:
            still_open += 1
        except OSError:
            pass
        s.close()
    return {"still_open_after_15s": still_open}


async def nothing(port: int) -> dict:
    return {}


ATTACKS = {"none": nothing, "big_instructions": big_instructions, "outbox_flood": outbox_flood,
           "deep_json": deep_json, "xff": xff, "half_sent": half_sent}


async def run(attack: str, port: int, proc: subprocess.Popen) -> dict:
    before = rss_mb(proc)
    heard, attacked = await asyncio.gather(bystander(port), ATTACKS[attack](port))
    await asyncio.sleep(2)
    return {"attack": attack, **heard, "attack_result": attacked, "rss_mb_before": round(before),
            "rss_mb_after": round(rss_mb(proc))}


def main() -> None:
    attacks = sys.argv[1:] or list(ATTACKS)
    for attack in attacks:
        proc, port = start_server()   # a fresh server per attack: one attack's leftovers do not count for the next
        try:
            print(json.dumps(asyncio.run(run(attack, port, proc))), flush=True)
        finally:
            proc.terminate()
            proc.wait(30)


if __name__ == "__main__":
    main()
