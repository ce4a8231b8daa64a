"""Turn control of one session: turn modes, response requests, cancel (barge-in) and user text.

The server calls four engine methods (``DuplexEngine.set_turn_mode``, ``request_response``,
``cancel_response``, ``add_user_text``; pinned in docs/engine.md). They only record a request
in the session's :class:`TurnState` under the engine lock; the tick applies it at the session's
next unit boundary. This module holds that state and the rules; engine.py has the hooks.

Decisions (:func:`decide`), per unit::

    a response was requested          -> <|speak|> (forced; the forced token is what the
                                         Thinker decodes next, so its KV says it spoke)
    mode "manual", no reply running   -> <|listen|> (forced)
    otherwise                         -> the speak policy (duplex: every unit; manual: the
                                         units of a requested reply after its first)

A reply is the run of speaking units from its first ``<|speak|>`` to the ``ResponseDone`` that
ends it (``<|turn_eos|>``, a listen after speaking, or a cancel). Each reply unit is recorded
(:class:`ReplyUnit`): the rows it appended before its decision, its text length, its end token
and the audio samples sent for it.

Cancel and truncation. A unit's audio leaves in the tick of its text (runtime/stages/code2wav_stage.py);
only the turn's final chunk (its last 3 codes and the vocoder's cross-fade tail) waits for the
turn to end. A cancel recorded after tick t is applied at the start of tick t+1, before that
tick's unit (4 reply units r0..r3 here, r0 spoken at tick 1)::

    tick           1        2        3        4      | cancel applied at tick 5
    Thinker text   r0       r1       r2       r3     |
    audio sent     r0       r1       r2       r3     |  the final chunk is never sent
    Thinker KV     u1 S r0 e | u2 S r1 e | u3 S r2 e | u4 S r3 e        (u = </unit><unit> a1..a10,
                                                                         S = <|speak|>, e = end)
    played_ms = 1500 (r0 and half of r1 played) -> P = 2 played units (a unit the client started
    to play counts: the user heard its beginning). played_ms None -> P = units sent (4 here).

The Thinker keeps what a session that said only the played units would hold: the last played
unit's end token becomes ``<|turn_eos|>`` (the turn closes where the user stopped hearing it),
the text of every later unit is removed (replaced by nothing: OpenAI truncate semantics) and
those units become listen units, their user audio kept::

    before   u1 S r0 e | u2 S r1 e  | u3 S r2 e | u4 S r3 e
    after    u1 S r0 e | u2 S r1 T  | u3 L      | u4 L                      (T = <|turn_eos|>, L = <|listen|>)
             kept ......... cut ^ drop the last tokens from here (Stage0Runner.drop_last_tokens),
                            then append T, u3 L, u4 L through the append path (u3, u4 re-computed)
    P = 0:   u1 L | u2 L | u3 L | u4 L      (cut after u1: the reply never happened)

Units whose rows are no longer kept (only the last :data:`MAX_REWIND_UNITS` reply units keep
theirs), or a cut that would reach into tokens the window already released, count as played.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from duplexcache.context.tokenizer import Tokenizer
from duplexcache.runtime.engine_api import OUTPUT_SAMPLE_RATE, ResponseUsage
from duplexcache.runtime.policy import MAX_UNIT_TOKENS, ControlTokens

if TYPE_CHECKING:
    from duplexcache.runtime.stage0.runner import Stage0Runner

logger = logging.getLogger(__name__)

TURN_MODES = ("duplex", "manual")
# Reply units whose appended rows are kept for a cancel's rewind (about 12 rows of the
# Thinker's hidden size each): a client that reports fewer played ms than this many units
# behind what was sent has the older units counted as played.
MAX_REWIND_UNITS = 8
# Most tokens one unit adds besides user text: </unit> <unit> + 10 audio rows + 20 decoded.
UNIT_TOKENS_BOUND = 2 + 10 + MAX_UNIT_TOKENS


@dataclass
class ReplyUnit:
    """One speaking unit of the reply in progress, as it sits in the Thinker's KV::

        rows (</unit> [user text] <unit> a1..a10)  <|speak|>  t1..tn  end
    """

    num_rows: int
    rows: torch.Tensor | None       # the appended rows, kept for a rewind (None once too old)
    num_text: int
    end_token: int
    audio_samples: int | None = None  # 24 kHz samples sent for this unit; None until sent

    @property
    def kv_tokens(self) -> int:
        return self.num_rows + 1 + self.num_text + 1


@dataclass
class TurnState:
    """Per-session turn state. The request fields (``mode`` .. ``replying``) are guarded by the
    engine lock; ``reply`` belongs to the tick thread."""

    mode: str = "duplex"
    response_requested: bool = False
    cancel_requested: bool = False
    cancel_played_ms: int | None = None
    pending_text: list[list[int]] = field(default_factory=list)
    replying: bool = False           # a reply is in progress (mirrors ``reply is not None``)
    reply: list[ReplyUnit] | None = None


@dataclass(frozen=True)
class UnitTurn:
    """The requests one unit takes (``take_unit_requests``, under the engine lock)."""

    force_speak: bool = False
    manual: bool = False
    user_text: tuple[int, ...] = ()


NO_REQUESTS = UnitTurn()


@dataclass(frozen=True)
class Rewind:
    """How a cancel rewrites the Thinker's tail: drop the last ``drop`` tokens, append
    ``close_token``, then each of ``listen_units`` followed by ``<|listen|>``."""

    played_units: int
    drop: int
    close_token: int
    listen_units: tuple[torch.Tensor, ...]

    @property
    def appended(self) -> int:
        return 1 + sum(r.shape[0] + 1 for r in self.listen_units)


def check_mode(mode: str) -> str:
    if mode not in TURN_MODES:
        raise ValueError(f"turn mode must be one of {TURN_MODES}, got {mode!r}")
    return mode


def take_unit_requests(state: TurnState) -> UnitTurn:
    """Consume what applies to the session's next unit (call under the engine lock)."""
    if not (state.response_requested or state.pending_text or state.mode != "duplex"):
        return NO_REQUESTS
    text = tuple(t for ids in state.pending_text for t in ids)
    turn = UnitTurn(force_speak=state.response_requested, manual=state.mode == "manual", user_text=text)
    state.response_requested = False
    state.pending_text = []
    return turn


def decide(turn: UnitTurn, state: TurnState, policy_decision: int, control: ControlTokens) -> int:
    """The unit's decision token: forced speak on a request, forced listen in manual mode
    outside a reply, else the policy's."""
    if turn.force_speak:
        return control.speak
    if turn.manual and state.reply is None:
        return control.listen
    return policy_decision


def user_text_ids(tokenizer: Tokenizer, text: str) -> list[int]:
    """A user message in the chat format of the session context's user turn
    (context/builder.py): ``\\n <|im_start|> user\\n{text} <|im_end|> \\n <|im_start|> assistant\\n``."""
    if not isinstance(text, str) or not text:
        raise ValueError(f"user text must be a non-empty str, got {text!r}")
    start, end = tokenizer.token_id("<|im_start|>"), tokenizer.token_id("<|im_end|>")
    return (tokenizer.encode("\n") + [start] + tokenizer.encode(f"user\n{text}") + [end]
            + tokenizer.encode("\n") + [start] + tokenizer.encode("assistant\n"))


def text_room(window_high: int | None, num_tokens: int, max_positions: int, block_size: int,
              unit_bound: int = UNIT_TOKENS_BOUND) -> int:
    """Most user-text tokens the session's next unit can take without ending the session.

    Window on: compaction keeps the anchor's last partial block and the session's partial last
    block (< 2 blocks) and must fit the incoming rows plus the unit's decoded tokens under the
    high mark. Window off (``window_high`` None): the model's positions, from ``num_tokens``.
    ``unit_bound``: the unit's tokens besides text (a video session's adds its frame's)."""
    if window_high is not None:
        return window_high - unit_bound - 2 * (block_size - 1)
    return max_positions - num_tokens - unit_bound


def note_unit(state: TurnState, rows: torch.Tensor, decision: int, tokens: list[int],
              control: ControlTokens) -> bool:
    """Record a finished Thinker unit; returns True when it starts a reply (the caller then
    sets ``state.replying`` under the engine lock)."""
    if decision != control.speak:
        return False
    started = state.reply is None
    if started:
        state.reply = []
    state.reply.append(ReplyUnit(rows.shape[0], rows, len(tokens) - 1, tokens[-1]))
    if len(state.reply) > MAX_REWIND_UNITS:
        state.reply[-MAX_REWIND_UNITS - 1].rows = None
    return started


def note_audio(state: TurnState, samples: int, final: bool = False) -> None:
    """A chunk went out (or failed: 0 samples): it belongs to the oldest unsent reply unit. A
    turn's final chunk is the tail of the last unit that sent audio (its carried codes and the
    vocoder's cross-fade tail), so it adds to that unit."""
    if final:
        for unit in reversed(state.reply or ()):
            if unit.audio_samples is not None:
                unit.audio_samples += samples
                return
    for unit in state.reply or ():
        if unit.audio_samples is None:
            unit.audio_samples = samples
            return
    logger.warning("audio chunk of %d samples with no unsent reply unit", samples)


def finish_reply(state: TurnState) -> ResponseUsage:
    """The reply's usage; the reply is over (the caller clears ``replying`` under the lock)."""
    units = state.reply or []
    state.reply = None
    text = sum(u.num_text for u in units)
    samples = sum(u.audio_samples or 0 for u in units)
    return ResponseUsage(text_tokens=text, audio_seconds=samples / OUTPUT_SAMPLE_RATE)


def played_units(reply: list[ReplyUnit], played_ms: int | None) -> int:
    """Reply units counted as played: every sent unit (None), or those whose audio started
    before ``played_ms`` (ms of this reply's audio the client played)."""
    sent = [u for u in reply if u.audio_samples is not None]
    if played_ms is None:
        return len(sent)
    played_samples = played_ms * OUTPUT_SAMPLE_RATE / 1000
    count, start = 0, 0
    for unit in sent:
        if start >= played_samples:
            break
        count += 1
        start += unit.audio_samples
    return count


def plan_rewind(reply: list[ReplyUnit], played_ms: int | None, contiguous_tail: int,
                control: ControlTokens) -> Rewind:
    """The tail rewrite of a cancel (see the module docstring). ``contiguous_tail``: how many of
    the session's last tokens the window has not cut into (``Stage0Runner.droppable_tail``)."""
    played = played_units(reply, played_ms)
    oldest = next((i for i, u in enumerate(reply) if u.rows is not None), len(reply))
    if max(played, 1) < oldest:
        logger.info("cancel: units before %d no longer kept; counted as played", oldest)
        played = oldest

    def drop(p: int) -> int:
        if p == 0:   # keep the first unit's rows, drop from its decision on
            return sum(u.kv_tokens for u in reply) - reply[0].num_rows
        return 1 + sum(u.kv_tokens for u in reply[p:])   # the last played unit's end token on

    while drop(played) > contiguous_tail and played < len(reply):
        played += 1   # the window released part of the reply: what it kept counts as played
    later = reply[max(played, 1):]
    return Rewind(played_units=played, drop=drop(played),
                  close_token=control.listen if played == 0 else control.turn_eos,
                  listen_units=tuple(u.rows for u in later))


def apply_rewind(stage0: Stage0Runner, sid: str, rewind: Rewind, close_row: torch.Tensor,
                 listen_row: torch.Tensor) -> Exception | None:
    """Rewrite ``sid``'s Thinker tail as ``rewind`` says, through the serving append path (the
    window applies, each re-appended unit is a unit start). Returns the session's error if an
    append ended it (the runner closed it), else None."""
    stage0.drop_last_tokens(sid, rewind.drop)
    steps = [(close_row, False)] + [(torch.cat([rows, listen_row.to(rows.dtype)]), True)
                                    for rows in rewind.listen_units]
    for embeds, unit_start in steps:
        result = stage0.append({sid: embeds}, unit_start=unit_start)
        if sid in result.errors:
            return result.errors[sid]
    return None
