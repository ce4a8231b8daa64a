"""When a session speaks, and which text tokens it says: the Thinker's per-unit decisions.

One unit of the Thinker, after ``</unit>`` (closing the previous unit) + ``<unit>`` + 10 audio
embeddings are appended::

    decision   <|listen|>                                  -> the unit is silent
               <|speak|> t_1 .. t_n  (<|chunk_eos|> | <|turn_eos|>)
                                                          -> speech text of this unit; the
                                                             Talker turns it into 25 codes

At most :data:`MAX_UNIT_TOKENS` (20) tokens are decoded per unit (decision + text + end); the
engine forces ``<|chunk_eos|>`` at the limit.

Two policies:

* :class:`ModelPolicy` (``speak_policy.mode: model``): the Thinker decides. The decision is the
  argmax of the logits restricted to {listen, speak}; text tokens are the argmax (or a sample)
  over the ordinary text ids plus the two end tokens. Control tokens can never appear as text.
* :class:`ScriptedPolicy` (``every_k_units``): with random weights the decision is noise, so
  demos and benchmarks force a deterministic load. Units are grouped in blocks of ``k``; the
  last ``turn_units`` units of each block speak (one turn), the others listen. A speaking unit
  says ``text_tokens`` text tokens (the model's argmax over text ids, so they still depend on
  the input) and ends with ``<|turn_eos|>`` on the block's last unit, else ``<|chunk_eos|>``::

      k = 4, turn_units = 2:   L L S S | L L S S | ...    (S S = one turn of 2 chunks)
      k = 2, turn_units = 2:   S S | S S | ...            (the config default)

* :class:`ReplyPolicy` (``reply``): a scripted conversation driven by the input audio, so a
  load generator can play a caller and know when the server will answer. The unit's PCM is cut
  into 10 ms frames; a frame whose RMS is above ``speech_rms`` is user speech. The user's turn
  ends in the first unit where at least ``end_quiet_ms`` of quiet has followed the turn's last
  speech frame (counted across units), and that unit starts a reply of ``R`` units, ``R =``
  :func:`reply_units` ``(session id, turn index, min, max)``; the reply's last unit ends with
  ``<|turn_eos|>``, then the session listens again. Speech during a reply does not interrupt it
  (no barge-in), but it is heard: a turn spoken while a reply runs is answered when the reply
  ends, once its quiet has come (a caller that does not wait for the reply loses no turn)::

      input     q q S S S q q q q q S S q ...       (S: speech to the unit's end)
      decision  L L L L L S S S L L L L S ...       (turn 0: R = 3 units)

  Units cut on the server's tick grid rarely end where speech does: a unit holding the end of a
  turn and ``end_quiet_ms`` of quiet after it answers in that unit, not one unit later (with
  whole units of quiet, as above, the two rules agree)::

      input     q q S S Sq q q ...                  (Sq: speech, then >= end_quiet_ms of quiet)
      decision  L L L L S  S S ...

  The quiet also counts into the audio the server already holds after the unit when its tick takes it (about ``lead``, 150 ms, with units
  aligned to the ticks), so a turn ending in the unit's last ``end_quiet_ms`` is answered in that
  unit too, as a server VAD would hear it, instead of one unit (1 s) later. The decision then
  depends on how much audio has arrived, not on the unit alone.

Per-session state: the engine asks the policy for a state object when a session opens
(:meth:`new_session`) and hands it back, with the unit's PCM, on every decision.

Token ids come from the tokenizer (a real checkpoint's ids win). ``<|turn_eos|>`` is not in the
spec's list; 151717 is the id public MiniCPM-o 4.5 test fixtures use, not verified against the
real tokenizer (which is not available here).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol, Union

import numpy as np
import torch

from duplexcache.config import SpeakPolicy
from duplexcache.context.tokenizer import FIRST_SPECIAL_ID, ByteTokenizer, Tokenizer
from duplexcache.runtime.engine_api import INPUT_SAMPLE_RATE

MAX_UNIT_TOKENS = 20
QUIET_FRAME_SAMPLES = 160   # 10 ms at 16 kHz: the ReplyPolicy's speech/quiet resolution
# Quiet after speech that ends a user turn (ReplyPolicy; the deploy default, one source): a
# caller's pause inside a turn is shorter. OpenAI's server_vad waits 500 ms; a full-duplex model
# decides once per unit, so this only decides whether the unit that holds the end of speech
# already answers.
DEFAULT_END_QUIET_MS: int = SpeakPolicy.model_fields["end_quiet_ms"].default
TURN_EOS_FALLBACK_ID = 151717


@dataclass(frozen=True)
class ControlTokens:
    """Ids of the unit-protocol tokens."""

    unit: int
    unit_end: int
    listen: int
    speak: int
    chunk_eos: int
    turn_eos: int

    @classmethod
    def from_tokenizer(cls, tokenizer: Tokenizer) -> ControlTokens:
        try:
            turn_eos = tokenizer.token_id("<|turn_eos|>")
        except KeyError:
            turn_eos = TURN_EOS_FALLBACK_ID
        return cls(unit=tokenizer.token_id("<unit>"), unit_end=tokenizer.token_id("</unit>"),
                   listen=tokenizer.token_id("<|listen|>"), speak=tokenizer.token_id("<|speak|>"),
                   chunk_eos=tokenizer.token_id("<|chunk_eos|>"), turn_eos=turn_eos)

    @property
    def ends(self) -> tuple[int, int]:
        return (self.chunk_eos, self.turn_eos)


def text_token_ids(tokenizer: Tokenizer, vocab_size: int) -> torch.Tensor:
    """Ids a unit's speech text may use: printable ASCII for the byte fallback tokenizer (so the
    text deltas are readable), every ordinary (non-special) id for a real tokenizer."""
    if isinstance(tokenizer, ByteTokenizer):
        return torch.arange(32, 127)
    return torch.arange(0, min(FIRST_SPECIAL_ID, vocab_size))


class DecisionPolicy(Protocol):
    def new_session(self, sid: str) -> Any:
        """Per-session state handed back on every call for that session (None if stateless)."""
        ...

    def decide(self, unit_index: int, logits: Logits, state: Any = None,
               pcm: np.ndarray | None = None, ahead: np.ndarray | None = None) -> int:
        """The decision token (listen or speak) of unit ``unit_index`` from the logits (V,)
        after its audio; ``pcm`` is the unit's 16 kHz input, ``ahead`` the input the server holds
        after it when the tick takes the unit (the next unit's start). The engine passes a
        ``RowLogits`` (``TokenSet.argmax`` takes it as is; ``logits_tensor`` gives the row)."""
        ...

    def next_token(self, unit_index: int, num_text: int, logits: Logits, state: Any = None) -> int:
        """The next token of a speaking unit that has said ``num_text`` text tokens: a text id
        or one of the two end tokens."""
        ...


def _loud_frames(pcm: np.ndarray, speech_rms: float, frame: int, from_end: bool) -> np.ndarray:
    """Indices of the 10 ms frames of ``pcm`` whose RMS is above ``speech_rms``. Frames are cut
    from the end (``from_end``) or from the start, and the remainder shorter than ``frame`` at
    the other end is a frame of its own."""
    if frame <= 0:
        raise ValueError(f"frame must be > 0, got {frame}")
    short = pcm.size % frame
    power = np.square(pcm, dtype=np.float64)
    whole = power[short:] if from_end else power[:pcm.size - short]
    frames = whole.reshape(-1, frame).mean(axis=1)
    if short:
        rest = [power[:short].mean()] if from_end else [power[pcm.size - short:].mean()]
        frames = np.concatenate([rest, frames] if from_end else [frames, rest])
    return np.flatnonzero(frames > speech_rms * speech_rms)


def trailing_quiet(pcm: np.ndarray, speech_rms: float, frame: int = QUIET_FRAME_SAMPLES) -> tuple[bool, int]:
    """Whether ``pcm`` holds speech (a frame of RMS above ``speech_rms``), and how many samples
    follow its last speech frame (all of them when it holds none).

    Frames are cut from the end, so the unit's last samples always form a whole frame; a leading
    remainder shorter than ``frame`` is a frame of its own."""
    loud = _loud_frames(pcm, speech_rms, frame, from_end=True)
    if loud.size == 0:
        return False, int(pcm.size)
    frames = -(-pcm.size // frame)
    return True, int((frames - 1 - loud[-1]) * frame)


def leading_quiet(pcm: np.ndarray, speech_rms: float, frame: int = QUIET_FRAME_SAMPLES) -> int:
    """Samples of ``pcm`` before its first speech frame (all of them when it holds none).
    Frames are cut from the start (the audio right after a unit); a trailing remainder shorter
    than ``frame`` is a frame of its own."""
    loud = _loud_frames(pcm, speech_rms, frame, from_end=False)
    return int(pcm.size) if loud.size == 0 else int(loud[0]) * frame


def reply_units(sid: str, turn_index: int, min_units: int, max_units: int) -> int:
    """Length in units of the reply to user turn ``turn_index`` of session ``sid``.

    The one definition both the server's :class:`ReplyPolicy` and a load generator use, so a
    client can tell how much audio the server will send. A hash, not a RNG stream: the value
    depends only on its arguments (stable across processes, Python versions and platforms)."""
    if not 1 <= min_units <= max_units:
        raise ValueError(f"need 1 <= min_units <= max_units, got {min_units}, {max_units}")
    if turn_index < 0:
        raise ValueError(f"turn_index must be >= 0, got {turn_index}")
    digest = hashlib.blake2b(f"{sid}/{turn_index}".encode(), digest_size=8).digest()
    return min_units + int.from_bytes(digest, "little") % (max_units - min_units + 1)


class TokenSet:
    """The token ids a policy may pick, with one copy on each device its logits live on: the
    ids never change, and copying them (150k ids, 1.2 MB for the text set) to the GPU for every
    pick cost a blocking host-to-device transfer per session per token."""

    def __init__(self, ids: torch.Tensor) -> None:
        self.ids = ids.to(dtype=torch.long, device="cpu")
        self._on: dict[torch.device, torch.Tensor] = {self.ids.device: self.ids}

    def __len__(self) -> int:
        return len(self.ids)

    def on(self, device: torch.device) -> torch.Tensor:
        ids = self._on.get(device)
        if ids is None:
            ids = self._on[device] = self.ids.to(device)
        return ids

    def argmax(self, logits: Logits) -> int:
        """The id of the largest logit among the set (the first on ties, as ``torch.argmax``).
        A ``RowLogits`` is answered from its step's batched argmax (one host sync per step)."""
        if isinstance(logits, RowLogits):
            return logits.step.argmax(logits.sid, self)
        return int(self.ids[int(torch.argmax(logits[self.on(logits.device)].float()))])


class StepLogits:
    """The logits of one Thinker step (sid -> (V,)), picked from for every session at once.

    A policy that reads ``int(argmax)`` per session makes the host wait for the device once per
    session per token (60 waits per tick at 40 sessions on an H200); the first ``argmax`` over a
    ``TokenSet`` here computes every row's pick in one batched argmax and one copy to the host,
    and later sessions read theirs from it. Row by row it is the same argmax (first index on
    ties), so the picks are the per-session ones."""

    def __init__(self, rows: Mapping[str, torch.Tensor]) -> None:
        self._rows = rows
        # id(TokenSet) -> (the TokenSet, sid -> token id). Holding the set keeps its id from being
        # reused by another set made later in the step (a policy that builds one per call).
        self._picks: dict[int, tuple[TokenSet, dict[str, int]]] = {}

    def row(self, sid: str) -> RowLogits:
        if sid not in self._rows:
            raise KeyError(f"no logits for session {sid!r} in this step")
        return RowLogits(self, sid)

    def tensor(self, sid: str) -> torch.Tensor:
        return self._rows[sid]

    def argmax(self, sid: str, ids: TokenSet) -> int:
        cached = self._picks.get(id(ids))
        if cached is None:
            sids = list(self._rows)
            stacked = torch.stack([self._rows[s] for s in sids])                  # (B, V)
            best = torch.argmax(stacked[:, ids.on(stacked.device)].float(), dim=-1).tolist()
            cached = self._picks[id(ids)] = (ids, {s: int(ids.ids[i]) for s, i in zip(sids, best)})
        return cached[1][sid]


@dataclass(frozen=True)
class RowLogits:
    """One session's row of a ``StepLogits`` (what the engine hands a policy)."""

    step: StepLogits
    sid: str

    @property
    def tensor(self) -> torch.Tensor:
        return self.step.tensor(self.sid)


Logits = Union[torch.Tensor, RowLogits]


def logits_tensor(logits: Logits) -> torch.Tensor:
    return logits.tensor if isinstance(logits, RowLogits) else logits


class ModelPolicy:
    """The Thinker decides; logits restricted to what is legal at each point."""

    def __init__(self, control: ControlTokens, text_ids: torch.Tensor, temperature: float = 0.0,
                 generator: torch.Generator | None = None) -> None:
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {temperature}")
        self.control = control
        self.decision_ids = TokenSet(torch.tensor([control.listen, control.speak]))
        self.text_ids = TokenSet(torch.cat([text_ids, torch.tensor(control.ends)]))
        self.temperature = temperature
        self.generator = generator

    def _pick(self, logits: Logits, ids: TokenSet) -> int:
        if self.temperature == 0:
            return ids.argmax(logits)
        logits = logits_tensor(logits)
        probs = torch.softmax(logits[ids.on(logits.device)].float().cpu() / self.temperature, dim=-1)
        return int(ids.ids[int(torch.multinomial(probs, 1, generator=self.generator))])

    def new_session(self, sid: str) -> None:
        return None

    def decide(self, unit_index: int, logits: torch.Tensor, state: Any = None,
               pcm: np.ndarray | None = None, ahead: np.ndarray | None = None) -> int:
        return self._pick(logits, self.decision_ids)

    def next_token(self, unit_index: int, num_text: int, logits: torch.Tensor, state: Any = None) -> int:
        return self._pick(logits, self.text_ids)


class ScriptedPolicy:
    """Deterministic speaking schedule (see the module docstring)."""

    def __init__(self, control: ControlTokens, text_ids: torch.Tensor, k: int, turn_units: int = 2,
                 text_tokens: int = 3) -> None:
        if k < 1 or turn_units < 1 or not 0 <= text_tokens <= MAX_UNIT_TOKENS - 2:
            raise ValueError(f"need k >= 1, turn_units >= 1, 0 <= text_tokens <= {MAX_UNIT_TOKENS - 2}; "
                             f"got {k}, {turn_units}, {text_tokens}")
        self.control = control
        self.text_ids = TokenSet(text_ids)
        self.k = k
        self.turn_units = min(turn_units, k)
        self.text_tokens = text_tokens

    def speaks(self, unit_index: int) -> bool:
        return unit_index % self.k >= self.k - self.turn_units

    def new_session(self, sid: str) -> None:
        return None

    def decide(self, unit_index: int, logits: torch.Tensor, state: Any = None,
               pcm: np.ndarray | None = None, ahead: np.ndarray | None = None) -> int:
        return self.control.speak if self.speaks(unit_index) else self.control.listen

    def next_token(self, unit_index: int, num_text: int, logits: torch.Tensor, state: Any = None) -> int:
        if num_text < self.text_tokens:
            return self.text_ids.argmax(logits)
        ends_turn = unit_index % self.k == self.k - 1
        return self.control.turn_eos if ends_turn else self.control.chunk_eos


@dataclass
class ReplyState:
    """One session's place in a :class:`ReplyPolicy` conversation (tick thread only)."""

    sid: str
    heard_speech: bool = False   # the current user turn has had a speech unit
    turns: int = 0               # user turns answered so far (the next reply's turn index)
    reply_left: int = 0          # units of the current reply still to speak after the current one
    speaking: bool = False       # the current unit is a reply unit
    reply_units: int = 0         # length of the reply started last (0 before the first)
    quiet_samples: int = 0       # quiet input since the last speech frame (across units)


class ReplyPolicy:
    """Replies after each user turn (see the module docstring)."""

    def __init__(self, control: ControlTokens, text_ids: torch.Tensor, speech_rms: float, reply_min_units: int,
                 reply_max_units: int, text_tokens: int = 3, end_quiet_ms: int = DEFAULT_END_QUIET_MS) -> None:
        if not 0 < speech_rms < 1 or not 1 <= reply_min_units <= reply_max_units \
                or not 0 <= text_tokens <= MAX_UNIT_TOKENS - 2 or end_quiet_ms < 10:
            raise ValueError(f"need 0 < speech_rms < 1, 1 <= reply_min_units <= reply_max_units, "
                             f"0 <= text_tokens <= {MAX_UNIT_TOKENS - 2} and end_quiet_ms >= 10; got {speech_rms}, "
                             f"{reply_min_units}, {reply_max_units}, {text_tokens}, {end_quiet_ms}")
        self.control = control
        self.text_ids = TokenSet(text_ids)
        self.speech_rms = speech_rms
        self.end_quiet_samples = end_quiet_ms * INPUT_SAMPLE_RATE // 1000
        self.reply_min_units = reply_min_units
        self.reply_max_units = reply_max_units
        self.text_tokens = text_tokens

    def new_session(self, sid: str) -> ReplyState:
        return ReplyState(sid)

    def decide(self, unit_index: int, logits: torch.Tensor, state: Any = None,
               pcm: np.ndarray | None = None, ahead: np.ndarray | None = None) -> int:
        if not isinstance(state, ReplyState) or pcm is None:
            raise ValueError("ReplyPolicy.decide needs the session's ReplyState and the unit's PCM")
        # Heard in every unit, a reply's included: a user turn spoken while the reply runs (a
        # caller that does not wait for it) is answered once the reply ends, never dropped.
        speech, quiet = trailing_quiet(pcm, self.speech_rms)
        if speech:
            state.heard_speech, state.quiet_samples = True, quiet
        else:
            state.quiet_samples += quiet
        if state.speaking and state.reply_left > 0:   # inside a reply: keep speaking (no barge-in)
            state.reply_left -= 1
            return self.control.speak
        state.speaking = False
        # listen while no user turn waits for an answer, or while its speech may go on
        if not state.heard_speech:
            return self.control.listen
        quiet = state.quiet_samples
        if quiet < self.end_quiet_samples and ahead is not None and ahead.size:
            # The quiet may go on past the unit's end into audio the server already holds: a
            # turn that ends in the unit's last end_quiet_ms is answered now, not a unit later.
            quiet += leading_quiet(ahead, self.speech_rms)
        if quiet < self.end_quiet_samples:
            return self.control.listen
        length = reply_units(state.sid, state.turns, self.reply_min_units, self.reply_max_units)
        state.reply_units = length
        state.heard_speech, state.turns = False, state.turns + 1
        state.speaking, state.reply_left = True, length - 1
        return self.control.speak

    def would_answer(self, state: ReplyState, pcm: np.ndarray, after: np.ndarray) -> bool:
        """Whether a unit holding ``pcm`` and then silence would start a reply, judged on the
        audio received only: a user turn waits for its answer, no reply is running, ``after``
        (what the server holds past ``pcm``) holds no speech, and the quiet after the turn's last
        speech frame, counted through ``after``, is ``end_quiet_ms`` or more. Changes no state.

        The engine asks this to close a unit early (``scheduler.tick_phases``): the silence it
        completes the unit with then never makes a turn end that the caller's audio did not."""
        if not isinstance(state, ReplyState):
            raise ValueError("ReplyPolicy.would_answer needs the session's ReplyState")
        if state.speaking and state.reply_left > 0:
            return False
        if leading_quiet(after, self.speech_rms) < after.size:   # the turn goes on past the cut
            return False
        speech, quiet = trailing_quiet(pcm, self.speech_rms)
        if not (speech or state.heard_speech):
            return False
        heard_quiet = quiet if speech else state.quiet_samples + quiet
        return heard_quiet + after.size >= self.end_quiet_samples

    def next_token(self, unit_index: int, num_text: int, logits: torch.Tensor, state: Any = None) -> int:
        if not isinstance(state, ReplyState):
            raise ValueError("ReplyPolicy.next_token needs the session's ReplyState")
        if num_text < self.text_tokens:
            return self.text_ids.argmax(logits)
        # The reply's last unit ends the turn, so its audio is flushed in the same tick.
        return self.control.turn_eos if state.reply_left == 0 else self.control.chunk_eos


def make_policy(settings: SpeakPolicy, control: ControlTokens, text_ids: torch.Tensor) -> DecisionPolicy:
    """The policy ``engine.speak_policy`` names."""
    if settings.mode == "model":
        return ModelPolicy(control, text_ids)
    if settings.mode == "every_k_units":
        return ScriptedPolicy(control, text_ids, k=settings.k, turn_units=settings.turn_units)
    if settings.mode == "reply":
        return ReplyPolicy(control, text_ids, settings.speech_rms, settings.reply_min_units,
                           settings.reply_max_units, end_quiet_ms=settings.end_quiet_ms)
    raise ValueError(f"unknown speak_policy mode {settings.mode!r}")
