"""Where a new session goes: cache affinity first, then headroom (no Ray here; router.py uses it).

Sessions with the same context (instructions + voice, for one model revision) share Thinker
anchor blocks, the context-cache entry and the voice's Code2Wav prompt state -- but only on the
same replica. So a session is sent to a replica that already holds its context, unless that
replica has no room; otherwise to the replica with the most room. A client names its context
before the first frame with :func:`context_key` in the ``serve_multiplexed_model_id`` header
(Ray Serve's proxy hands that header to the router); a session without one goes by room alone.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

# The header Ray Serve's proxy reads into the multiplexed model id (what the router sees).
from duplexcache.server.protocol import PLACEMENT_HEADER as CONTEXT_HEADER

# A placement header ``replica:<id>`` pins a request to one replica (cluster/router.py).
PIN_PREFIX = "replica:"

# Placement reasons (logged, and counted in duplexcache_placements_total{reason}).
AFFINITY = "affinity"              # the replica that holds the context, with room
AFFINITY_FULL = "affinity_full"    # the context's replicas are full: the roomiest other one
NEW_CONTEXT = "new_context"        # no replica holds the context: the roomiest one
NO_KEY = "no_key"                  # the client named no context: the roomiest one
ALL_FULL = "all_full"              # no replica has room: the roomiest anyway (its admission refuses or queues)
REASONS = (AFFINITY, AFFINITY_FULL, NEW_CONTEXT, NO_KEY, ALL_FULL)


def context_key(instructions: str, voice: str | None, revision: str) -> str:
    """The name of a session's shared context: sha256 over model revision, voice and instructions
    (``voice`` as the client sends it; None -- the server's default voice -- hashes as "")."""
    digest = hashlib.sha256()
    for part in (revision, voice or "", instructions):
        data = part.encode("utf-8")
        digest.update(len(data).to_bytes(8, "little"))
        digest.update(data)
    return "ctx-" + digest.hexdigest()[:32]


@dataclass(frozen=True)
class ReplicaLoad:
    """What the router knows of one replica (from its routing stats plus its own recent sends)."""

    replica: str
    headroom: int                          # more sessions it could admit now
    context_keys: frozenset[str] = field(default_factory=frozenset)
    draining: bool = False


@dataclass(frozen=True)
class Placement:
    replica: str
    reason: str


def place(key: str | None, loads: Sequence[ReplicaLoad]) -> Placement:
    """The replica for a new session with context ``key`` (see the module docstring). Ties go to
    the first replica in ``loads`` order. ValueError when ``loads`` has no replica that is not
    draining."""
    candidates = [load for load in loads if not load.draining]
    if not candidates:
        raise ValueError("no replica accepts new sessions (all are draining or none is running)")
    roomiest = max(candidates, key=lambda load: load.headroom)
    if roomiest.headroom <= 0:
        return Placement(roomiest.replica, ALL_FULL)
    if not key:
        return Placement(roomiest.replica, NO_KEY)
    holders = [load for load in candidates if key in load.context_keys]
    if not holders:
        return Placement(roomiest.replica, NEW_CONTEXT)
    best_holder = max(holders, key=lambda load: load.headroom)
    if best_holder.headroom > 0:
        return Placement(best_holder.replica, AFFINITY)
    return Placement(roomiest.replica, AFFINITY_FULL)


def with_sent(loads: Iterable[ReplicaLoad], sent: dict[str, list[str | None]]) -> list[ReplicaLoad]:
    """``loads`` with what this router sent recently counted in (one slot of room each, and the
    context held): routing stats are seconds old while a burst of sessions is placed in milliseconds."""
    out = []
    for load in loads:
        keys = sent.get(load.replica, [])
        out.append(ReplicaLoad(load.replica, load.headroom - len(keys),
                               load.context_keys | {k for k in keys if k}, load.draining))
    return out
