"""Benchmark-only fast-forward: bring one session's state to its steady size without the audio path.

``thinker_tokens``: fill the session's Thinker window (the tokens after its anchor) up to this
many tokens with embeddings of seeded random text ids, through the serving append path
(``Stage0Runner.append``, ``chunk_tokens`` per forward), so blocks, window bookkeeping and pool
accounting are exactly those of serving. The limit is the session's high mark (window off: the
model's positions less the anchor); the fill stops at or below it, so the fill itself never
compacts and the next unit compacts as in serving. The fill tokens are not unit starts. None
leaves the Thinker as it is::

    [ anchor (prefix) | window now ........ | fill ......... ]
                      |<-- have ----------->|<-- appended -->|
                      |<-- thinker_tokens (<= high) -------->|

``talker_full_turn``: hold Talker blocks for a full turn (``engine.talker_turn_tokens``, by
default the Talker's ``max_position_embeddings``: what admission reserved); they are held, not computed, and the turn's next units compute into
them.

``encoder_full_cache``: grow the streaming audio encoder's K/V cache to its full
``max_cache_frames`` (what admission reserved; it grows by blocks as audio arrives, so after a
few units it holds a few seconds). Held, not computed: the valid rows and outputs are unchanged.

Benchmarks call ``fast_forward_session(engine, sid, **request)``: it runs between ticks
(``DuplexEngine.between_ticks``: under the tick lock, in the engine's numerics), never in a tick.
"""

from __future__ import annotations

import functools
import logging
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from duplexcache.kv.talker_blocks import TalkerBlocks
from duplexcache.runtime import engine_parts
from duplexcache.runtime.engine_session import EndSession, EngineSession
from duplexcache.runtime.policy import text_token_ids
from duplexcache.runtime.stage0.runner import Stage0Runner

if TYPE_CHECKING:
    from duplexcache.runtime.engine import DuplexEngine

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class FastForwardRequest:
    """What to fill (see the module docstring); ValueError on a bad chunk size."""

    thinker_tokens: int | None = None
    talker_full_turn: bool = False
    encoder_full_cache: bool = False
    chunk_tokens: int = 512
    seed: int = 0

    def __post_init__(self) -> None:
        if self.chunk_tokens < 1:
            raise ValueError(f"chunk_tokens must be >= 1, got {self.chunk_tokens}")


@dataclass(frozen=True)
class FastForwardResult:
    """What ``fast_forward_session`` added to one session."""

    thinker_tokens_appended: int
    talker_blocks_added: int


def thinker_fill_count(stage0: Stage0Runner, sid: str, thinker_tokens: int) -> int:
    """Tokens to append so the window holds ``thinker_tokens``; ValueError when out of range."""
    prefix = stage0.sessions[sid].prefix_len
    have = stage0.num_tokens(sid) - prefix
    window = stage0.session_window(sid)
    if window.enabled:
        limit, what = window.high_tokens, f"the window's high mark ({window.high_tokens} tokens after the anchor)"
    else:
        limit = stage0.max_positions - prefix
        what = f"the model's {stage0.max_positions} positions less the {prefix}-token anchor"
    if thinker_tokens > limit:
        raise ValueError(f"session {sid!r}: thinker_tokens {thinker_tokens} is past {what}")
    if thinker_tokens < have:
        raise ValueError(f"session {sid!r}: thinker_tokens {thinker_tokens} is below the {have} window tokens "
                         "it holds already; fast_forward only grows")
    return thinker_tokens - have


def fill_thinker(stage0: Stage0Runner, sess: EngineSession, todo: int, text_ids: torch.Tensor,
                 embed: Callable[[torch.Tensor], torch.Tensor], req: FastForwardRequest, end: EndSession) -> int:
    """Append ``todo`` embeddings of seeded random ``text_ids``; returns ``todo``."""
    if todo == 0:
        return 0
    # Ids depend on (sid, seed, length so far) only, not on chunk_tokens: the same fill in
    # every configuration of a bench run, and chunking changes nothing but the forwards.
    start = stage0.num_tokens(sess.sid)
    g = torch.Generator().manual_seed(zlib.crc32(f"{sess.seed_name}/{req.seed}/{start}".encode()))
    ids = text_ids[torch.randint(len(text_ids), (todo,), generator=g)]
    for chunk in torch.split(ids, req.chunk_tokens):
        result = stage0.append({sess.sid: embed(chunk)}, unit_start=False)
        if sess.sid in result.errors:
            # Cannot happen at or below the high mark with the blocks admission reserved.
            err = result.errors[sess.sid]
            end(sess, err)
            raise RuntimeError(f"fast-forward ended session {sess.sid}: {err}") from err
    return todo


def fast_forward(sess: EngineSession, req: FastForwardRequest, stage0: Stage0Runner, talker_kv: TalkerBlocks,
                 talker_turn_tokens: int, text_ids: torch.Tensor, embed: Callable[[torch.Tensor], torch.Tensor],
                 end: EndSession) -> FastForwardResult:
    """Fill ``sess`` as ``req`` asks. The session must be open in Stage 0 (one tick after
    ``open_session``): ValueError otherwise, or on a length past the limit or below what the
    window holds already."""
    sid = sess.sid
    if not (sess.opened and sid in stage0.sessions):
        raise ValueError(f"session {sid!r} is not open in Stage 0 yet: run a tick after open_session")
    todo = thinker_fill_count(stage0, sid, req.thinker_tokens) if req.thinker_tokens is not None else 0
    appended = fill_thinker(stage0, sess, todo, text_ids, embed, req, end)
    # A text-only session (audio_output off) reserved no Talker turn: it holds none
    added = talker_kv.grow(sid, talker_turn_tokens) if req.talker_full_turn and sess.config.audio_output else 0
    enc = sess.encoder_state
    if req.encoder_full_cache and enc is not None:
        enc.reserve(enc.max_frames)
    return FastForwardResult(appended, added)


def fast_forward_session(engine: DuplexEngine, sid: str, **request: Any) -> FastForwardResult:
    """``fast_forward`` of live session ``sid`` of ``engine`` with ``FastForwardRequest(**request)``,
    between ticks (it waits for a running tick); pool stats are refreshed afterwards. Through
    public names only: the speak policy's text ids, the Thinker's embedding, the engine's session end."""
    req = FastForwardRequest(**request)
    models = engine.models
    text_ids = text_token_ids(models.tokenizer, models.thinker.config.vocab_size)   # as the engine's policy
    with engine.between_ticks():
        result = fast_forward(engine.table.get_live(sid), req, engine.stage0, engine.talker_kv,
                              engine.sizing.talker_turn_tokens, text_ids, torch.no_grad()(models.thinker.embed),
                              functools.partial(engine_parts.end_session, engine))
        engine.recorder.refresh_pools()
    return result
