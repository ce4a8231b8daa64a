"""Who holds the GIL in a serving process: a summary of py-spy's raw output.

``py-spy record --gil --threads --format raw`` samples only the thread that holds the GIL, one
line per distinct stack (``frame;frame;... count``, outermost first). The server runs the tick in
a worker thread (``asyncio.to_thread(engine.tick)``) and everything else on the event loop
(WebSocket frames, JSON, base64, resampling, routing events), so the question "does the server's
own work stretch the tick?" becomes "what share of the GIL samples does the event loop hold
while ticks run, and on what?" (docs/results/HISTORY.md, "Where the server's time goes").

Only parsing and counting live here (tested on CPU); ``scripts/probes/serve_profile.py`` runs the
server under py-spy with the load generator.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

# A frame as py-spy writes it: "function (path/to/file.py:line)" or "function (path/to/file.py)".
_FRAME = re.compile(r"^(?P<func>.+?) \((?P<file>[^():]+)(?::(?P<line>\d+))?\)$")
# The engine's tick, wherever the server calls it from.
_TICK_MARKERS = ("DuplexEngine.tick", "DuplexEngine._tick")
# The serving loop: asyncio's (or uvloop's, whose C loop shows no frame of its own) under asyncio.run.
_LOOP_MARKERS = ("asyncio/runners.py", "asyncio/base_events.py")
_MAIN_THREAD = "MainThread"
ROLES = ("tick", "event_loop", "startup", "other")


@dataclass
class GilProfile:
    """GIL samples by thread role, and what the event loop held it for."""

    total: int = 0
    by_role: Counter = field(default_factory=Counter)            # one of ROLES
    loop_by_site: Counter = field(default_factory=Counter)       # deepest duplexcache frame (or library)
    loop_by_leaf: Counter = field(default_factory=Counter)       # the innermost frame
    tick_by_stage: Counter = field(default_factory=Counter)      # the deepest runtime/ module in the tick

    def share(self, role: str) -> float:
        return self.by_role[role] / self.total if self.total else 0.0

    def to_json(self, top: int = 15, wall_samples: int | None = None) -> dict[str, Any]:
        """``wall_samples``: rate x seconds sampled; then ``of_wall`` is the fraction of wall-clock
        time each role held the GIL (the samples are only those with the GIL held)."""
        of_wall = ({role: round(self.by_role[role] / wall_samples, 4) for role in ROLES}
                   if wall_samples else None)
        return {
            "samples": self.total, "wall_samples": wall_samples, "of_wall": of_wall,
            "share": {role: round(self.share(role), 4) for role in ROLES},
            "event_loop_sites": _top(self.loop_by_site, self.total, top),
            "event_loop_leaves": _top(self.loop_by_leaf, self.total, top),
            "tick_stages": _top(self.tick_by_stage, self.total, top),
        }


def _top(counter: Counter, total: int, n: int) -> list[dict[str, Any]]:
    return [{"where": k, "samples": v, "share": round(v / total, 4) if total else 0.0}
            for k, v in counter.most_common(n)]


def parse_frame(text: str) -> tuple[str, str]:
    """``"decode (duplexcache/server/audio_io.py:40)"`` -> (function, file); other text as is."""
    m = _FRAME.match(text.strip())
    return (m["func"], m["file"]) if m else (text.strip(), "")


def _is_loop_frame(frame: tuple[str, str]) -> bool:
    return any(mark in frame[1] for mark in _LOOP_MARKERS)


def role_of(thread: str, frames: list[tuple[str, str]]) -> str:
    """``tick`` (the engine's tick, in a worker thread), ``event_loop`` (the main thread under
    asyncio.run; with uvloop, samples in the C loop have no Python frame at all), ``startup``
    (the main thread before serving: imports, model build, warm-up) or ``other``."""
    if any(any(mark in func for mark in _TICK_MARKERS) for func, _ in frames):
        return "tick"
    if thread == _MAIN_THREAD:
        return "event_loop" if not frames or any(_is_loop_frame(f) for f in frames) else "startup"
    return "other"


def _site(frames: list[tuple[str, str]], prefix: str = "duplexcache/") -> str:
    """The deepest frame in our package, else the deepest library file's top folder."""
    for func, f in reversed(frames):
        if prefix in f:
            return f"{f[f.index(prefix):]}:{func}"
    for _, f in reversed(frames):
        if f:
            return f.split("/")[0] if "/" in f else f
    return "?"


def summarize(lines: Iterable[str]) -> GilProfile:
    """Count py-spy raw lines (``stack count``) by role; the process and thread pseudo-frames
    (``process 12:"..."``, ``thread (0x...)``) are skipped."""
    prof = GilProfile()
    for line in lines:
        line = line.rstrip("\n")
        if not line.strip():
            continue
        stack, _, count = line.rpartition(" ")
        if not count.isdigit():
            raise ValueError(f"not a py-spy raw line (no trailing count): {line[:120]!r}")
        n = int(count)
        parts = [p for p in stack.split(";") if p and not p.startswith("process ")]
        thread = ""
        if parts and parts[0].startswith("thread ("):
            # "thread (24434): MainThread" (py-spy --threads)
            thread = parts.pop(0).partition("): ")[2]
        frames = [parse_frame(p) for p in parts]
        role = role_of(thread, frames)
        prof.total += n
        prof.by_role[role] += n
        if role == "event_loop":
            # what the loop runs: the frames below its own (asyncio.run and what it calls)
            loop = [i for i, f in enumerate(frames) if _is_loop_frame(f)]
            frames = frames[loop[-1] + 1:] if loop else frames
            prof.loop_by_site[_site(frames) if frames else "(event loop, no Python frame)"] += n
            if frames:
                func, f = frames[-1]
                prof.loop_by_leaf[f"{f}:{func}"] += n
        elif role == "tick":
            prof.tick_by_stage[_site(frames, "duplexcache/runtime/")] += n
    return prof


def format_profile(prof: GilProfile, top: int = 10) -> str:
    out = [f"GIL samples: {prof.total}; " + ", ".join(f"{r} {prof.share(r):.1%}" for r in ROLES)]
    for title, counter in (("event loop, by site", prof.loop_by_site), ("event loop, innermost frame", prof.loop_by_leaf),
                           ("tick, by runtime module", prof.tick_by_stage)):
        out.append(f"  {title}:")
        out += [f"    {v / prof.total:6.1%}  {k}" for k, v in counter.most_common(top)] if prof.total else []
    return "\n".join(out)
