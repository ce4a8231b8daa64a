"""The bench target built from the components directly (Stage 0 runner, audio encoder, context
builder, batched Code2Wav): ``duplexcache bench --target components``, a cross-check of the
engine target (``engine_target.py``, the default) that measures the stages without the engine.

Each switch reaches the component that uses it exactly as the deploy config names it:
``stage0.shared_anchor_blocks`` -> ``Stage0Runner(share_context=...)``;
``context_cache.duplex_context_caching`` -> ``SessionContextBuilder.from_config``;
``code2wav.cfm_prompt_att_sharing`` / ``cfm_arena_rows_from_graph_grid`` / ``graph_grid`` ->
the Stage-2 ``Code2WavConfig``.

One unit for every session (one tick)::

    pcm (1 s) -> streaming encoder -> 10 embeddings
    Thinker: append [<unit>, 10 audio]; 2 greedy text tokens (the 2nd via decode)
    Code2Wav: 25 + 3 speech tokens taken from the Thinker's last logits -> 1 s of 24 kHz pcm

The Talker is not part of this target (the engine target covers it); its tokens are replaced
by a deterministic function of the Thinker's logits, so the audio still depends on every bit
of the Stage-0 state and the equality check covers both stages.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch

from duplexcache.bench.memory import Tier
from duplexcache.cfm.code2wav import BatchedCode2Wav
from duplexcache.cfm.config import Code2WavConfig, Code2WavShape
from duplexcache.config import DeployConfig
from duplexcache.context.builder import EmbeddingResult, SessionContextBuilder
from duplexcache.context.context_cache import EncoderPath
from duplexcache.context.tokenizer import ByteTokenizer
from duplexcache.kv.block_pool import BlockPool
from duplexcache.kv.kv_cache_manager import KVCacheManager
from duplexcache.kv.kv_quant import kv_storage_dtype
from duplexcache.kv.window import WindowConfig
from duplexcache.models.audio_encoder import AudioEncoder
from duplexcache.models.presets import build_random_models
from duplexcache.models.thinker import Thinker
from duplexcache.runtime.stage0 import SessionContextInput, Stage0Runner

logger = logging.getLogger(__name__)

UNIT_TOKEN_ID = 151683          # <unit>
SPEECH_VOCAB = 6561
CHUNK_TOKENS = 25 + 3           # 25 speech tokens + 3 lookahead
PROMPT_FRAMES = 300             # default 6 s voice prompt: P = 300 mel frames
CACHE_TAIL = 100
FRAMES_PER_UNIT = 50            # 25 speech tokens, x2 upsampling
INSTRUCTIONS = "You are a helpful voice assistant. Answer briefly."
REF_AUDIO_SECONDS = 2.0


@dataclass
class BenchModels:
    """Weights shared by every configuration of one bench run (memory does not depend on them)."""

    preset: str
    thinker: Thinker
    encoder: AudioEncoder
    flow: torch.nn.Module
    hift: torch.nn.Module
    voice: tuple[torch.Tensor, torch.Tensor, torch.Tensor]   # tokens (P/2,), mel (P, 80), spk (192,)
    ref_audio: torch.Tensor                                  # (S,) float32 16 kHz
    prompt_frames: int = PROMPT_FRAMES                       # P
    cache_tail: int = CACHE_TAIL

    @classmethod
    def build(cls, preset: str, device: str, dtype: torch.dtype, seed: int = 0,
              prompt_frames: int = PROMPT_FRAMES, cache_tail: int = CACHE_TAIL) -> BenchModels:
        """Seeded random weights of ``preset``; a voice prompt of ``prompt_frames`` mel frames
        (even, >= ``cache_tail``; tests shrink both to keep CPU runs short)."""
        if prompt_frames % 2 or prompt_frames < cache_tail or cache_tail < 1:
            raise ValueError(f"prompt_frames ({prompt_frames}) must be even and >= cache_tail ({cache_tail}) >= 1")
        # Stage 2 is float32 whatever ``dtype`` is, as the reference demo runs it (SPEC section 5).
        m = build_random_models(preset, device, dtype, seed, parts=("thinker", "audio_encoder", "flow", "hift"))
        gen = torch.Generator().manual_seed(seed + 3)
        voice = (torch.randint(0, SPEECH_VOCAB, (prompt_frames // 2,), generator=gen),
                 torch.randn(prompt_frames, 80, generator=gen), torch.randn(192, generator=gen))
        ref_audio = 0.1 * torch.randn(int(16000 * REF_AUDIO_SECONDS), generator=gen)
        return cls(preset, m.thinker, m.audio_encoder, m.flow, m.hift, voice, ref_audio, prompt_frames, cache_tail)

    def units_to_steady(self) -> int:
        """Units (the first included) until every session owns P private estimator frames and
        its cache was trimmed to P + tail: setup leaves the P prompt frames, each unit adds 50
        (25 tokens, x2 upsampling), a trim happens once the cache is longer than P + tail."""
        return -(-max(self.prompt_frames, self.cache_tail + 1) // FRAMES_PER_UNIT)

    def weight_bytes(self) -> int:
        """Bytes of every parameter and buffer, each storage counted once."""
        seen, total = set(), 0
        for m in (self.thinker, self.encoder, self.flow, self.hift):
            for t in list(m.parameters()) + list(m.buffers()):
                key = (t.device, t.untyped_storage().data_ptr())
                if key not in seen:
                    seen.add(key)
                    total += t.untyped_storage().nbytes()
        return total


def _high_mark(runner: Stage0Runner, sid: str) -> int:
    """The window high mark of ``sid`` (per-session windows when the runner has them)."""
    per_session = getattr(runner, "session_window", None)
    return (per_session(sid) if per_session is not None else runner.window).high_tokens


def _prompt_frames(sess) -> int:
    """P of a Code2Wav session (the field moved from the prompt state to the session)."""
    p = getattr(sess, "prompt_frames", None)
    return int(p) if p is not None else sess.prompt.num_frames


def check_code2wav_steady(code2wav: BatchedCode2Wav) -> None:
    """Raise if any Code2Wav session's estimator cache is not at its steady length P + tail
    (the bench must not call a state "steady" that is not)."""
    tail = code2wav.config.cache_tail_frames
    for sid, sess in code2wav.sessions.items():
        want = _prompt_frames(sess) + tail
        if len(sess.att) != want:
            raise RuntimeError(f"bench: Code2Wav session {sid} holds {len(sess.att)} cache frames, not the "
                               f"steady {want} (P + tail); run more units (--units)")


@dataclass
class SessionOutput:
    """What one session produced: text token ids and 24 kHz pcm, per unit."""

    text: list[int] = field(default_factory=list)
    audio: list[torch.Tensor] = field(default_factory=list)

    def audio_tensor(self) -> torch.Tensor:
        return torch.cat(self.audio) if self.audio else torch.zeros(0)


class ComponentTarget:
    """``n`` sessions of one configuration, over freshly allocated pools and caches."""

    name = "components"

    def __init__(self, models: BenchModels, deploy: DeployConfig, max_sessions: int) -> None:
        self.models, self.deploy = models, deploy
        th = models.thinker
        self.device = th.lm_head.weight.device
        self.dtype = th.lm_head.weight.dtype
        w = deploy.stage0.window
        self.window = WindowConfig(mode=w.mode, high_tokens=w.high_tokens, low_tokens=w.low_tokens)
        bs = deploy.stage0.block_size
        # Pool sized to this workload (free blocks are capacity, not held memory).
        per_session = -(-(self._context_upper_bound() + w.high_tokens + 64) // bs) + 1
        num_blocks = max_sessions * per_session + 2
        cache = th.make_kv_cache(num_blocks, bs, self.dtype, self.device,
                                 kv_storage_dtype(deploy.precision.kv_cache_dtype))   # as the engine's
        mgr = KVCacheManager(BlockPool(num_blocks), bs, cache.bytes_per_block)
        self.stage0 = Stage0Runner(th, mgr, cache, self.window,
                                   share_context=deploy.stage0.shared_anchor_blocks, block_size=bs)
        self.builder = SessionContextBuilder.from_config(deploy, ByteTokenizer(), self._embed_tokens,
                                                         self._encode_reference)
        self.code2wav = BatchedCode2Wav(models.flow, models.hift, self._code2wav_config())
        self.code2wav.register_voice("default", *models.voice)
        self.encoder_states: dict = {}
        self.outputs: dict[str, SessionOutput] = {}
        self.tick_s: list[float] = []
        self.units = 0

    # ---------------------------------------------------------------- wiring
    def _code2wav_config(self) -> Code2WavConfig:
        c = self.deploy.code2wav
        return Code2WavConfig(
            shape=Code2WavShape.from_flow(self.models.flow), max_num_seqs=c.max_num_seqs,
            prompt_att_sharing=c.cfm_prompt_att_sharing,
            arena_rows_from_graph_grid=c.cfm_arena_rows_from_graph_grid,
            graph_grid=tuple(c.graph_grid or ()), cache_tail_frames=self.models.cache_tail,
            max_prompt_frames=self.models.prompt_frames, max_chunk_tokens=CHUNK_TOKENS,
            use_cuda_graphs=self.device.type == "cuda")

    def _context_upper_bound(self) -> int:
        return 256 + int(REF_AUDIO_SECONDS * 10)

    def _embed_tokens(self, ids: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return self.models.thinker.embed(ids.to(self.device))

    def _encode_reference(self, audio: torch.Tensor, encoder_state) -> EmbeddingResult:
        return EmbeddingResult(self.models.encoder.embed_audio(audio), EncoderPath.WHOLE_CLIP)

    # ---------------------------------------------------------------- workload
    def open_sessions(self, n: int) -> None:
        """Setup of ``n`` sessions: contexts prefilled (one forward), voices queued; then the
        first unit (which also runs the Code2Wav voice setup)."""
        contexts = {}
        for i in range(n):
            sid = f"s{i:03d}"
            state = self.models.encoder.new_stream_state()
            ctx = self.builder.build(INSTRUCTIONS, self.models.ref_audio, encoder_state=state)
            contexts[sid] = SessionContextInput(ctx.inputs_embeds, ctx.token_ids, ctx.extra_key)
            self.encoder_states[sid] = state
            self.outputs[sid] = SessionOutput()
            self.code2wav.add_session(sid, "default", seed=i)
        result = self.stage0.open_sessions(contexts)
        if result.errors:
            sid, err = next(iter(result.errors.items()))
            raise RuntimeError(f"bench: session {sid} could not open: {err}")
        self.run_unit()

    def run_unit(self) -> None:
        """One tick for every session (see the module docstring)."""
        start = time.perf_counter()
        sids = list(self.outputs)
        enc = self.models.encoder
        chunks = []
        for i, sid in enumerate(sids):
            g = torch.Generator().manual_seed(1_000_003 * self.units + i)
            chunks.append(0.1 * torch.randn(enc.expected_chunk_samples(self.encoder_states[sid]), generator=g))
        audio_emb = enc.stream_step([self.encoder_states[s] for s in sids], chunks)
        unit = self._embed_tokens(torch.tensor([UNIT_TOKEN_ID]))
        inputs = {sid: torch.cat([unit, e.to(self.dtype)]) for sid, e in zip(sids, audio_emb)}
        logits = self._check(self.stage0.append(inputs, unit_start=True))
        first = {sid: int(logits[sid].argmax()) for sid in sids}
        logits = self._check(self.stage0.decode(first))
        speech = {}
        for sid in sids:
            second = int(logits[sid].argmax())
            self.outputs[sid].text += [first[sid], second]
            speech[sid] = torch.topk(logits[sid].float(), CHUNK_TOKENS).indices.cpu() % SPEECH_VOCAB
        pcm = self.code2wav.step(speech)
        if pcm.errors:
            sid, err = next(iter(pcm.errors.items()))
            raise RuntimeError(f"bench: Code2Wav refused session {sid}: {err}")
        for sid in sids:
            self.outputs[sid].audio.append(pcm[sid].detach().cpu())
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.tick_s.append(time.perf_counter() - start)
        self.units += 1

    @staticmethod
    def _check(result):
        if result.errors:
            sid, err = next(iter(result.errors.items()))
            raise RuntimeError(f"bench: session {sid} ended: {err}")
        return result

    def fast_forward_window(self, chunk_tokens: int = 512) -> int:
        """Fill every session's Thinker window to its high mark (prefix + high_tokens) with
        real token embeddings of seeded random ids, in ragged batches of at most
        ``chunk_tokens`` tokens per session; grow every encoder cache to its full
        ``max_cache_frames`` (held, not computed: it grows by blocks as audio arrives). Returns
        the most tokens appended to one session."""
        for state in self.encoder_states.values():
            state.reserve(state.max_frames)
        if not self.window.enabled:
            return 0
        mgr = self.stage0.manager
        todo = {sid: s.prefix_len + _high_mark(self.stage0, sid) - mgr.num_tokens(sid)
                for sid, s in self.stage0.sessions.items()}
        most, step = max(todo.values(), default=0), 0
        while any(v > 0 for v in todo.values()):
            inputs = {}
            for i, (sid, left) in enumerate(todo.items()):
                if left <= 0:
                    continue
                n = min(left, chunk_tokens)
                g = torch.Generator().manual_seed(7_000_003 * step + i)
                inputs[sid] = self._embed_tokens(torch.randint(0, 151_000, (n,), generator=g))
                todo[sid] -= n
            self._check(self.stage0.append(inputs, unit_start=False))
            step += 1
        check_code2wav_steady(self.code2wav)
        return max(0, most)

    # ---------------------------------------------------------------- accounting
    def pools(self) -> dict[str, Tier]:
        """Bytes held per component, from the components' own accounting of tensor storage."""
        stats = self.stage0.pool_stats().to_bytes()
        c2w = self.code2wav
        arena = c2w.arena.nbytes()   # its own accounting: device buffers only, voices' frames excluded
        cache = self.builder.cache
        return {
            "thinker_kv": Tier(stats["shared"], stats["private"], stats["free"]),
            "audio_encoder": Tier(0, sum(s.nbytes for s in self.encoder_states.values())),
            "context_cache": Tier(cache.nbytes() if cache is not None else 0, 0),
            "cfm_prompt": Tier(c2w.voice_bytes("default"),
                               sum(c2w.session_bytes(sid).private for sid in c2w.sessions)),
            "cfm_arena": Tier(arena, 0),
        }

    def close(self) -> None:
        for sid in list(self.stage0.sessions):
            self.stage0.close_session(sid)
        for sid in list(self.code2wav.sessions):
            self.code2wav.remove_session(sid)
        self.encoder_states.clear()
