"""``duplexcache serve``: load the deploy config, build the engine, serve the realtime API.

With no arguments it serves the tiny preset (random weights, CPU) on the configured host/port.
"""

from __future__ import annotations

import argparse
import errno
import importlib
import importlib.util
import logging
import os
import socket
import sys
from collections.abc import MutableMapping

from duplexcache.config import PRESETS, ConfigError, DeployConfig
from duplexcache.runtime.device import device_problem
from duplexcache.runtime.switches import SHARING_SWITCHES, describe_switches, switch_value

logger = logging.getLogger(__name__)

ENGINE_MODULE = "duplexcache.runtime.engine"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--config", metavar="YAML", help="deploy config file (default: the preset's defaults)")
    source.add_argument("--preset", choices=PRESETS, help="built-in preset (default: tiny)")
    parser.add_argument("--checkpoint", metavar="DIR", help="checkpoint directory (default: random weights)")
    parser.add_argument("--host", help="bind address (overrides server.host)")
    parser.add_argument("--port", type=int, help="port (overrides server.port; 0 picks a free one)")
    parser.add_argument("--api-key", help="require this client key (overrides server.api_key and "
                        "DUPLEXCACHE_API_KEY; prefer the environment variable, which ps cannot show)")
    parser.add_argument("--allowed-origins", metavar="ORIGIN[,ORIGIN...]",
                        help="browser Origins accepted besides the server's own (overrides server.allowed_origins; "
                        "'*' = any)")
    parser.add_argument("--device", help="model device (overrides model.device, e.g. cpu)")
    parser.add_argument("--replicas", type=int, metavar="N",
                        help="serve N engines behind Ray Serve (overrides cluster.replicas; needs "
                        "pip install duplexcache[cluster]; docs/deploy.md). Without it: one engine, no Ray")
    parser.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"),
                        help="uvicorn log level")


def load_deploy_config(args: argparse.Namespace) -> DeployConfig:
    """The DeployConfig the command line names, with its overrides applied (ConfigError if bad)."""
    deploy = DeployConfig.from_yaml(args.config) if args.config else DeployConfig.default(args.preset or "tiny")
    try:
        # validate_assignment=True: a bad override raises a pydantic error naming the field
        if args.checkpoint is not None:
            deploy.model.checkpoint_dir = args.checkpoint
        if args.host is not None:
            deploy.server.host = args.host
        if args.port is not None:
            deploy.server.port = args.port
        if getattr(args, "api_key", None) is not None:
            deploy.server.api_key = args.api_key
        if getattr(args, "device", None) is not None:
            deploy.model.device = args.device
        if getattr(args, "replicas", None) is not None:
            deploy.cluster.replicas = args.replicas
        if getattr(args, "allowed_origins", None) is not None:
            deploy.server.allowed_origins = [o.strip() for o in args.allowed_origins.split(",") if o.strip()]
    except ValueError as exc:
        raise ConfigError(f"bad command-line override: {exc}") from None
    return deploy


def build_engine(deploy: DeployConfig):  # -> EngineAPI
    """Import the real engine lazily; RuntimeError with a clear message if it is not there."""
    try:
        module = importlib.import_module(ENGINE_MODULE)
    except ModuleNotFoundError as exc:
        if exc.name != ENGINE_MODULE:
            raise  # the engine exists but one of its own dependencies is missing: show that
        raise RuntimeError(f"{ENGINE_MODULE} is not available in this build, so there is no engine to serve "
                           "(the server itself is ready: see duplexcache.runtime.engine_api)") from None
    factory = getattr(module, "build_engine", None)
    if factory is None:
        raise RuntimeError(f"{ENGINE_MODULE} has no build_engine(deploy) function")
    return factory(deploy)


ALLOC_CONF = "PYTORCH_CUDA_ALLOC_CONF"
EXPANDABLE = "expandable_segments:True"


def configure_cuda_allocator(deploy: DeployConfig, environ: MutableMapping[str, str] | None = None) -> str | None:
    """On a CUDA deploy, set ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` before anything
    initialises CUDA (the caching allocator reads it once, at its first allocation), so memory
    freed after the warm-up goes back in pages rather than staying cached in whole segments: the
    allocator slack of the card waterfall (issue 43: 12 GiB -> 0-18 MiB on an H100). A value the
    environment already sets wins (the operator's, e.g. ``expandable_segments:False``). Always on
    since issue 44 retired ``engine.cuda_expandable_segments``. Returns what the variable is now."""
    env = os.environ if environ is None else environ
    if deploy.model.device.startswith("cuda"):
        if ALLOC_CONF in env:
            logger.info("%s=%s from the environment; serve leaves it", ALLOC_CONF, env[ALLOC_CONF])
        else:
            env[ALLOC_CONF] = EXPANDABLE
            logger.info("%s=%s (freed memory goes back in pages)", ALLOC_CONF, EXPANDABLE)
    return env.get(ALLOC_CONF)


def bind_server_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` (0: a free port), not yet listening: uvicorn listens on
    it once the engine is built (``Server.run(sockets=...)``). Binding first makes a taken port
    the first thing serve reports, not what it finds after building minicpmo45's weights; and
    until uvicorn listens, a client that connects is refused rather than left waiting in the
    backlog. Options as asyncio's ``create_server`` would set them (address reuse; IPv6 only)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


def run(args: argparse.Namespace) -> int:
    try:
        deploy = load_deploy_config(args)
    except (ConfigError, OSError) as exc:
        print(f"duplexcache serve: {exc}", file=sys.stderr)
        return 2
    if getattr(args, "replicas", None) is not None:
        if importlib.util.find_spec("ray") is None:
            print("duplexcache serve --replicas: ray is not installed; pip install 'duplexcache[cluster]' "
                  "(or leave --replicas out to serve one engine without Ray)", file=sys.stderr)
            return 2
        from duplexcache.cluster.launch import serve_replicas

        # No device_problem() here: the replicas are placed by Ray on its GPU nodes, and the
        # machine that launches them may well have no GPU of its own.

        return serve_replicas(deploy)
    configure_cuda_allocator(deploy)   # before anything initialises CUDA (device_problem, the engine)
    problem = device_problem(deploy.model.device)
    if problem is not None:
        print(f"duplexcache serve: {problem}", file=sys.stderr)
        return 2
    host = deploy.server.host
    try:
        sock = bind_server_socket(host, deploy.server.port)
    except OSError as exc:
        hint = ("another process holds the port: pick one with --port or server.port"
                if exc.errno == errno.EADDRINUSE else "check --host or server.host: an address of this machine")
        print(f"duplexcache serve: cannot listen on {host}:{deploy.server.port}: {exc.strerror or exc} ({hint})",
              file=sys.stderr)
        return 2
    with sock:
        return _serve_on(sock, deploy, args)


def _serve_on(sock: socket.socket, deploy: DeployConfig, args: argparse.Namespace) -> int:
    # A checkpoint that does not load (CheckpointError) is reported by duplexcache.cli.main, in
    # one line for every command.
    try:
        engine = build_engine(deploy)
    except RuntimeError as exc:
        print(f"duplexcache serve: {exc}", file=sys.stderr)
        return 2

    import uvicorn

    from duplexcache.server.app import REALTIME_PATH, create_app
    from duplexcache.server.loopback import uvicorn_config

    try:
        app = create_app(engine, deploy)
    except ConfigError as exc:   # what only the built engine can check (server.voice_aliases)
        engine.shutdown()
        print(f"duplexcache serve: {exc}", file=sys.stderr)
        return 2
    host, port = deploy.server.host, sock.getsockname()[1]   # port 0 was bound to a free one
    shown = f"[{host}]" if ":" in host else host
    logger.info("serving preset %s on ws://%s:%d%s; the browser page at http://%s:%d/", deploy.model.preset,
                shown, port, REALTIME_PATH, shown, port)
    logger.info("weights: %s",
                deploy.model.checkpoint_dir or "random (no model.checkpoint_dir: text and audio are noise)")
    logger.info("%s", describe_switches(deploy))
    if not any(switch_value(deploy, name) for name in SHARING_SWITCHES):
        logger.info("nothing is shared between sessions; turn the sharing switches on in a --config YAML "
                    "(README, Configuration)")
    if deploy.server.api_key is None and host not in ("127.0.0.1", "::1", "localhost"):
        logger.warning("listening on %s without an API key: anyone who can reach it may open sessions "
                       "(set DUPLEXCACHE_API_KEY or --api-key)", host)
    try:
        uvicorn.Server(uvicorn_config(app, host, port, deploy.server.max_frame_bytes, args.log_level,
                                      server=deploy.server)).run(
            sockets=[sock])
    except KeyboardInterrupt:
        # Ctrl-C: uvicorn has already shut the app down (sessions closed, engine stopped) and then
        # re-raises the interrupt so the exit status says how the process ended; that is not an
        # error, so no traceback, and the shell's status for SIGINT.
        logger.info("stopped by SIGINT")
        return 130
    return 0
