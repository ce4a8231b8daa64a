"""Stage 1 Talker: MiniCPM-o 4.5's TTS module (Llama backbone over speech codes), paged KV.

Module and parameter names follow MiniCPM-o 4.5's ``MiniCPMTTS`` (checkpoint prefix ``tts.``)::

    model            transformers LlamaModel (embed_tokens is unused by the code path but kept
                     so the checkpoint loads strictly); its layers are ``models/layers.py``'s
    emb_text         Embedding(num_text_tokens, hidden)       text token of each condition row
    projector_spk    linear1 (llm_dim->hidden), ReLU, linear2 (hidden->hidden)
    projector_semantic  same shape; projects Thinker hidden states
    emb_code.0       Embedding(num_audio_tokens, hidden)      speech code -> next input
    head_code.0      weight-normed Linear(hidden, num_audio_tokens, bias=False)
                     (keys ``parametrizations.weight.original0`` = g, ``original1`` = v)

One speaking unit (``generate_unit``), per session::

    condition rows   emb_text(text ids) + normalize(projector_semantic(thinker hidden)),
                     then ``boundary_token_ids`` (e.g. audio_bos) through emb_text only
    step 0           prefill the condition, sample code t1 from the last row
    steps 1..24      feed t_k (emb_code), sample t_{k+1}                 -> 25 speech codes
    closing step     feed [t25, end] so the KV holds the whole unit     -> + 1 end code (6561)

The end code is never sampled during the 25 (its logit is masked); it closes the unit. After a
unit the session's KV holds ``condition + 26`` more tokens; it is kept across units and released
by the caller (the KV manager) at the end of the turn. Positions equal logical indices.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.parametrizations import weight_norm

from duplexcache.kv.decode_graphs import PagedDecodeGraphs
from duplexcache.kv.paged_attention import PagedBatch, PagedKVCache, last_token_rows
from duplexcache.kv.rope import rope_cos_sin
from duplexcache.models.layers import (
    DecoderLayer, GQAttention, MultiModalProjector, RMSNorm, SwiGLUMLP, check_paged_step,
)

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TalkerConfig:
    hidden_size: int = 768
    intermediate_size: int = 3072
    num_hidden_layers: int = 20
    num_attention_heads: int = 12
    num_key_value_heads: int = 12
    max_position_embeddings: int = 4096
    rms_norm_eps: float = 1e-6  # LlamaConfig default, which MiniCPMTTS does not override
    rope_theta: float = 10000.0
    vocab_size: int = 32000  # backbone embed_tokens (LlamaConfig default), unused
    num_text_tokens: int = 152064
    num_audio_tokens: int = 6562  # 6561 speech codes + end
    llm_dim: int = 4096  # Thinker hidden size
    normalize_projected_hidden: bool = True
    tokens_per_unit: int = 25

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(f"hidden_size {self.hidden_size} not divisible by {self.num_attention_heads} heads")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        if self.num_audio_tokens < 2 or self.tokens_per_unit < 1:
            raise ValueError("need at least one speech code plus the end code, and tokens_per_unit >= 1")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def end_token_id(self) -> int:
        return self.num_audio_tokens - 1

    @classmethod
    def tiny(cls, **overrides) -> "TalkerConfig":
        fields = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=512, vocab_size=100, num_text_tokens=300,
                      num_audio_tokens=50, llm_dim=96)
        fields.update(overrides)
        return cls(**fields)

    @classmethod
    def minicpmo45(cls) -> "TalkerConfig":
        return cls()

    @classmethod
    def from_dict(cls, tts: dict) -> "TalkerConfig":
        """From MiniCPM-o's ``tts_config`` (or a Llama config.json for a bare backbone)."""
        names = set(cls.__dataclass_fields__)
        fields = {k: v for k, v in tts.items() if k in names}
        fields.setdefault("num_key_value_heads", tts.get("num_attention_heads", 12))
        if "num_vq" in tts and tts["num_vq"] != 1:
            raise ValueError(f"Talker supports num_vq == 1 only, got {tts['num_vq']}")
        return cls(**fields)

    def to_llama_dict(self) -> dict:
        """Keyword arguments for transformers' LlamaConfig describing the backbone."""
        return dict(hidden_size=self.hidden_size, intermediate_size=self.intermediate_size,
                    num_hidden_layers=self.num_hidden_layers, num_attention_heads=self.num_attention_heads,
                    num_key_value_heads=self.num_key_value_heads,
                    max_position_embeddings=self.max_position_embeddings, rms_norm_eps=self.rms_norm_eps,
                    vocab_size=self.vocab_size, rope_theta=self.rope_theta, hidden_act="silu")


# ----------------------------------------------------------------------------- backbone


def llama_decoder_layer(cfg: TalkerConfig, layer_idx: int) -> DecoderLayer:
    """transformers' ``LlamaDecoderLayer`` (no q/k norm, no biases)."""
    attn = GQAttention(cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, layer_idx)
    return DecoderLayer(attn, SwiGLUMLP(cfg.hidden_size, cfg.intermediate_size), cfg.hidden_size, cfg.rms_norm_eps)


class LlamaBackbone(nn.Module):
    """Parameter names as transformers' LlamaModel."""

    def __init__(self, cfg: TalkerConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(llama_decoder_layer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


# ----------------------------------------------------------------------------- talker


class Talker(nn.Module):
    def __init__(self, config: TalkerConfig) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaBackbone(config)
        self.emb_text = nn.Embedding(config.num_text_tokens, config.hidden_size)
        self.projector_spk = MultiModalProjector(config.llm_dim, config.hidden_size)
        self.projector_semantic = MultiModalProjector(config.llm_dim, config.hidden_size)
        self.emb_code = nn.ModuleList([nn.Embedding(config.num_audio_tokens, config.hidden_size)])
        self.head_code = nn.ModuleList(
            [weight_norm(nn.Linear(config.hidden_size, config.num_audio_tokens, bias=False), name="weight")])

    def forward_dense(self, inputs_embeds: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """Causal forward without a cache: (B, T, hidden) -> final-norm hidden (B, T, hidden)."""
        if inputs_embeds.dim() != 3 or inputs_embeds.shape[-1] != self.config.hidden_size:
            raise ValueError(f"forward_dense: inputs_embeds must be (B, T, {self.config.hidden_size}), "
                             f"got {tuple(inputs_embeds.shape)}")
        if positions is None:
            positions = torch.arange(inputs_embeds.shape[1], device=inputs_embeds.device).expand(inputs_embeds.shape[:2])
        cos, sin = rope_cos_sin(positions, self.config.head_dim, self.config.rope_theta)  # (B, T, D)
        x = inputs_embeds
        for layer in self.model.layers:
            x = layer(x, cos, sin)
        return self.model.norm(x)

    def forward_paged(self, inputs_embeds: torch.Tensor, batch: PagedBatch, cache: PagedKVCache) -> torch.Tensor:
        """One ragged step over the paged cache: (N, hidden) -> final-norm hidden (N, hidden)."""
        cfg = self.config
        check_paged_step("Talker", inputs_embeds, batch, cache, hidden_size=cfg.hidden_size,
                         num_layers=cfg.num_hidden_layers, num_kv_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim)
        # Host lists, not batch.positions: reading the device tensor would sync every step (and
        # could not be captured in a CUDA graph). Talker positions are the logical indices.
        longest = max(batch.seq_lens_list, default=0)
        if longest > self.config.max_position_embeddings:
            raise ValueError(f"Talker turn too long: position {longest - 1} >= "
                             f"max_position_embeddings {self.config.max_position_embeddings}")
        cos, sin = rope_cos_sin(batch.positions, self.config.head_dim, self.config.rope_theta)  # (N, D)
        x = inputs_embeds
        for layer in self.model.layers:
            x = layer(x, cos, sin, batch, cache)
        return self.model.norm(x)

    def code_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head_code[0](hidden)

    def build_condition(self, text_token_ids: torch.Tensor, thinker_hidden: torch.Tensor,
                        boundary_token_ids: tuple[int, ...] = ()) -> torch.Tensor:
        """Condition rows of one unit: (T,) ids + (T, llm_dim) hidden -> (T + len(boundary), hidden)."""
        rows, _ = self.build_conditions([TalkerUnitRequest([], 0, text_token_ids, thinker_hidden, boundary_token_ids)])
        return rows

    def build_conditions(self, requests: Sequence["TalkerUnitRequest"]) -> tuple[torch.Tensor, list[int]]:
        """The condition rows of every request, concatenated in request order, with each
        request's row count: per request, the text embeddings plus the L2-normalised semantic
        projection of its Thinker hidden rows, then its boundary ids' embeddings. One projection of
        all the hidden rows, one embedding of all the ids (one host-to-device copy), one add: per
        request that was ~10 kernels. A row's values depend on the other requests only through
        the projector GEMM's row-count rounding."""
        dev, dtype = self.emb_text.weight.device, self.emb_text.weight.dtype
        hidden, ids, text_rows, sizes = [], [], [], []
        for r in requests:
            rows = list(r.thinker_hidden.unbind(0)) if isinstance(r.thinker_hidden, torch.Tensor) \
                else list(r.thinker_hidden)
            n = r.text_token_ids.numel()
            if r.text_token_ids.dim() != 1 or len(rows) != n or any(h.shape != (self.config.llm_dim,) for h in rows):
                raise ValueError(f"build_condition: need ids (T,) and hidden (T, {self.config.llm_dim}), got "
                                 f"{tuple(r.text_token_ids.shape)} and {len(rows)} rows of "
                                 f"{sorted({tuple(h.shape) for h in rows})}")
            start = sum(sizes)
            text_rows.extend(range(start, start + n))
            hidden.extend(rows)
            ids += r.text_token_ids.tolist() + list(r.boundary_token_ids)   # host ids: one copy below
            sizes.append(n + len(r.boundary_token_ids))
        sem = self.projector_semantic(torch.stack(hidden).to(dev, dtype))
        if self.config.normalize_projected_hidden:
            sem = F.normalize(sem, p=2, dim=-1)
        rows = self.emb_text(torch.tensor(ids, dtype=torch.long).to(dev, non_blocking=True))
        if len(text_rows) == rows.shape[0]:   # no boundary rows: every row gets its projection
            return rows + sem, sizes
        index = torch.tensor(text_rows).to(dev, non_blocking=True)
        rows[index] = rows[index] + sem       # boundary rows keep their embedding alone
        return rows, sizes

    @classmethod
    def from_pretrained(cls, path: str | Path, config: TalkerConfig | None = None,
                        dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> "Talker":
        """Load a MiniCPM-o dir (``tts.`` prefix, ``tts_config``) or a dir saved with no prefix."""
        from duplexcache.models import checkpoint

        if config is None:
            raw = checkpoint.read_hf_config(path)
            config = TalkerConfig.from_dict(raw.get("tts_config", raw))
        keys = set(checkpoint.checkpoint_keys(path))
        prefix = "tts." if "tts.emb_code.0.weight" in keys else ""
        model = cls(config)
        checkpoint.load_strict(model, checkpoint.load_state_dict(path, prefix or None), "talker")
        return model.to(device=device, dtype=dtype)


# ----------------------------------------------------------------------------- one unit, batched


@dataclass
class TalkerUnitRequest:
    """One session's speaking unit. The block table is the session's (owned by the KV manager);
    it must already cover ``num_computed + condition rows + tokens_per_unit + 1`` tokens."""

    block_table: list[int]
    num_computed: int  # Talker tokens already in the cache this turn
    text_token_ids: torch.Tensor  # (T,)
    thinker_hidden: torch.Tensor | Sequence[torch.Tensor]  # (T, llm_dim), or T rows of (llm_dim,)
    boundary_token_ids: tuple[int, ...] = ()


@dataclass
class TalkerUnitResult:
    # (tokens_per_unit + 1,) int64, last one is the end code; on the Talker's device, so the
    # engine's Code2Wav stage reads them there and nothing waits for the device in between
    codes: torch.Tensor
    num_computed: int  # cache length after the unit


@dataclass
class TalkerSampling:
    """temperature 0 = greedy; otherwise softmax(logits / T) over the top_k, drawn with ``generator``."""

    temperature: float = 0.0
    top_k: int | None = None
    generator: torch.Generator | None = None


def unit_cache_tokens(num_condition_rows: int, config: TalkerConfig) -> int:
    """Cache tokens one unit adds: its condition rows, the 25 codes and the end code."""
    return num_condition_rows + config.tokens_per_unit + 1


def _sample(logits: torch.Tensor, end_id: int, sampling: TalkerSampling) -> torch.Tensor:
    logits = logits.to(torch.float32).clone()
    logits[:, end_id] = float("-inf")  # the end code closes a unit; it is never drawn
    if sampling.temperature <= 0:
        return logits.argmax(dim=-1)
    logits = logits / sampling.temperature
    if sampling.top_k is not None and sampling.top_k < logits.shape[-1]:
        kth = torch.topk(logits, sampling.top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    return torch.multinomial(probs, 1, generator=sampling.generator).squeeze(-1)


@torch.no_grad()
def generate_unit(talker: Talker, cache: PagedKVCache, requests: list[TalkerUnitRequest],
                  sampling: TalkerSampling | None = None,
                  graphs: PagedDecodeGraphs | None = None, ragged_graphs: bool = False) -> list[TalkerUnitResult]:
    """Generate one speaking unit (25 codes + end) for every request, batched over sessions.

    ``graphs``: when the batch fits them, the 24 one-token steps and the closing step (as two
    one-token steps) replay these CUDA graphs (``kv/decode_graphs.py``); the condition step
    (several tokens per request) runs eagerly, or with ``ragged_graphs``
    (``engine.cuda_graphs``) through the same graphs as one row per token when its rows
    fit (``PagedDecodeGraphs.accepts_ragged``)."""
    if not requests:
        return []
    sampling = sampling or TalkerSampling()
    cfg, bs, dev = talker.config, cache.block_size, cache.device
    cond_rows, cond_sizes = talker.build_conditions(requests)
    tables = [list(r.block_table) for r in requests]
    computed = [r.num_computed for r in requests]
    for i, (r, n_cond) in enumerate(zip(requests, cond_sizes)):
        need = r.num_computed + unit_cache_tokens(n_cond, cfg)
        if need > len(r.block_table) * bs:
            raise ValueError(f"generate_unit: request {i} needs {need} cache slots but its block table "
                             f"holds {len(r.block_table) * bs}")
        if need > cfg.max_position_embeddings:
            raise ValueError(f"generate_unit: request {i} would reach {need} Talker tokens, over "
                             f"max_position_embeddings {cfg.max_position_embeddings}; end the turn")

    one_token_graphs = graphs if graphs is not None and graphs.accepts(tables) else None

    def step(embeds: torch.Tensor, num_new: list[int]) -> torch.Tensor:
        if one_token_graphs is not None and all(n == 1 for n in num_new):
            hidden = one_token_graphs.run(embeds, tables, computed)   # (B, hidden), one row per request
            last = None
        elif ragged_graphs and graphs is not None and graphs.accepts_ragged(tables, num_new):
            hidden = graphs.run_ragged(embeds, tables, computed, num_new)   # (N, hidden), one row per token
            last = torch.tensor(last_token_rows(num_new)).to(hidden.device, non_blocking=True)
        else:
            batch = PagedBatch.build(tables, computed, num_new, None, bs, dev)
            hidden = talker.forward_paged(embeds, batch, cache)
            last = torch.tensor(batch.last_token_indices).to(hidden.device, non_blocking=True)
        for b, n in enumerate(num_new):
            computed[b] += n
        return talker.code_logits(hidden if last is None else hidden[last])  # (B, codes)

    logits = step(cond_rows, cond_sizes)
    codes = [_sample(logits, cfg.end_token_id, sampling)]
    ones = [1] * len(requests)
    for _ in range(cfg.tokens_per_unit - 1):
        logits = step(talker.emb_code[0](codes[-1].to(dev)), ones)
        codes.append(_sample(logits, cfg.end_token_id, sampling))
    end = torch.full_like(codes[-1], cfg.end_token_id)
    # Closing step: t25 and the end code enter the cache; their outputs are not needed.
    if one_token_graphs is not None:   # two graphed one-token steps beat one eager ragged step
        step(talker.emb_code[0](codes[-1].to(dev)), ones)
        step(talker.emb_code[0](end.to(dev)), ones)
    else:
        closing = torch.stack([codes[-1], end], dim=1).reshape(-1).to(dev)  # (B * 2,) per-sequence order
        step(talker.emb_code[0](closing), [2] * len(requests))
    all_codes = torch.stack(codes + [end], dim=1)  # (B, 26), left on the device (TalkerUnitResult)
    return [TalkerUnitResult(codes=all_codes[b], num_computed=computed[b]) for b in range(len(requests))]
