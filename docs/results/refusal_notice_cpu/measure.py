"""A refused client streaming 20 ms chunks at real-time pace for 5 s beside one live session (a real tiny server
whose memory budget holds one session): the error events it receives. CODE=<checkout> picks the code; argv[1] the
memory budget (172MiB holds one tiny session). Run from a checkout with .venv: CODE=$PWD .venv/bin/python measure.py 172MiB"""
import asyncio, base64, json, subprocess, sys, time, os, socket
import numpy as np, websockets, httpx

budget = sys.argv[1]
cfg = f"/tmp/c_{budget}.yaml"
import yaml
d = yaml.safe_load(open(os.path.join(os.environ["CODE"], "duplexcache/configs/tiny.yaml")))
d["engine"]["memory_budget"] = budget; d["engine"]["tick_headroom"] = 1.0e9
yaml.safe_dump(d, open(cfg, "w"))
s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
proc = subprocess.Popen([sys.executable, "-m", "duplexcache.cli", "-v", "serve", "--config", cfg, "--port", str(port)],
                        cwd=os.environ["CODE"], env={**os.environ, "PYTHONPATH": os.environ["CODE"]}, stdout=subprocess.DEVNULL, stderr=open("/tmp/serve.log", "w"))
try:
    for _ in range(600):
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200: break
        except Exception: pass
        time.sleep(0.5)
    chunk = base64.b64encode(np.zeros(320, np.int16).tobytes()).decode()   # 20 ms at 16 kHz
    async def client(name, seconds):
        counts = {}
        async with websockets.connect(f"ws://127.0.0.1:{port}/v1/realtime", max_size=None) as ws:
            await ws.recv()
            await ws.send(json.dumps({"type": "session.update", "session": {"instructions": name}}))
            async def reader():
                async for m in ws:
                    d = json.loads(m); t = d["type"]; counts[t] = counts.get(t, 0) + 1

            r = asyncio.create_task(reader())
            t0 = time.monotonic()
            n = 0
            while time.monotonic() - t0 < seconds:
                await ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": chunk})); n += 1
                await asyncio.sleep(0.02)
            await asyncio.sleep(0.5); r.cancel()
        return n, counts
    async def main():
        a = asyncio.create_task(client("a", 7))
        await asyncio.sleep(1.5)
        n, counts = await client("b", 5)
        await a
        return n, counts
    n, counts = asyncio.run(main())
    print(json.dumps({"appends": n, "errors": counts.get("error", 0), "events": counts}))
finally:
    proc.terminate(); proc.wait()
