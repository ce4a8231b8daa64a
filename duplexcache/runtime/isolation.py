"""One session can never hurt another: fault isolation inside a batched tick.

Every batched stage of a tick (audio encoder, Thinker forward, Talker unit, Code2Wav step) runs
over many sessions at once, so an exception raised inside it names no session. The rules
(docs/engine.md, "Isolation"):

* **Per-session checks before the batch** (``invalid_audio`` samples, a Code2Wav chunk the
  vocoder refuses, an injected fault) end only that session: ``SessionError(fatal=True)``, its
  blocks and streams freed.
* **A batched call that raises** is probed: each session's slice re-runs alone (its state
  snapshotted and restored around the probe), the sessions whose probe raises are the culprits
  and end; the survivors then re-run as ONE batch, so their rows are computed exactly as in a run
  without the culprits (same batch composition, same GEMM row counts, same bits).
  ``run_isolated`` implements this for the stages whose re-run is idempotent (the encoder, whose
  KV writes land at the same positions once its counters are restored, the Thinker and the
  Talker, whose forwards rewrite the same KV slots).
* **No culprit found** (every probe passes: a transient or batch-only failure): the survivors'
  batch is re-run once; if that raises too, ``StageFailed`` propagates and the tick fails (the
  engine's last resort; the server counts a tick error).

``FaultInjector`` is the test hook: a stage raises ``InjectedFault`` when a chosen session is in
its batch. It is off (``None``) unless a test installs one on the engine
(``DuplexEngine.faults``); nothing in the deploy YAML or the client protocol reaches it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

logger = logging.getLogger(__name__)

# Stages a fault can be injected into (the engine's names; "open" is the context build + prefill).
FAULT_STAGES = ("open", "encoder", "vision", "thinker", "talker", "code2wav")
# Where in a stage: before the batch (a per-session check) or inside the batched call.
FAULT_POINTS = ("precheck", "batched")

T = TypeVar("T")
R = TypeVar("R")


class InjectedFault(RuntimeError):
    """Raised by ``FaultInjector`` (tests only)."""

    code = "injected_fault"


class StageFailed(RuntimeError):
    """A batched stage failed and no single session could be blamed (the tick fails)."""


@dataclass
class FaultInjector:
    """Makes ``stage`` raise for session ``sid``; consulted by the engine at each stage.

    ``arm(stage, sid, point)``: at ``precheck`` the session's per-session check raises (an
    attributable failure); at ``batched`` the batched call raises whenever ``sid`` is in the
    batch (an unattributable failure: the probe path must find the culprit). ``times`` limits
    how often it fires (None: until disarmed)."""

    _armed: dict[tuple[str, str, str], int | None] = field(default_factory=dict)
    fired: list[tuple[str, str, str]] = field(default_factory=list)

    def arm(self, stage: str, sid: str, point: str = "batched", times: int | None = None) -> None:
        if stage not in FAULT_STAGES:
            raise ValueError(f"unknown stage {stage!r}; choose one of {FAULT_STAGES}")
        if point not in FAULT_POINTS:
            raise ValueError(f"unknown fault point {point!r}; choose one of {FAULT_POINTS}")
        self._armed[(stage, sid, point)] = times

    def disarm(self, stage: str | None = None, sid: str | None = None) -> None:
        for key in [k for k in self._armed if (stage is None or k[0] == stage) and (sid is None or k[1] == sid)]:
            del self._armed[key]

    def check(self, stage: str, sids: Iterable[str], point: str) -> None:
        """Raise ``InjectedFault`` if a fault is armed for ``stage``/``point`` and one of ``sids``."""
        for sid in sids:
            key = (stage, sid, point)
            if key not in self._armed:
                continue
            left = self._armed[key]
            if left is not None:
                if left <= 1:
                    del self._armed[key]
                else:
                    self._armed[key] = left - 1
            self.fired.append(key)
            raise InjectedFault(f"injected fault: stage {stage} ({point}) for session {sid}")


def check_faults(faults: FaultInjector | None, stage: str, sids: Iterable[str], point: str) -> None:
    """``faults.check`` when an injector is installed; nothing otherwise (the serving path)."""
    if faults is not None:
        faults.check(stage, sids, point)


def precheck(faults: FaultInjector | None, stage: str, items: Sequence[T], sid_of: Callable[[T], str],
             check: Callable[[T], None] | None = None) -> tuple[list[T], dict[str, Exception]]:
    """Per-session checks before a batch: returns (items that passed, errors of those that did not)."""
    kept: list[T] = []
    errors: dict[str, Exception] = {}
    for item in items:
        sid = sid_of(item)
        try:
            check_faults(faults, stage, (sid,), "precheck")
            if check is not None:
                check(item)
        except Exception as err:  # noqa: BLE001 - any per-session failure ends that session only
            logger.warning("%s: session %s failed its check: %s", stage, sid, err)
            errors[sid] = err
        else:
            kept.append(item)
    return kept, errors


@dataclass
class Isolated(Generic[T, R]):
    """What ``run_isolated`` returns: the batch's result over ``kept`` and the culprits' errors."""

    result: R | None
    kept: list[T]
    errors: dict[str, Exception]


def run_isolated(stage: str, items: Sequence[T], run: Callable[[list[T]], R], sid_of: Callable[[T], str],
                 faults: FaultInjector | None = None,
                 snapshot: Callable[[T], object] | None = None,
                 restore: Callable[[T, object], None] | None = None) -> Isolated[T, R]:
    """Run ``run(items)`` as one batch; on an exception find the culprits and re-run the rest.

    ``run`` must be safe to repeat over a sub-batch (its writes land where the full batch's
    would); ``snapshot``/``restore`` put back per-item state a probe advanced (e.g. counters).
    """
    items = list(items)
    if not items:
        return Isolated(None, [], {})
    sids = [sid_of(i) for i in items]
    try:
        check_faults(faults, stage, sids, "batched")
        return Isolated(run(items), items, {})
    except Exception as batch_err:  # noqa: BLE001 - the probe below decides whom it belongs to
        logger.warning("%s: batched call over %d sessions raised %r; probing each session", stage,
                       len(items), batch_err)
        if len(items) == 1:
            return Isolated(None, [], {sids[0]: batch_err})
    errors: dict[str, Exception] = {}
    for item, sid in zip(items, sids):
        saved = snapshot(item) if snapshot is not None else None
        try:
            check_faults(faults, stage, (sid,), "batched")
            run([item])
        except Exception as err:  # noqa: BLE001
            logger.warning("%s: session %s fails alone too: %s", stage, sid, err)
            errors[sid] = err
        finally:
            if restore is not None:
                restore(item, saved)
    kept = [i for i, sid in zip(items, sids) if sid not in errors]
    if not kept:
        return Isolated(None, [], errors)
    try:
        check_faults(faults, stage, [sid_of(i) for i in kept], "batched")
        return Isolated(run(kept), kept, errors)
    except Exception as err:  # noqa: BLE001
        raise StageFailed(f"{stage}: the batch of {len(kept)} sessions fails although each one "
                          f"passes alone: {err!r}") from err
