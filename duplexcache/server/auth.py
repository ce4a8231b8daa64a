"""Who may open a realtime WebSocket: API key, browser Origin, and per-address connection caps.

A key is taken from ``Authorization: Bearer <key>`` (servers, SDKs) or from the
``openai-insecure-api-key.<key>`` WebSocket subprotocol (browsers cannot set headers), as
OpenAI's Realtime API does; the server then echoes the ``realtime`` subprotocol if offered.
Refusals are HTTP responses with OpenAI's JSON error body (401 bad key, 403 origin, 429 too many
connections), sent as a WebSocket denial response.
"""

from __future__ import annotations

import functools
import hmac
import ipaddress
from dataclasses import dataclass
from typing import Mapping, Sequence
from urllib.parse import urlsplit

from duplexcache.config import ServerConfig
from duplexcache.server.protocol import INVALID_REQUEST

KEY_SUBPROTOCOL_PREFIX = "openai-insecure-api-key."
REALTIME_SUBPROTOCOL = "realtime"
BETA_SUBPROTOCOL = "openai-beta.realtime-v1"
BETA_HEADER = "openai-beta"
MINICPMO_SUBPROTOCOL = "map.realtime"   # OpenBMB's MiniCPM-o Realtime SDK (server/minicpmo_protocol.py)


@dataclass(frozen=True)
class Refusal:
    status: int
    code: str
    message: str
    error_type: str = INVALID_REQUEST


@dataclass(frozen=True)
class Handshake:
    """What the handshake says about the client."""

    subprotocol: str | None  # to echo back on accept
    beta: bool               # speaks the beta dialect (OpenAI-Beta header or subprotocol)
    openai_client: bool      # identified itself as an OpenAI client (24 kHz defaults)
    dialect: str = "openai"  # "openai" or "minicpmo": which wire protocol the session speaks


def offered_subprotocols(headers: Mapping[str, str]) -> list[str]:
    raw = headers.get("sec-websocket-protocol", "")
    return [p.strip() for p in raw.split(",") if p.strip()]


def presented_key(headers: Mapping[str, str], subprotocols: Sequence[str]) -> str | None:
    auth = headers.get("authorization", "")
    if auth[:7].lower() == "bearer ":
        return auth[7:].strip()
    for proto in subprotocols:
        if proto.startswith(KEY_SUBPROTOCOL_PREFIX):
            return proto[len(KEY_SUBPROTOCOL_PREFIX):]
    return None


def key_matches(expected: str, presented: str | None) -> bool:
    if presented is None:
        return False
    return hmac.compare_digest(expected.encode("utf-8"), presented.encode("utf-8"))


def origin_allowed(origin: str | None, host: str | None, allowed: Sequence[str]) -> bool:
    """No Origin (not a browser), the server's own host:port, or a listed origin ("*" = any)."""
    if origin is None or "*" in allowed:
        return True
    if origin.rstrip("/") in {a.rstrip("/") for a in allowed}:
        return True
    return host is not None and urlsplit(origin).netloc.lower() == host.lower()


def check_handshake(config: ServerConfig, headers: Mapping[str, str], query: Mapping[str, str]) -> Handshake | Refusal:
    subprotocols = offered_subprotocols(headers)
    if config.api_key is not None and not key_matches(config.api_key, presented_key(headers, subprotocols)):
        return Refusal(401, "invalid_api_key", "Missing or incorrect API key: send 'Authorization: Bearer <key>' "
                       f"or the '{KEY_SUBPROTOCOL_PREFIX}<key>' WebSocket subprotocol.")
    if not origin_allowed(headers.get("origin"), headers.get("host"), config.allowed_origins):
        return Refusal(403, "origin_not_allowed", "This origin may not connect to this server "
                       "(server.allowed_origins).")
    if MINICPMO_SUBPROTOCOL in subprotocols or "mode" in query:
        # the MiniCPM-o SDK offers map.realtime and always sends ?mode=; OpenAI clients neither
        echo = MINICPMO_SUBPROTOCOL if MINICPMO_SUBPROTOCOL in subprotocols else None
        return Handshake(subprotocol=echo, beta=False, openai_client=False, dialect="minicpmo")
    beta = BETA_HEADER in headers or BETA_SUBPROTOCOL in subprotocols
    # Echo one offered subprotocol (browsers fail a handshake that offered some and got none back),
    # never the key-bearing one.
    echo = next((p for p in (REALTIME_SUBPROTOCOL, BETA_SUBPROTOCOL) if p in subprotocols), None)
    return Handshake(subprotocol=echo, beta=beta, openai_client=beta or "model" in query)


def bearer_ok(config: ServerConfig, headers: Mapping[str, str]) -> bool:
    """For plain HTTP routes (/metrics): the key in the Authorization header, or no key configured."""
    return config.api_key is None or key_matches(config.api_key, presented_key(headers, []))


# Longest client address kept from a forwarded header (it names a cap's key and log lines).
MAX_ADDRESS_CHARS = 64


@functools.lru_cache(maxsize=8)
def _networks(trusted: tuple[str, ...]) -> tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...] | None:
    """The trusted proxies as networks; None when every peer is trusted ("*")."""
    if "*" in trusted:
        return None
    return tuple(ipaddress.ip_network(entry, strict=False) for entry in trusted)


def _trusted(address: str, trusted: tuple[str, ...]) -> bool:
    networks = _networks(trusted)
    if networks is None:
        return True
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return False
    return any(ip in network for network in networks)


def client_address(peer: str, headers: Mapping[str, str], trusted_proxies: Sequence[str]) -> str:
    """The address the per-client caps count: the TCP peer, unless the peer is a trusted proxy
    (``server.trusted_proxies``) and names the client in ``X-Forwarded-For``; then the nearest
    address in that list that is not itself a trusted proxy (entries to its left are whatever the
    client wrote, so only the part our proxies appended is believed)."""
    trusted = tuple(trusted_proxies)
    if not trusted or not _trusted(peer, trusted):
        return peer
    forwarded = headers.get("x-forwarded-for")
    if not forwarded:
        return peer
    hops = [hop.strip() for hop in forwarded.split(",") if hop.strip()]
    for hop in reversed(hops):
        if not _trusted(hop, trusted):
            return hop[:MAX_ADDRESS_CHARS]
    return hops[0][:MAX_ADDRESS_CHARS] if hops else peer
