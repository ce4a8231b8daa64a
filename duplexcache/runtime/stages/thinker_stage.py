"""The tick's listening half: opening sessions in Stage 0, the audio encoder and the Thinker.

Per unit, batched over sessions::

    audio encoder   stream_step: the unit's PCM -> 10 embeddings (per-session streaming KV)
    Thinker         append [</unit>] [user text] <unit> + 10 embeddings, then decode <= 20 tokens:
                    <|listen|>  |  <|speak|> text.. (<|chunk_eos|> | <|turn_eos|>)   (policy.py)

Ownership: ``Stage0Runner`` owns the Thinker sessions and their KV (through the
``KVCacheManager``); the encoder state is the ``EngineSession``'s; this stage fills each
``Unit``'s decision, tokens and hidden rows and never keeps state of its own between ticks.
A session whose work fails ends alone (``end``); the batch goes on without it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch

from duplexcache.context import SessionContextBuilder
from duplexcache.models.audio_encoder import AudioEncoder
from duplexcache.models.audio_encoder_graphs import EncoderGraphs
from duplexcache.runtime import turns
from duplexcache.runtime.engine_api import (INPUT_SAMPLE_RATE, EngineEvent, InvalidAudioError, ResponseDone, SessionError,
                                            TextDelta)
from duplexcache.runtime.engine_session import EndSession, EngineSession, SessionTable, Unit, end_all
from duplexcache.runtime.isolation import FaultInjector, Isolated, check_faults, precheck, run_isolated
from duplexcache.runtime.policy import MAX_UNIT_TOKENS, ControlTokens, StepLogits
from duplexcache.runtime.memory.session_sizing import session_window
from duplexcache.runtime.stage0.runner import SessionContextInput, Stage0Runner

logger = logging.getLogger(__name__)

EmbedTokens = Callable[[torch.Tensor], torch.Tensor]


class ThinkerStage:
    """Stage 0 opens, the encoder step and the Thinker's append + decode for a tick's units."""

    def __init__(self, stage0: Stage0Runner, encoder: AudioEncoder, builder: SessionContextBuilder,
                 tokenizer: Any, control: ControlTokens, policy: Any, embed: EmbedTokens, table: SessionTable,
                 end: EndSession, prefill_chunk_tokens: int, encoder_storage: torch.dtype | None = None,
                 encoder_graphs: EncoderGraphs | None = None) -> None:
        self.stage0 = stage0
        self.encoder = encoder
        self.encoder_graphs = encoder_graphs   # engine.cuda_graphs (None: the eager layers)
        self.encoder_storage = encoder_storage   # precision.encoder_cache_dtype (None: the weights' dtype)
        self.builder = builder
        self.tokenizer = tokenizer
        self.control = control
        self.policy = policy            # the engine's speak policy (tests may swap it)
        self.embed = embed
        self.table = table
        self.end = end
        self.prefill_chunk_tokens = prefill_chunk_tokens   # engine.prefill_chunk_tokens: Stage 0's chunk per call
        self.faults: FaultInjector | None = None
        self.frame_tokens = 0   # Thinker rows a frame adds to a video session's unit (set with model.vision)

    # ------------------------------------------------------------------ opening sessions

    def open_pending(self, pending: list[EngineSession], tick: int) -> list[EngineEvent]:
        """Build each new session's context (context cache on the way), queue it for its chunked
        prefill, and advance the prefills by one chunk (``prefill_chunk_tokens``).

        A session whose prefill takes more than the tick it was queued in would start that many
        seconds behind real time and stay behind (one unit per tick): when it opens, the audio
        that arrived while it prefilled is trimmed to its first unit (logged)."""
        events: list[EngineEvent] = []
        for sess in pending:
            if sess.prefill_tick is not None:
                continue  # already queued in Stage 0
            try:
                check_faults(self.faults, "open", (sess.sid,), "precheck")
                sess.encoder_state = self.encoder.new_stream_state(storage_dtype=self.encoder_storage)
                ctx = self.builder.build(sess.config.instructions, sess.voice.ref_audio,
                                         sess.config.initial_user_text, encoder_state=sess.encoder_state)
                context = SessionContextInput(ctx.inputs_embeds, ctx.token_ids, ctx.extra_key)
                # The window its footprint reserved.
                self.stage0.enqueue_open(sess.sid, context, session_window(sess.config))
            except Exception as err:  # noqa: BLE001 - one session's context never fails the tick
                events.append(self.end(sess, err))
                continue
            sess.prefill_tick = tick
        result = self.stage0.prefill(self.prefill_chunk_tokens)
        by_sid = {s.sid: s for s in pending}
        for sid, err in result.errors.items():
            if sid in by_sid:
                events.append(self.end(by_sid[sid], err))
        for sid in result.opened:
            sess = by_sid.get(sid)
            if sess is None:   # closed while this tick ran: freed at the start of the next
                continue
            sess.opened = True
            if sess.prefill_tick is not None and sess.prefill_tick < tick:
                self._trim_after_prefill(sess, tick)
        return events

    def _trim_after_prefill(self, sess: EngineSession, tick: int) -> None:
        drop = self.table.trim_audio(sess, self.encoder.cfg.first_chunk_samples)
        if drop > 0:
            logger.info("session %s: prefill took %d ticks; dropped %.2f s of audio received meanwhile",
                        sess.sid, tick - (sess.prefill_tick or 0) + 1, drop / INPUT_SAMPLE_RATE)

    # ------------------------------------------------------------------ audio encoder

    def encode(self, units: list[Unit], events: list[EngineEvent]) -> tuple[list[Unit], list[torch.Tensor]]:
        """One batched encoder step; a session whose audio fails ends alone (runtime/isolation.py)."""
        enc = self.encoder
        _, errors = precheck(self.faults, "encoder", units, lambda u: u.session.sid, _check_unit_audio)
        units = end_all(units, errors, events, self.end)

        def run(batch: list[Unit]) -> list[torch.Tensor]:
            return enc.stream_step([u.session.encoder_state for u in batch], [torch.from_numpy(u.pcm) for u in batch],
                                   graphs=self.encoder_graphs)

        def snapshot(u: Unit) -> tuple[int, int, int]:
            st = u.session.encoder_state
            return st.num_frames, st.num_chunks, st.num_resets

        def restore(u: Unit, saved: object) -> None:
            st = u.session.encoder_state
            st.num_frames, st.num_chunks, st.num_resets = saved  # type: ignore[misc]

        iso: Isolated[Unit, list[torch.Tensor]] = run_isolated(
            "encoder", units, run, lambda u: u.session.sid, self.faults, snapshot, restore)
        end_all(units, iso.errors, events, self.end)
        return iso.kept, iso.result or []

    # ------------------------------------------------------------------ Thinker

    def run(self, units: list[Unit], embeds: list[torch.Tensor], events: list[EngineEvent]) -> list[Unit]:
        """Append each unit's audio, then decode until every session listened or ended its text."""
        c = self.control
        kept, errors = precheck(self.faults, "thinker", list(zip(units, embeds)), lambda ue: ue[0].session.sid)
        end_all(units, errors, events, self.end)
        units = [u for u, _ in kept]
        embeds = [e for _, e in kept]
        inputs = {}
        for u, emb in zip(units, embeds):
            text = self._user_text_for(u, events)
            ids = ([c.unit_end] if u.session.unit_index > 0 else []) + text + [c.unit]
            tok = self.embed(torch.tensor(ids, dtype=torch.long))
            # a camera frame sits between <unit> and the audio (runtime/stages/vision_stage.py)
            frame = [] if u.frame_rows is None else [u.frame_rows.to(tok.dtype)]
            u.rows = inputs[u.session.sid] = torch.cat([tok, *frame, emb.to(tok.dtype)], dim=0)
        by_sid = {u.session.sid: u for u in units}
        result = self.stage0.append(inputs, unit_start=True)
        self._drop_failed(by_sid, result.errors, events)
        feed = {}
        step = StepLogits(result.logits)   # policies' argmaxes: one batched pick per step
        for sid in result.logits:
            u = by_sid[sid]
            decision = self.policy.decide(u.session.unit_index, step.row(sid), u.session.policy_state, u.pcm,
                                          u.ahead)
            # The decision fed back (into the KV) is the turn-forced one, so the model sees it.
            u.decision = turns.decide(u.turn, u.session.turn, decision, c)
            feed[sid] = u.decision
        while feed:
            result = self.stage0.decode(feed)
            self._drop_failed(by_sid, result.errors, events)
            step = StepLogits(result.logits)
            nxt = {}
            for sid, fed in feed.items():
                if sid in result.errors or fed == c.listen or fed in c.ends:
                    continue  # the unit is complete: its last token is now in the KV
                u = by_sid[sid]
                num_text = len(u.tokens)
                if num_text >= MAX_UNIT_TOKENS - 2:
                    tok = c.chunk_eos   # decision + 18 text + end = 20 tokens
                else:
                    tok = self.policy.next_token(u.session.unit_index, num_text, step.row(sid),
                                                 u.session.policy_state)
                u.tokens.append(tok)
                u.hidden.append(result.hidden[sid])   # the row whose logits chose ``tok``
                nxt[sid] = tok
            feed = nxt
        return [u for u in units if u.session.sid in by_sid]

    def _drop_failed(self, by_sid: dict[str, Unit], errors: Mapping[str, Exception], events: list[EngineEvent]) -> None:
        for sid, err in errors.items():
            u = by_sid.pop(sid, None)
            if u is not None:
                events.append(self.end(u.session, err))

    def text_events(self, units: list[Unit]) -> list[EngineEvent]:
        """Each unit's text (end tokens left out) as a ``TextDelta``."""
        events: list[EngineEvent] = []
        for u in units:
            text = [tok for tok in u.tokens if tok not in self.control.ends]
            if text:
                events.append(TextDelta(u.session.sid, self._detokenize(text)))
        return events

    def end_text_replies(self, units: list[Unit]) -> list[EngineEvent]:
        """The reply ends of text-only sessions (``audio_output`` off), whose units skip the
        Talker and Code2Wav: a speaking unit's text is all it sends (recorded as sent, 0 audio
        samples, so a cancel keeps it), and its reply ends where a voiced reply's audio turn
        would: at ``<|turn_eos|>``, or at a listen after speaking."""
        events: list[EngineEvent] = []
        c = self.control
        for u in units:
            s = u.session
            if u.decision == c.speak:
                turns.note_audio(s.turn, 0)
                if u.tokens and u.tokens[-1] == c.turn_eos:
                    events.append(ResponseDone(s.sid, "completed", self.table.finish_reply(s)))
            elif s.turn.reply is not None:
                events.append(ResponseDone(s.sid, "completed", self.table.finish_reply(s)))
        return events

    def _detokenize(self, ids: list[int]) -> str:
        inner = getattr(self.tokenizer, "_tok", None)
        if inner is not None:
            return inner.decode(ids)
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

    # ------------------------------------------------------------------ user text and cancels

    def user_text_room(self, sess: EngineSession) -> int:
        """Tokens of user text that fit before ``sess``'s next unit (turns.text_room)."""
        window = session_window(sess.config)
        # An int read of the tick thread's state: at most one tick old, and the tick checks again.
        try:
            have = self.stage0.num_tokens(sess.sid) if sess.opened else 0
        except ValueError:   # not in Stage 0 (yet, or any more)
            have = 0
        return turns.text_room(window.high_tokens if window.enabled else None, have,
                               self.stage0.max_positions, self.stage0.block_size,
                               turns.UNIT_TOKENS_BOUND + (self.frame_tokens if sess.config.video else 0))

    def _user_text_for(self, u: Unit, events: list[EngineEvent]) -> list[int]:
        """The unit's user text ids, checked again on the tick thread (the session moved on since
        ``add_user_text``); refused text is dropped with a non-fatal error."""
        text = list(u.turn.user_text)
        if text and len(text) > self.user_text_room(u.session):
            events.append(SessionError(u.session.sid, "user_text_too_long",
                                       f"user text of {len(text)} tokens no longer fits the session; dropped"))
            return []
        return text

    def cancel_reply(self, sess: EngineSession, played_ms: int | None,
                     drop_turn: Callable[[EngineSession], None]) -> list[EngineEvent]:
        """Drop the audio turn (``drop_turn``: carried codes, Code2Wav stream, Talker KV); rewind the
        Thinker to what was played (turns.py); then ResponseDone(cancelled)."""
        reply = sess.turn.reply
        if reply is None or not sess.opened:
            return []
        if not sess.config.audio_output:
            played_ms = None   # a text-only reply played nothing: all of its text was sent
        rewind = turns.plan_rewind(reply, played_ms, self.stage0.droppable_tail(sess.sid), self.control)
        drop_turn(sess)
        close, listen = self.embed(torch.tensor([rewind.close_token, self.control.listen]))
        err = turns.apply_rewind(self.stage0, sess.sid, rewind, close[None], listen[None])
        usage = self.table.finish_reply(sess)
        logger.info("session %s: reply cancelled after %d of %d units played (%d Thinker tokens dropped, %d appended)",
                    sess.sid, rewind.played_units, len(reply), rewind.drop, rewind.appended)
        events: list[EngineEvent] = [ResponseDone(sess.sid, "cancelled", usage)]
        if err is not None:
            events.append(self.end(sess, err))
        return events


def _check_unit_audio(u: Unit) -> None:
    """What the encoder would refuse for this session alone (push_audio checked it already)."""
    if not np.isfinite(u.pcm).all() or float(np.abs(u.pcm).max(initial=0.0)) > 1.0:
        raise InvalidAudioError("audio samples must be finite float PCM in [-1, 1]")
