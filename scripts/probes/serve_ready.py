"""Time `duplexcache serve` from launch to /health 200 and print its warm-up metrics.

    python3 scripts/probes/serve_ready.py --config examples/minicpmo45-shared.yaml [--port 8765] [--timeout 420]

Prints the seconds to the first "warming" answer (listening) and to "ok" (warm), then the
duplexcache_graph_captures_total and duplexcache_warmup_seconds lines of /metrics, then stops
the server (SIGTERM: its graceful shutdown). Exit 1 when it never became ready.
"""
import argparse
import json
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

p = argparse.ArgumentParser()
p.add_argument("--config", required=True)
p.add_argument("--port", type=int, default=8765)
p.add_argument("--timeout", type=float, default=420)
a = p.parse_args()
base = f"http://127.0.0.1:{a.port}"
direct = urllib.request.build_opener(urllib.request.ProxyHandler({}))
t0 = time.perf_counter()
server = subprocess.Popen([sys.executable, "-m", "duplexcache.cli", "serve", "--config", a.config,
                           "--host", "127.0.0.1", "--port", str(a.port)])
listening = ready = None
try:
    while ready is None and time.perf_counter() - t0 < a.timeout and server.poll() is None:
        try:
            with direct.open(base + "/health", timeout=5):
                ready = time.perf_counter() - t0
        except urllib.error.HTTPError as exc:
            listening = listening or time.perf_counter() - t0
            body = json.loads(exc.read() or b"{}")
            if body.get("status") == "warmup_failed":
                print("warm-up failed:", body.get("error"))
                break
        except OSError:
            pass
        time.sleep(0.2)
    print(f"listening after {listening if listening is None else round(listening, 1)} s, "
          f"ready after {ready if ready is None else round(ready, 1)} s")
    if ready is not None:
        with direct.open(base + "/metrics", timeout=10) as resp:
            for line in resp.read().decode().splitlines():
                if line.startswith(("duplexcache_graph_captures_total", "duplexcache_warmup_seconds")):
                    print(line)
finally:
    if server.poll() is None:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            server.kill()
sys.exit(0 if ready is not None else 1)
