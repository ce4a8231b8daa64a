"""Stage 0 runtime: many duplex sessions over one Thinker and one paged KV pool.

``Stage0Runner`` owns the Stage 0 sessions. It asks the ``KVCacheManager`` for blocks (the
manager owns block tables and ref counts), applies the anchor-protected window, and runs
every step as ONE ragged ``Thinker.forward_paged`` over all sessions in the call.

Session layout (block size 16, a 40-token context, sharing on)::

    logical idx  0 ........ 15 | 16 ....... 31 | 32 .. 39 40 .. 47 | 48 ...
    table        [shared full 0][shared full 1 ][private tail       ][private ...
                 \\______ anchor: sink_blocks = ceil(40/16) = 3 ______/
                  ref_cnt = number of sessions   tail: copy of a read-only template
                  with this context              (copy-on-write), then appended into

Opening sessions (one call, one forward):

1. ``allocate_context`` per session, in call order. A session whose full blocks were
   allocated earlier in the same call hits them (no duplicate blocks); their K/V is written
   in the same forward before any attention reads it (design.md contract).
2. ``cow_pairs`` (a ready template) are copied before the forward; the tail is not computed.
3. One forward over every session's missed tokens ``[compute_start, compute_end)``.
4. ``template_pairs`` (a new template from the tail just computed) are copied, then the
   ``deferred_cow_pairs`` the manager reported for sessions whose template was created
   earlier in this same call ("deferred copy-on-write": their tails are not computed, and
   every session with one context gets bit-identical K/V).
5. ``commit_context``.

Appending (``append`` / ``decode``), per session before the forward:

* window ``basic``: ``plan_compaction`` -> ``drop_blocks`` -> ``rerotate_keys_`` of the kept
  blocks after the anchor by ``-delta`` (anchor blocks are never rotated or written; V is
  untouched; nothing is copied).
* window ``rebuild`` (A/B reference only): ``truncate`` the session to its anchor blocks
  (every block after them is released, the partial last one included), then re-prefill the
  kept tokens from the session's own input history in the same forward.
* window ``off``: no compaction; past the model's position limit or with the pool full the
  session ends with ``ContextLengthExceeded``.

Per-session windows: every session has its own ``WindowConfig`` (given at open, default the
runner's). Only the marks may differ between sessions, never the mode; a session's compaction
and its worst case use its own marks.

Results: ``append`` / ``decode`` return, per session, the logits of its last new token and the
final-norm hidden state that produced them (``StepResult.hidden``, the exact row ``lm_head``
consumed). The Talker is conditioned on those rows, so the runner hands them out rather than
letting callers tap the lm_head.

A session that cannot continue is closed (its blocks freed) and its error is returned in
``StepResult.errors``; the other sessions of the call continue.

Files: the runner's batching is here; the typed objects and the worst-case formula are in
``stage0_types.py``, the per-session window state, compaction and truncation in
``stage0_window.py`` (every public name is re-exported from this module).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from duplexcache.kv.kv_cache_manager import (
    ContextAllocation,
    KVCacheManager,
    PoolStats,
    SessionBytes,
)
from duplexcache.kv.decode_graphs import PagedDecodeGraphs
from duplexcache.kv.paged_attention import PagedBatch, PagedKVCache, copy_blocks, last_token_rows
from duplexcache.kv.window import ContextLengthExceeded, WindowConfig, plan_compaction
from duplexcache.runtime.isolation import FaultInjector, check_faults, run_isolated
from duplexcache.runtime.stage0.types import (
    BlockBudgetTooSmall,
    PrefillResult,
    SessionContextInput,
    StepResult,
    WorstCaseBlocks,
    session_longest_tokens,
    session_worst_case,
)
from duplexcache.runtime.stage0.window import (
    SessionHistory,
    Stage0Session,
    compact_basic,
    compact_rebuild,
    drop_last_tokens,
    droppable_tail,
    stage0_session_bytes,
)

if TYPE_CHECKING:
    from duplexcache.models.thinker import Thinker

logger = logging.getLogger(__name__)

__all__ = [
    "BlockBudgetTooSmall",
    "ContextLengthExceeded",
    "PrefillResult",
    "SessionContextInput",
    "Stage0Runner",
    "StepResult",
    "WorstCaseBlocks",
    "session_longest_tokens",
    "session_worst_case",
    "stage0_session_bytes",
]


@dataclass
class _Work:
    """One session's slice of a ragged forward."""

    sid: str
    num_computed: int
    embeds: torch.Tensor  # (num_new, H)
    wants_logits: bool = True


@dataclass
class _Prefill:
    """A session waiting for (or in the middle of) its chunked context prefill."""

    sid: str
    context: SessionContextInput
    window: WindowConfig
    alloc: ContextAllocation | None = None  # set when it reaches the head of the queue
    cursor: int = 0                          # first context token not computed yet


class Stage0Runner:
    """Stage 0 sessions over a Thinker, a ``KVCacheManager`` and its ``PagedKVCache``."""

    def __init__(
        self,
        thinker: Thinker,
        kv_manager: KVCacheManager,
        kv_cache: PagedKVCache,
        window: WindowConfig,
        share_context: bool,
        block_size: int = 16,
    ) -> None:
        if block_size != kv_manager.block_size or block_size != kv_cache.block_size:
            raise ValueError(
                f"block_size {block_size} must equal the manager's ({kv_manager.block_size}) "
                f"and the cache's ({kv_cache.block_size})"
            )
        if kv_cache.num_blocks != kv_manager.pool.num_blocks:
            raise ValueError(
                f"KV cache has {kv_cache.num_blocks} blocks but the manager's pool has {kv_manager.pool.num_blocks}"
            )
        self.thinker = thinker
        self.manager = kv_manager
        self.cache = kv_cache
        self.window = window
        self.share_context = share_context
        self.block_size = block_size
        self.max_positions = int(thinker.config.max_position_embeddings)
        self.sessions: dict[str, Stage0Session] = {}
        self.compactions = 0   # window compactions applied since start, every session (/metrics)
        # One-token steps replay CUDA graphs when the engine installs them (use_decode_graphs).
        self.decode_graphs: PagedDecodeGraphs | None = None
        self.ragged_graphs = False
        # Chunked opens (enqueue_open / prefill), FIFO; only the head holds blocks.
        self._prefills: OrderedDict[str, _Prefill] = OrderedDict()
        # Test hook (runtime/isolation.py): None when serving.
        self.faults: FaultInjector | None = None

    def use_decode_graphs(self, graphs: PagedDecodeGraphs | None, ragged_steps: bool = False) -> None:
        """Run decode steps (one new token per session) through ``graphs``; None: eager.
        ``ragged_steps`` (``engine.cuda_graphs`` with ``stage0.ragged_kernel``): short ragged steps (a unit's append)
        too, as one row per token, when they fit (``PagedDecodeGraphs.accepts_ragged``)."""
        if graphs is not None and graphs.cache is not self.cache:
            raise ValueError("decode graphs were built over another KV cache")
        self.decode_graphs = graphs
        self.ragged_graphs = graphs is not None and ragged_steps

    # ------------------------------------------------------------------ admission

    def session_window(self, sid: str) -> WindowConfig:
        """The window ``sid`` compacts with (its own marks, the runner's mode)."""
        if sid not in self.sessions:
            raise ValueError(f"unknown session {sid!r}")
        return self.sessions[sid].window

    def _resolve_window(self, window: WindowConfig | None, sid: str = "") -> WindowConfig:
        """``window`` or the runner's default; ValueError if it is not a ``WindowConfig`` of the
        runner's mode (one mode per runner: ``rebuild`` keeps histories, ``off`` sizes pools by
        the model's positions; only the marks are per session)."""
        if window is None:
            return self.window
        if not isinstance(window, WindowConfig):
            raise ValueError(f"session {sid!r}: window must be a WindowConfig, got {type(window).__name__}")
        if window.mode != self.window.mode:
            raise ValueError(
                f"session {sid!r}: window mode {window.mode!r} differs from the runner's {self.window.mode!r}; "
                "only the high/low marks may differ per session"
            )
        return window

    def longest_tokens(self, prefix_len: int, window: WindowConfig | None = None) -> int:
        """The most tokens one session's table can hold (``session_longest_tokens``) with
        ``window`` (default: the runner's)."""
        return session_longest_tokens(prefix_len, self._resolve_window(window), self.max_positions)

    def worst_case(self, prefix_len: int, window: WindowConfig | None = None) -> WorstCaseBlocks:
        """Blocks one session with ``window`` (default: the runner's) references at its longest;
        the formula and its diagram are in ``session_worst_case``."""
        return session_worst_case(prefix_len, self._resolve_window(window), self.max_positions,
                                  self.block_size, self.share_context)

    def worst_case_blocks(self, prefix_len: int, window: WindowConfig | None = None) -> int:
        """Blocks one session may hold at once (table at its longest + template reference)."""
        return self.worst_case(prefix_len, window).total

    def check_fits_alone(self, context: SessionContextInput, window: WindowConfig | None = None) -> None:
        """Raise ``BlockBudgetTooSmall`` (numbers named) if one session alone cannot fit the pool.

        With a window that is its worst case; with window ``off`` there is no bound but the
        model's positions, so only the context (+ template) must fit: such a session ends with
        ``context_length_exceeded`` when the pool runs out.
        """
        window = self._resolve_window(window)
        wc = self.worst_case(context.prefix_len, window)
        if window.enabled:
            need = wc.total
        else:
            need = self.manager.blocks_for_tokens(context.prefix_len) + wc.template_blocks
        have = self.manager.pool.num_usable_blocks
        if need > have:
            raise BlockBudgetTooSmall(
                f"one session needs up to {need} blocks of {self.block_size} tokens (context "
                f"{context.prefix_len} + window high {window.high_tokens if window.enabled else 0} "
                f"tokens) but the KV pool has only {have} usable blocks"
            )

    def can_open(self, context: SessionContextInput, window: WindowConfig | None = None) -> bool:
        """Whether ``open_session`` would get its blocks now (cache hits counted).

        Raises ``BlockBudgetTooSmall`` if the session could never fit, even in an empty pool.
        """
        self.check_fits_alone(context, window)
        return self.manager.can_allocate_context(context.token_ids, context.extra_key, self.share_context)

    # ------------------------------------------------------------------ open / close

    def open_session(self, sid: str, context: SessionContextInput, window: WindowConfig | None = None) -> None:
        """Open one session with ``window`` (None: the runner's); raises its error
        (``ContextLengthExceeded``, ``OutOfBlocks``...)."""
        result = self.open_sessions({sid: context}, None if window is None else {sid: window})
        if sid in result.errors:
            raise result.errors[sid]

    def open_sessions(self, contexts: Mapping[str, SessionContextInput],
                      windows: Mapping[str, WindowConfig] | None = None) -> StepResult:
        """Open several sessions, prefilling only the context tokens that missed the shared cache.
        ``windows[sid]`` is that session's window (missing: the runner's). Returns errors for
        sessions that could not open (others proceed). Logits are not returned: a full cache
        hit computes nothing.

        Each session's missed tokens run in a forward of their own, not one batched forward:
        GPU GEMMs pick kernels by row count, so a context prefilled inside a 2-session batch
        differs in the last bits from the same context prefilled alone, and with sharing on
        the context is prefilled once (alone) while with sharing off every session prefills
        it. Prefilling each session alone makes the unshared K/V bit-identical to the shared
        copy (seen on an H200: batched opens made shared vs unshared audio differ). A context
        recomputed only partly (its first blocks evicted, or a tail whose template was evicted)
        is computed with fewer rows and may still differ in the last bits."""
        windows = dict(windows or {})
        unknown = sorted(set(windows) - set(contexts))
        if unknown:
            raise ValueError(f"windows given for sessions not being opened: {unknown}")
        resolved = {sid: self._resolve_window(windows.get(sid), sid) for sid in contexts}
        for sid, ctx in contexts.items():  # caller mistakes raise before anything is allocated
            self._validate_context(sid, ctx, resolved[sid])
        result = StepResult()
        allocs: dict[str, ContextAllocation] = {}
        for sid, ctx in contexts.items():
            err = self._admission_error(sid, ctx, resolved[sid])
            if err is not None:
                logger.info("session %s refused: %s", sid, err)
                result.errors[sid] = err
                continue
            allocs[sid] = self.manager.allocate_context(sid, ctx.token_ids, ctx.extra_key, self.share_context)
            hist = SessionHistory(ctx.prefix_len) if self.window.mode == "rebuild" else None
            self.sessions[sid] = Stage0Session(sid, ctx.prefix_len, resolved[sid], history=hist)
        if not allocs:
            return result
        copy_blocks(self.cache, [p for a in allocs.values() for p in a.cow_pairs])
        work = [_Work(sid, a.compute_start, contexts[sid].inputs_embeds[a.compute_start:a.compute_end],
                      wants_logits=False) for sid, a in allocs.items()]
        for w in work:
            if w.embeds.shape[0] > 0:
                self._forward([w])
        # Templates first: a deferred copy reads a template that a template copy just filled.
        copy_blocks(self.cache, [p for a in allocs.values() for p in a.template_pairs])
        copy_blocks(self.cache, [p for a in allocs.values() for p in a.deferred_cow_pairs])
        for sid in allocs:
            self.manager.commit_context(sid)
        logger.debug("opened %d sessions: %d cached tokens, %d computed", len(allocs),
                     sum(a.num_cached_tokens for a in allocs.values()), sum(w.embeds.shape[0] for w in work))
        return result

    def _validate_context(self, sid: str, ctx: SessionContextInput, window: WindowConfig) -> None:
        """Caller mistakes: raise ValueError (or ``BlockBudgetTooSmall``) naming the problem."""
        if sid in self.sessions:
            raise ValueError(f"session {sid!r} is already open")
        if ctx.inputs_embeds.shape[1] != self.thinker.config.hidden_size:
            raise ValueError(
                f"session {sid!r}: context embeddings have width {ctx.inputs_embeds.shape[1]}, "
                f"the Thinker's hidden size is {self.thinker.config.hidden_size}"
            )
        self.check_fits_alone(ctx, window)

    def _admission_error(self, sid: str, ctx: SessionContextInput, window: WindowConfig) -> Exception | None:
        """Why ``sid`` cannot open now (its error, returned for that session only), or None."""
        longest = ctx.prefix_len + (window.high_tokens if window.enabled else 0)
        if longest > self.max_positions:
            return ContextLengthExceeded(
                f"context_length_exceeded: session {sid!r}: context of {ctx.prefix_len} tokens + window "
                f"high {longest - ctx.prefix_len} exceeds the model's {self.max_positions} positions"
            )
        if not self.manager.can_allocate_context(ctx.token_ids, ctx.extra_key, self.share_context):
            need = self.manager.num_blocks_needed(ctx.token_ids, ctx.extra_key, self.share_context)
            return ContextLengthExceeded(
                f"context_length_exceeded: session {sid!r}: context of {ctx.prefix_len} tokens needs "
                f"{need} free blocks, the KV pool has {self.manager.pool.num_free}"
            )
        return None

    # ------------------------------------------------------------------ chunked open

    def enqueue_open(self, sid: str, context: SessionContextInput, window: WindowConfig | None = None) -> None:
        """Queue ``sid`` for a chunked open (``prefill``); caller mistakes raise here.

        The engine's path: a context of any allowed length adds at most one chunk to a tick.
        Sessions open in FIFO order and only the head holds blocks, so no session can hit a
        shared block whose K/V is not computed yet (a later session allocates only after the
        earlier one committed its context). Do not mix with ``open_sessions`` while a prefill
        is in flight."""
        if sid in self._prefills:
            raise ValueError(f"session {sid!r} is already waiting for its prefill")
        resolved = self._resolve_window(window, sid)
        self._validate_context(sid, context, resolved)
        self._prefills[sid] = _Prefill(sid, context, resolved)

    def is_prefilling(self, sid: str) -> bool:
        """True while ``sid`` waits for, or is in the middle of, its chunked prefill."""
        return sid in self._prefills

    def prefill(self, chunk_tokens: int) -> PrefillResult:
        """Advance the queued opens by at most ``chunk_tokens`` computed tokens in all.

        Chunks are aligned to multiples of ``chunk_tokens`` from token 0 of each context (a
        chunk that does not fit this call's budget waits for the next call), so a context is
        computed with the same chunks whatever else opened in the same tick: sharing on and
        off stay bit-identical. Each chunk is a forward of its own (the session alone, as
        ``open_sessions`` does for bit-exactness), over the paged path: attention is
        (chunk x context) per layer, never (context x context). A full cache hit costs nothing."""
        if chunk_tokens < 1:
            raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
        result = PrefillResult()
        left = chunk_tokens
        while self._prefills:
            p = next(iter(self._prefills.values()))
            if p.alloc is None and not self._start_prefill(p, result):
                continue
            assert p.alloc is not None
            while p.cursor < p.alloc.compute_end:
                end = min((p.cursor // chunk_tokens + 1) * chunk_tokens, p.alloc.compute_end)
                if end - p.cursor > left:
                    return result  # the next chunk waits for the next call
                try:
                    check_faults(self.faults, "open", (p.sid,), "batched")
                    self._forward([_Work(p.sid, p.cursor, p.context.inputs_embeds[p.cursor:end], wants_logits=False)])
                except Exception as err:  # noqa: BLE001 - a failed prefill ends that session only
                    logger.warning("session %s: context prefill failed at token %d: %s", p.sid, p.cursor, err)
                    self._cancel_prefill(p.sid)
                    result.errors[p.sid] = err
                    break
                left -= end - p.cursor
                result.computed_tokens += end - p.cursor
                p.cursor = end
            else:
                self._finish_prefill(p)
                result.opened.append(p.sid)
        return result

    def _start_prefill(self, p: _Prefill, result: PrefillResult) -> bool:
        """Allocate the head's context; False (its error recorded, it leaves the queue) if it cannot."""
        err = self._admission_error(p.sid, p.context, p.window)
        if err is not None:
            logger.info("session %s refused: %s", p.sid, err)
            del self._prefills[p.sid]
            result.errors[p.sid] = err
            return False
        ctx = p.context
        p.alloc = self.manager.allocate_context(p.sid, ctx.token_ids, ctx.extra_key, self.share_context)
        # Only the head allocates, after every earlier open committed: no template is pending.
        assert not p.alloc.deferred_cow_pairs, "chunked open found a pending template"
        copy_blocks(self.cache, list(p.alloc.cow_pairs))
        p.cursor = p.alloc.compute_start
        return True

    def _finish_prefill(self, p: _Prefill) -> None:
        assert p.alloc is not None
        copy_blocks(self.cache, list(p.alloc.template_pairs))
        self.manager.commit_context(p.sid)
        hist = SessionHistory(p.context.prefix_len) if self.window.mode == "rebuild" else None
        self.sessions[p.sid] = Stage0Session(p.sid, p.context.prefix_len, p.window, history=hist)
        del self._prefills[p.sid]
        logger.debug("session %s opened: %d cached tokens, %d computed", p.sid, p.alloc.num_cached_tokens,
                     p.alloc.num_tokens_to_compute)

    def _cancel_prefill(self, sid: str) -> None:
        p = self._prefills.pop(sid)
        if p.alloc is not None:
            self.manager.abandon_context(sid, p.cursor)

    def close_session(self, sid: str) -> None:
        """Free every block of ``sid`` (shared ones stay cached until memory is needed); a
        session still waiting for its prefill leaves the queue (blocks it registered but did
        not compute lose their hash)."""
        if sid in self._prefills:
            self._cancel_prefill(sid)
            return
        if sid not in self.sessions:
            raise ValueError(f"unknown session {sid!r}")
        del self.sessions[sid]
        self.manager.free(sid)

    # ------------------------------------------------------------------ steps

    def append(self, inputs: Mapping[str, torch.Tensor], unit_start: bool) -> StepResult:
        """Append ``inputs[sid]`` (n, H) to each session in one ragged forward; returns the
        logits of each session's last new token and its final-norm hidden state
        (``StepResult.hidden``). ``unit_start``: the first input token of
        every session begins a unit (``<unit>``), which the window cut prefers to align to."""
        for sid, embeds in inputs.items():  # caller mistakes raise before any session changes
            self._check_input(sid, embeds)
        result = StepResult()
        work: list[_Work] = []
        for sid, embeds in inputs.items():
            try:
                work.append(self._prepare(sid, embeds, unit_start))
            except ContextLengthExceeded as err:
                logger.info("session %s ended: %s", sid, err)
                self.close_session(sid)
                result.errors[sid] = err
        if work:
            # A forward that raises is probed session by session (runtime/isolation.py): the
            # culprits end here, the others re-run as one batch (their KV slots are rewritten).
            iso = run_isolated("thinker", work, self._forward, lambda w: w.sid, self.faults)
            for sid, err in iso.errors.items():
                self.close_session(sid)
                result.errors[sid] = err
            if iso.result is not None:
                result.logits, result.hidden = iso.result
            work = iso.kept
        for w in work:
            sess = self.sessions[w.sid]
            if sess.history is not None:
                sess.history.append(inputs[w.sid])
        return result

    def decode(self, tokens: Mapping[str, int]) -> StepResult:
        """One token per session (e.g. the sampled text token), batched; logits and hidden
        state of that token per session, as ``append``."""
        if not tokens:
            return StepResult()
        sids = list(tokens)
        # Host ids: Thinker.embed checks their range on the host and copies them without a sync.
        ids = torch.tensor([int(tokens[s]) for s in sids], dtype=torch.long)
        with torch.no_grad():
            embeds = self.thinker.embed(ids)  # (B, H)
        return self.append({sid: embeds[i:i + 1] for i, sid in enumerate(sids)}, unit_start=False)

    def _check_input(self, sid: str, embeds: torch.Tensor) -> None:
        if sid not in self.sessions:
            raise ValueError(f"unknown session {sid!r}")
        if embeds.dim() != 2 or embeds.shape[0] == 0 or embeds.shape[1] != self.thinker.config.hidden_size:
            raise ValueError(
                f"session {sid!r}: inputs_embeds must be (n >= 1, {self.thinker.config.hidden_size}), "
                f"got {tuple(embeds.shape)}"
            )

    def _prepare(self, sid: str, embeds: torch.Tensor, unit_start: bool) -> _Work:
        """Apply the window for ``sid``, reserve slots for ``embeds``; return its forward slice."""
        sess = self.sessions[sid]
        n = embeds.shape[0]
        num_tokens = self.manager.num_tokens(sid)
        if unit_start:
            sess.unit_starts.append(num_tokens)
        plan = plan_compaction(sess.prefix_len, num_tokens, n, sess.window, self.block_size,
                               sess.unit_starts)  # raises ContextLengthExceeded (this session's marks)
        num_computed = num_tokens
        if plan is not None and plan.num_dropped_blocks > 0:
            self.compactions += 1
            if self.window.mode == "basic":
                compact_basic(self.manager, self.cache, sess, plan, self.thinker.config.rope_theta)
                num_computed = plan.new_num_tokens
            else:
                embeds, num_computed = compact_rebuild(self.manager, sess, plan, embeds)
        if num_computed + embeds.shape[0] > self.max_positions:
            raise ContextLengthExceeded(
                f"context_length_exceeded: session {sid!r} would reach {num_computed + embeds.shape[0]} "
                f"tokens, past the model's {self.max_positions} positions (window {self.window.mode})"
            )
        slots = num_computed + embeds.shape[0] - self.manager.num_tokens(sid)
        assert slots >= 0, f"session {sid}: negative slot count {slots}"
        if not self.manager.can_append(sid, slots):
            raise ContextLengthExceeded(
                f"context_length_exceeded: session {sid!r} at {num_computed} tokens needs "
                f"{self.manager.blocks_for_tokens(num_computed + embeds.shape[0]) - len(self.manager.block_table(sid))} "
                f"more blocks for {n} tokens, the KV pool has {self.manager.pool.num_free} free"
            )
        self.manager.append_slots(sid, slots)
        return _Work(sid, num_computed, embeds)

    def _forward(self, work: list[_Work]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """One ragged forward over ``work``. For each session that wants logits and computed at
        least one token: its last token's final-norm hidden state (H,) and the logits (V,)
        ``lm_head`` makes of exactly that row. Returns ``(logits, hidden)``, keyed by sid."""
        tables = [self.manager.block_table(w.sid) for w in work]
        computed = [w.num_computed for w in work]
        num_new = [w.embeds.shape[0] for w in work]
        weight = self.thinker.lm_head.weight
        if sum(num_new) == 0:
            return {}, {}
        embeds = torch.cat([w.embeds for w in work], dim=0).to(device=weight.device, dtype=weight.dtype)
        graphs = self.decode_graphs
        with torch.inference_mode():
            if graphs is not None and all(n == 1 for n in num_new) and graphs.accepts(tables):
                hidden = graphs.run(embeds, tables, computed)
                last: list[int | None] = list(range(len(work)))
            elif graphs is not None and self.ragged_graphs and graphs.accepts_ragged(tables, num_new):
                hidden = graphs.run_ragged(embeds, tables, computed, num_new)
                last = last_token_rows(num_new)
            else:
                hidden, last = self._forward_eager(embeds, tables, computed, num_new)
            wanted = [i for i, w in enumerate(work) if w.wants_logits and w.embeds.shape[0] > 0]
            if not wanted:
                return {}, {}
            rows = torch.tensor([last[i] for i in wanted], dtype=torch.long).to(hidden.device, non_blocking=True)
            last_hidden = hidden[rows]  # (B, H): a copy, so the (N, H) activations can be freed
            logits = self.thinker.compute_logits(last_hidden)  # (B, V)
        sids = [work[i].sid for i in wanted]
        return ({sid: logits[j] for j, sid in enumerate(sids)},
                {sid: last_hidden[j] for j, sid in enumerate(sids)})

    def _forward_eager(self, embeds: torch.Tensor, tables: list[list[int]], computed: list[int],
                       num_new: list[int]) -> tuple[torch.Tensor, list[int | None]]:
        batch = PagedBatch.build(tables, computed, num_new, None, self.block_size, self.cache.device)
        return self.thinker.forward_paged(embeds, batch, self.cache), batch.last_token_indices

    # ------------------------------------------------------------------ truncation

    # ------------------------------------------------------------------ truncation

    def drop_last_tokens(self, sid: str, num_tokens: int) -> list[int]:
        """Forget the last ``num_tokens`` tokens of ``sid`` (a cancelled reply's unplayed text);
        the anchor is never cut (ValueError). Returns the released block ids (table order);
        the layout and why the next write is private: ``stage0_window.drop_last_tokens``."""
        return drop_last_tokens(self.manager, self._session(sid), num_tokens)

    def droppable_tail(self, sid: str) -> int:
        """How many of ``sid``'s last tokens ``drop_last_tokens`` may take back as one span
        (``stage0_window.droppable_tail``)."""
        return droppable_tail(self.manager, self._session(sid))

    def _session(self, sid: str) -> Stage0Session:
        if sid not in self.sessions:
            raise ValueError(f"unknown session {sid!r}")
        return self.sessions[sid]

    # ------------------------------------------------------------------ accounting

    def num_tokens(self, sid: str) -> int:
        return self.manager.num_tokens(sid)

    def block_table(self, sid: str) -> list[int]:
        return self.manager.block_table(sid)

    def num_anchor_blocks(self, sid: str) -> int:
        return self.manager.num_context_blocks(sid)

    def session_bytes(self, sid: str) -> SessionBytes:
        return self.manager.session_bytes(sid)

    def pool_stats(self) -> PoolStats:
        return self.manager.pool_stats()
