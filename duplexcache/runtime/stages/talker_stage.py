"""The tick's Talker stage: 25 codes for every speaking unit, batched over sessions.

Condition per speaking unit: the unit's text + end token with the Thinker hidden states that
produced them (``Unit.tokens`` / ``Unit.hidden``). The Talker's KV is kept for the audio turn
and reset when the turn ends; its blocks come from ``kv/talker_blocks.TalkerBlocks``, which
admission sized for a full turn (``turn_tokens``: ``engine.talker_turn_tokens``, by default the
Talker's ``max_position_embeddings``) per live session::

    turn   unit 1                         unit 2
    KV     [text1 end1 c1..c25 eos] ..... [text2 end2 c1..c25 eos] ...   <= turn_tokens
    a unit that would pass the limit closes the audio turn (final chunk, no ResponseDone: the
    Thinker's turn goes on) and starts a new one with an empty KV.
"""

from __future__ import annotations

import logging

import torch

from duplexcache.kv.decode_graphs import PagedDecodeGraphs
from duplexcache.kv.paged_attention import PagedKVCache
from duplexcache.kv.talker_blocks import TalkerBlocks
from duplexcache.models.talker import Talker, TalkerUnitRequest, generate_unit
from duplexcache.runtime.stages.code2wav_stage import Code2WavStage
from duplexcache.runtime.engine_api import EngineEvent
from duplexcache.runtime.engine_session import EndSession, FinalChunk, Unit, end_all, ended
from duplexcache.runtime.isolation import FaultInjector, precheck, run_isolated
from duplexcache.runtime.policy import ControlTokens
from duplexcache.runtime.memory.session_sizing import resolve_turn_tokens

logger = logging.getLogger(__name__)


class TalkerStage:
    """Speaking units -> codes, over one Talker, its paged cache and ``TalkerBlocks``."""

    def __init__(self, talker: Talker, cache: PagedKVCache, kv: TalkerBlocks, graphs: PagedDecodeGraphs | None,
                 control: ControlTokens, audio: Code2WavStage, end: EndSession, turn_tokens: int,
                 ragged_graphs: bool = False) -> None:
        self.talker = talker
        self.turn_tokens = resolve_turn_tokens(turn_tokens, talker.config)   # what admission reserved
        self.cache = cache
        self.kv = kv
        self.graphs = graphs
        self.ragged_graphs = ragged_graphs   # engine.cuda_graphs: the condition step through the graphs too
        self.control = control
        self.audio = audio              # ends audio turns (the turn's stream and Talker KV go together)
        self.end = end
        self.faults: FaultInjector | None = None

    def run(self, units: list[Unit], events: list[EngineEvent]) -> dict[str, FinalChunk]:
        """25 codes for each speaking unit. Returns carried codes to flush as final chunks of turns
        that end before this unit (a listen after speaking, or a Talker turn at its limit).
        A session whose Talker work fails ends alone (``events``); the others keep their codes."""
        finals: dict[str, FinalChunk] = {}
        cfg = self.talker.config
        speakers = []
        for u in units:
            s = u.session
            if u.decision != self.control.speak:
                if s.c2w_sid is not None:   # stopped speaking: the turn is over
                    self.audio.close_turn(s, finals)
                continue
            need = len(u.tokens) + cfg.tokens_per_unit + 1
            have = self.kv.num_tokens(s.sid)
            if have + need > self.turn_tokens:
                logger.info("session %s: Talker turn at %d tokens; starting a new audio turn", s.sid, have)
                self.audio.close_turn(s, finals, response_done=False)   # the Thinker's turn goes on
            self.kv.grow(s.sid, self.kv.num_tokens(s.sid) + need)
            speakers.append(u)
        if not speakers:
            return finals
        _, errors = precheck(self.faults, "talker", speakers, lambda u: u.session.sid)
        speakers = end_all(speakers, errors, events, self.end)

        def run(batch: list[Unit]) -> list:
            # the hidden rows as they are: generate_unit stacks every unit's at once
            reqs = [TalkerUnitRequest(self.kv.block_table(u.session.sid), self.kv.num_tokens(u.session.sid),
                                      torch.tensor(u.tokens, dtype=torch.long), u.hidden)
                    for u in batch]
            return generate_unit(self.talker, self.cache, reqs, graphs=self.graphs, ragged_graphs=self.ragged_graphs)

        # A retry rewrites the same Talker KV slots (the computed length only moves below), so a
        # failed batch is probed per session (runtime/isolation.py).
        iso = run_isolated("talker", speakers, run, lambda u: u.session.sid, self.faults)
        end_all(speakers, iso.errors, events, self.end)
        for u, res in zip(iso.kept, iso.result or []):
            self.kv.set_num_computed(u.session.sid, res.num_computed)
            u.session.talker_units += 1
            u.codes = res.codes[: cfg.tokens_per_unit]
        return self.audio.drop_ended_finals(finals, ended(events))
