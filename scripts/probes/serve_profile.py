"""Profile a freshly started `duplexcache serve` under the conversation load: who holds the GIL.

    python scripts/probes/serve_profile.py --config duplexcache/configs/tiny.yaml --sessions 16 \
        --duration 60 --out DIR [--rate 50]

Starts the server under ``py-spy record --gil --threads --nonblocking --format raw`` (pip install
py-spy; it samples only the thread holding the GIL), waits for /health 200, runs `duplexcache
bench serve --workload conversation` against it, stops the server with SIGINT, then writes
DIR/gil.txt (py-spy's raw stacks), DIR/gil_summary.json and prints the summary
(scripts/probes/gil_profile.py): the tick thread's share of the GIL, the event loop's, and
what the event loop held it for. The config gets the reply policy and lifted per-address caps,
as scripts/gpu_bench.sh's serve modes do.
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from gil_profile import format_profile, summarize   # its sibling (scripts/probes/)
from duplexcache.config import DeployConfig

logger = logging.getLogger("serve_profile")


def wait_healthy(port: int, server: subprocess.Popen, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.poll() is not None:
            return False
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                if r.status == 200:
                    return True
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(1)
    return False


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", type=Path, required=True)
    p.add_argument("--sessions", type=int, default=16)
    p.add_argument("--duration", type=float, default=60)
    p.add_argument("--rate", type=int, default=50, help="py-spy samples per second")
    p.add_argument("--port", type=int, default=8766)
    p.add_argument("--ready-timeout", type=float, default=240)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    py_spy = shutil.which("py-spy")
    if py_spy is None:
        logger.error("py-spy is not installed (pip install py-spy)")
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    deploy = DeployConfig.from_yaml(args.config)
    deploy.engine.speak_policy.mode = "reply"
    deploy.server.host = "127.0.0.1"
    deploy.server.max_connections_per_client = deploy.server.max_sessions_per_client = 4096
    cfg = args.out / "serve.yaml"
    cfg.write_text(deploy.to_yaml())
    raw = args.out / "gil.txt"
    cmd = [py_spy, "record", "--gil", "--threads", "--nonblocking", "--format", "raw", "--rate", str(args.rate),
           "-o", str(raw), "--", sys.executable, "-m", "duplexcache.cli", "serve", "--config", str(cfg),
           "--port", str(args.port)]
    logger.info("starting: %s", " ".join(cmd))
    with open(args.out / "server.log", "w") as log:
        server = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        started, load_s = time.monotonic(), 0.0
        try:
            if not wait_healthy(args.port, server, args.ready_timeout):
                logger.error("the server did not become healthy; see %s", args.out / "server.log")
                return 1
            serving = time.monotonic()
            bench = [sys.executable, "-m", "duplexcache.cli", "bench", "serve", "--url",
                     f"ws://127.0.0.1:{args.port}/v1/realtime", "--workload", "conversation", "--sessions",
                     str(args.sessions), "--ramp", "5", "--duration", str(args.duration), "--out",
                     str(args.out / "bench_serve")]
            rc = subprocess.call(bench)
            logger.info("bench serve exited %d", rc)
            load_s = time.monotonic() - serving
        finally:
            # py-spy forwards nothing: signal the python child (the server) itself
            for child in _children(server.pid):
                subprocess.call(["kill", "-INT", str(child)])
            try:
                server.wait(timeout=60)
            except subprocess.TimeoutExpired:
                server.send_signal(signal.SIGKILL)
                server.wait()
    if not raw.exists():
        logger.error("py-spy wrote no %s (ptrace not permitted here?); see server.log", raw)
        return 1
    prof = summarize(raw.read_text().splitlines())
    # of_wall is over the whole sampled run (start-up included); the tick and event-loop roles
    # only exist while serving, so their fraction of the load's wall time is printed too.
    summary = {"command": " ".join(sys.argv), "sessions": args.sessions, "rate": args.rate,
               "sampled_s": round(time.monotonic() - started, 1), "load_s": round(load_s, 1),
               **prof.to_json(wall_samples=int(args.rate * (time.monotonic() - started)))}
    (args.out / "gil_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(format_profile(prof))
    for role in ("tick", "event_loop") if load_s > 0 else ():
        print(f"{role} held the GIL {prof.by_role[role] / (args.rate * load_s):.1%} of the load's wall time")
    return 0


def _children(pid: int) -> list[int]:
    try:
        out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    except FileNotFoundError:
        return []
    return [int(x) for x in out.split()]


if __name__ == "__main__":
    sys.exit(main())
