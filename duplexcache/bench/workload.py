"""Workloads that look like calls: what each session's user says, unit by unit, and when the server is scheduled to speak.

How it measures and what its figures mean: docs/bench_methods.md, "Workloads (bench ticks, bench serve, bench soak)".
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import numpy as np

from duplexcache.runtime.policy import reply_units
from duplexcache.runtime.voices import VoiceRegistry, synthetic_voice

WORKLOADS = ("conversation", "continuous", "turns")
SPEECH_RMS = 0.1
QUIET_RMS = 0.0005
INPUT_RATE = 16_000
FIRST_UNIT_SAMPLES = 16_560   # the audio encoder's first chunk (1.035 s)
UNIT_SAMPLES = 16_000
MIN_VOICES = 3


@dataclass(frozen=True)
class ConversationShape:
    """Turn lengths of the conversation workload, in units."""

    user_min_units: int = 2
    user_max_units: int = 6
    reply_min_units: int = 2     # must equal the server's engine.speak_policy.reply_min_units
    reply_max_units: int = 8     # ... and reply_max_units
    max_lead_units: int = 6      # random phase: quiet units before the first user turn
    max_gap_units: int = 1       # quiet units between a reply's end and the next user turn
    # The last unit of each user turn holds speech up to a seeded random 10 ms frame (1..100),
    # then quiet, so turns end at any point of the server's grid as a caller's do; without it
    # every turn of a session ends on a unit boundary of its stream, at one phase for the whole
    # call (`bench serve --turn-ends random`; over the wire only: the in-process script answers
    # in the first quiet unit)
    ragged_turn_ends: bool = False

    def __post_init__(self) -> None:
        if not 1 <= self.user_min_units <= self.user_max_units:
            raise ValueError(f"need 1 <= user_min_units <= user_max_units, got "
                             f"{self.user_min_units}, {self.user_max_units}")
        if not 1 <= self.reply_min_units <= self.reply_max_units:
            raise ValueError(f"need 1 <= reply_min_units <= reply_max_units, got "
                             f"{self.reply_min_units}, {self.reply_max_units}")
        if self.max_lead_units < 0 or self.max_gap_units < 0:
            raise ValueError(f"max_lead_units and max_gap_units must be >= 0, got "
                             f"{self.max_lead_units}, {self.max_gap_units}")


@dataclass(frozen=True)
class Turn:
    """One user turn and the reply scheduled after it (unit indices, end exclusive)."""

    index: int
    user_start: int
    user_units: int
    reply_units: int

    @property
    def user_end(self) -> int:
        """The first quiet unit after the turn: the server's first reply unit."""
        return self.user_start + self.user_units

    @property
    def reply_end(self) -> int:
        return self.user_end + self.reply_units


@dataclass(frozen=True)
class SessionScript:
    """What one session's user says (``speech``) and when the server speaks (``speaks``), per unit."""

    sid: str
    workload: str
    speech: tuple[bool, ...]
    speaks: tuple[bool, ...]
    turns: tuple[Turn, ...] = ()
    ragged_turn_ends: bool = False   # ConversationShape.ragged_turn_ends

    @property
    def units(self) -> int:
        return len(self.speech)

    def complete_turns(self, units_sent: int) -> list[Turn]:
        """Turns whose whole reply falls inside the first ``units_sent`` units (each reply unit
        needs an input unit, so a reply is only scheduled in full when its units were sent)."""
        return [t for t in self.turns if t.reply_end <= units_sent]


def _rng(*key: int) -> np.random.Generator:
    return np.random.default_rng([int(k) & 0xFFFFFFFF for k in key])


def conversation_script(index: int, sid: str, units: int, seed: int = 0,
                        shape: ConversationShape | None = None) -> SessionScript:
    """The conversation of session ``index`` (user side seeded by ``seed`` and ``index``; reply
    lengths from the server's ``reply_units(sid, turn)``), ``units`` units long."""
    shape = shape or ConversationShape()
    if units < 1:
        raise ValueError(f"units must be >= 1, got {units}")
    rng = _rng(seed, index, 0x5E55)
    speech = [False] * units
    speaks = [False] * units
    turns: list[Turn] = []
    at = int(rng.integers(0, shape.max_lead_units + 1))
    while at < units:
        user = int(rng.integers(shape.user_min_units, shape.user_max_units + 1))
        reply = reply_units(sid, len(turns), shape.reply_min_units, shape.reply_max_units)
        turn = Turn(len(turns), at, user, reply)
        turns.append(turn)
        for u in range(turn.user_start, min(turn.user_end, units)):
            speech[u] = True
        for u in range(turn.user_end, min(turn.reply_end, units)):
            speaks[u] = True
        at = turn.reply_end + int(rng.integers(0, shape.max_gap_units + 1))
    return SessionScript(sid, "conversation", tuple(speech), tuple(speaks), tuple(turns), shape.ragged_turn_ends)


def continuous_script(sid: str, units: int) -> SessionScript:
    """The user speaks every unit and so does the server (one endless turn)."""
    return SessionScript(sid, "continuous", (True,) * units, (True,) * units)


def turns_script(sid: str, units: int, k: int, turn_units: int) -> SessionScript:
    """The ``every_k_units`` lockstep schedule; the user speaks every unit."""
    t = min(turn_units, k)
    return SessionScript(sid, "turns", (True,) * units, tuple(u % k >= k - t for u in range(units)))


def unit_samples(unit_index: int) -> int:
    return FIRST_UNIT_SAMPLES if unit_index == 0 else UNIT_SAMPLES


END_FRAME_SAMPLES = 160   # ragged turn ends fall on 10 ms frames


def speech_samples(script: SessionScript, index: int, unit_index: int, seed: int = 0) -> int:
    """Samples of speech at the start of unit ``unit_index``: all of a speech unit, none of a
    quiet one, and with ``ragged_turn_ends`` a seeded 1..100 frames of a turn's last unit."""
    n = unit_samples(unit_index)
    if not script.speech[unit_index]:
        return 0
    last = script.ragged_turn_ends and any(t.user_end - 1 == unit_index for t in script.turns)
    if not last:
        return n
    frames = int(_rng(seed, index, unit_index, zlib.crc32(b"turn end")).integers(1, 101))
    return min(n, frames * END_FRAME_SAMPLES)


def unit_audio(script: SessionScript, index: int, unit_index: int, seed: int = 0) -> np.ndarray:
    """16 kHz float32 input of one unit: speech-level noise in a user turn, near-silence otherwise
    (a ragged turn end: speech for ``speech_samples``, then near-silence)."""
    if not 0 <= unit_index < script.units:
        raise ValueError(f"unit {unit_index} is outside the script's {script.units} units")
    n = unit_samples(unit_index)
    rms = np.full(n, QUIET_RMS)
    rms[:speech_samples(script, index, unit_index, seed)] = SPEECH_RMS
    noise = _rng(seed, index, unit_index, zlib.crc32(b"audio")).standard_normal(n)
    return np.clip(noise * rms, -1.0, 1.0).astype(np.float32)


def ensure_voices(registry: VoiceRegistry, count: int = MIN_VOICES) -> list[str]:
    """Register synthetic voices until ``registry`` has ``count``; returns every voice name.

    Extra voices copy the shape of the first one (reference seconds, prompt frames, speech
    vocabulary), so their per-session cost is that of the preset's voices."""
    names = registry.names()
    if not names:
        raise ValueError("the voice registry is empty")
    like = registry.get(names[0])
    vocab = int(like.prompt_tokens.max()) + 1
    k = 0
    while len(registry) < count:
        name = f"bench_voice_{k}"
        k += 1
        if name in registry:
            continue
        # 25 tokens (50 mel frames) per second; the vocabulary bound only needs to cover real ids
        registry.add(synthetic_voice(name, like.ref_seconds, like.prompt_frames / 50, max(vocab, 2)))
    return registry.names()


def pick_voices(n: int, voices: list[str], seed: int = 0) -> list[str]:
    """Voices of ``n`` sessions: every voice in turn, in a seeded order (so n >= len(voices)
    uses them all)."""
    if not voices:
        raise ValueError("no voices to pick from")
    order = [voices[i] for i in _rng(seed, 0x701CE).permutation(len(voices))]
    return [order[i % len(order)] for i in range(n)]
