"""Stage 0 Thinker: the Qwen3 decoder (transformers' ``Qwen3ForCausalLM``), dense and paged.

Architecture per layer (pre-norm)::

    x -> input_layernorm -> q/k/v proj -> per-head RMSNorm on q, k -> NeoX RoPE -> GQA attention
      -> o_proj -> + x -> post_attention_layernorm -> SwiGLU MLP -> + residual

The norm, MLP, attention and residual layer are the shared ones of ``models/layers.py``; this
file adds Qwen3's per-head q/k norm (``ThinkerAttention``) and the model around the layers.

Parameter names are exactly those of ``Qwen3ForCausalLM`` (``model.embed_tokens``,
``model.layers.N.self_attn.q_proj``, ..., ``model.norm``, ``lm_head``) so a Hugging Face state
dict, or the ``llm.`` part of a MiniCPM-o checkpoint, loads with ``strict=True``.

Two forwards share the layers:
* ``forward_dense``: (B, T, H) causal, no cache; the reference shape for tests.
* ``forward_paged``: a flattened ragged batch over a ``PagedKVCache`` (prefill, chunked
  prefill and decode of many sessions in one call).
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch
from torch import nn

from duplexcache.kv.paged_attention import PagedBatch, PagedKVCache, bytes_per_block
from duplexcache.kv.rope import rope_cos_sin
from duplexcache.models.checkpoint import CheckpointError, checkpoint_keys, load_state_dict, load_strict, read_hf_config
from duplexcache.models.layers import DecoderLayer, GQAttention, RMSNorm, SwiGLUMLP, check_paged_step

logger = logging.getLogger(__name__)

# MiniCPM-o special tokens live above 151000, so every preset's vocabulary must cover them.
MINICPMO_MAX_SPECIAL_TOKEN_ID = 151722
_REQUIRED_HF_KEYS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size")


@dataclass
class ThinkerConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    max_position_embeddings: int = 40960
    tie_word_embeddings: bool = False
    attention_bias: bool = False

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, (int, float)) and not isinstance(value, bool) and value <= 0:
                raise ValueError(f"ThinkerConfig.{f.name} must be positive, got {value}")
        if self.num_attention_heads % self.num_key_value_heads != 0:
            raise ValueError(
                f"ThinkerConfig: num_attention_heads {self.num_attention_heads} is not a multiple "
                f"of num_key_value_heads {self.num_key_value_heads}"
            )
        if self.head_dim % 2 != 0:
            raise ValueError(f"ThinkerConfig: head_dim must be even for RoPE, got {self.head_dim}")

    @classmethod
    def tiny(cls) -> "ThinkerConfig":
        """CPU-fast shape. The full vocabulary is kept so MiniCPM-o special token ids (>151000)
        embed as in the real model; at hidden 64 that is 9.7M parameters per matrix."""
        return cls(
            vocab_size=151748, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        )  # fmt: skip

    @classmethod
    def minicpmo45(cls) -> "ThinkerConfig":
        """MiniCPM-o 4.5's LLM: Qwen3-8B shape with MiniCPM-o's vocabulary."""
        return cls(
            vocab_size=151748, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
            num_attention_heads=32, num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-6,
            rope_theta=1_000_000.0, max_position_embeddings=40960,
        )  # fmt: skip

    @classmethod
    def from_hf_config(cls, config: dict) -> "ThinkerConfig":
        """From a Qwen3 ``config.json`` dict (defaults as transformers' ``Qwen3Config``)."""
        missing = [k for k in _REQUIRED_HF_KEYS if k not in config]
        if missing:
            raise ValueError(f"Qwen3 config lacks {missing}")
        if config.get("hidden_act", "silu") != "silu":
            raise ValueError(f"Qwen3 config: hidden_act {config['hidden_act']!r} is not supported (only silu)")
        if config.get("use_sliding_window", False):
            raise ValueError("Qwen3 config: use_sliding_window=true (sliding-window layers) is not supported")
        heads = config["num_attention_heads"]
        return cls(
            vocab_size=config["vocab_size"],
            hidden_size=config["hidden_size"],
            intermediate_size=config["intermediate_size"],
            num_hidden_layers=config["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=config.get("num_key_value_heads") or heads,
            head_dim=config.get("head_dim") or config["hidden_size"] // heads,
            rms_norm_eps=config.get("rms_norm_eps", 1e-6),
            rope_theta=_rope_theta(config),
            max_position_embeddings=config.get("max_position_embeddings", 32768),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            attention_bias=bool(config.get("attention_bias", False)),
        )

    def to_hf_config(self) -> dict:
        """The matching transformers ``Qwen3Config`` keyword arguments."""
        d = asdict(self)
        d["rope_parameters"] = {"rope_type": "default", "rope_theta": d.pop("rope_theta")}
        d.update(model_type="qwen3", hidden_act="silu", use_sliding_window=False)
        return d

    def kv_bytes_per_token(self, dtype: torch.dtype = torch.bfloat16, storage_dtype: torch.dtype | None = None) -> int:
        """K+V bytes of one token over all layers: the pool's own formula (``storage_dtype`` fp8
        counts one byte per value plus the per-(token, kv head) float32 scales)."""
        return bytes_per_block(self.num_hidden_layers, 1, self.num_key_value_heads, self.head_dim, dtype, storage_dtype)


def _rope_theta(config: dict) -> float:
    """rope_theta from a top-level key (older files) or ``rope_parameters`` / ``rope_scaling``."""
    theta = config.get("rope_theta")
    for key in ("rope_parameters", "rope_scaling"):
        params = config.get(key)
        if params is None:
            continue
        if not isinstance(params, dict):
            raise ValueError(f"Qwen3 config: {key} must be a dict or null, got {params!r}")
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type != "default":
            # Scaled RoPE (yarn, linear, ...) changes every angle; refuse rather than run it wrong.
            raise ValueError(f"Qwen3 config: {key}.rope_type {rope_type!r} is not supported (only default)")
        theta = params.get("rope_theta", theta)
    return float(theta if theta is not None else 10000.0)


def select_qwen3_config(config: dict) -> dict:
    """The Qwen3 part of a config.json: the file itself for Qwen3, else a nested LLM config
    (``llm_config`` / ``text_config``), else the top level (MiniCPM-o keeps the LLM fields there)."""
    if config.get("model_type") == "qwen3":
        return config
    for key in ("llm_config", "text_config"):
        nested = config.get(key)
        if isinstance(nested, dict) and all(k in nested for k in _REQUIRED_HF_KEYS):
            return nested
    return config


# --- layers -------------------------------------------------------------------------------


class ThinkerAttention(GQAttention):
    """Qwen3 attention: GQA + RoPE with a per-head RMSNorm on q and k before RoPE."""

    def __init__(self, config: ThinkerConfig, layer_idx: int) -> None:
        super().__init__(
            config.hidden_size, config.num_attention_heads, config.num_key_value_heads, config.head_dim,
            layer_idx, bias=config.attention_bias,
        )  # fmt: skip
        self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps)

    def norm_qk(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.q_norm(q), self.k_norm(k)


def qwen3_decoder_layer(config: ThinkerConfig, layer_idx: int) -> DecoderLayer:
    """``Qwen3DecoderLayer``: self_attn, mlp, input_layernorm, post_attention_layernorm."""
    return DecoderLayer(
        ThinkerAttention(config, layer_idx),
        SwiGLUMLP(config.hidden_size, config.intermediate_size),
        config.hidden_size,
        config.rms_norm_eps,
    )


class ThinkerModel(nn.Module):
    """``Qwen3Model``: embeddings, decoder layers, final norm."""

    def __init__(self, config: ThinkerConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(qwen3_decoder_layer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


# --- the model ----------------------------------------------------------------------------


class Thinker(nn.Module):
    """``Qwen3ForCausalLM`` with a dense and a paged forward."""

    def __init__(self, config: ThinkerConfig) -> None:
        super().__init__()
        self.config = config
        self.model = ThinkerModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.tie_weights()

    def tie_weights(self) -> None:
        self.lm_head.weight = self.model.embed_tokens.weight

    # inputs

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings, (N,) -> (N, H) (any leading shape works).

        Ids may live on any device: the range check runs where they are and they move to the
        embedding's device afterwards, so host-side ids (the engine's decoded tokens) cost no
        device sync for the check."""
        if token_ids.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"Thinker.embed: token ids must be int32/int64, got {token_ids.dtype}")
        if token_ids.numel() and (int(token_ids.min()) < 0 or int(token_ids.max()) >= self.config.vocab_size):
            raise ValueError(
                f"Thinker.embed: token ids must be in [0, {self.config.vocab_size}), "
                f"got range [{int(token_ids.min())}, {int(token_ids.max())}]"
            )
        # non_blocking: a host-to-device copy that does not wait for the queued kernels (the ids'
        # values are read now, so the host tensor may go away at once)
        return self.model.embed_tokens(token_ids.to(self.model.embed_tokens.weight.device, non_blocking=True))

    def build_inputs_embeds(
        self, token_ids: torch.Tensor, spans: list[tuple[int, torch.Tensor]] | None = None
    ) -> torch.Tensor:
        """Embed ``token_ids`` (N,) and overwrite rows ``start .. start+len`` with each span (len, H).

        Spans carry non-text inputs (audio embeddings); the token ids under a span are
        placeholders and their embeddings are discarded. Spans must not overlap.
        """
        if token_ids.dim() != 1:
            raise ValueError(f"build_inputs_embeds: token_ids must be 1-D, got shape {tuple(token_ids.shape)}")
        embeds = self.embed(token_ids)
        n, hidden = embeds.shape
        covered_until = -1
        for start, span in sorted(spans or [], key=lambda s: s[0]):
            if span.dim() != 2 or span.shape[1] != hidden:
                raise ValueError(
                    f"build_inputs_embeds: span at {start} must be (len, {hidden}), got {tuple(span.shape)}"
                )
            end = start + span.shape[0]
            if start < 0 or end > n:
                raise ValueError(f"build_inputs_embeds: span [{start}, {end}) is outside the {n} input positions")
            if start < covered_until:
                raise ValueError(
                    f"build_inputs_embeds: span at {start} overlaps the previous span (ends {covered_until})"
                )
            embeds[start:end] = span.to(embeds.dtype)
            covered_until = end
        return embeds

    # forwards

    def forward_dense(self, inputs_embeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Causal forward without a cache: (B, T, H), positions (B, T) -> logits (B, T, V)."""
        hidden = self.config.hidden_size
        if inputs_embeds.dim() != 3 or inputs_embeds.shape[-1] != hidden:
            raise ValueError(f"forward_dense: inputs_embeds must be (B, T, {hidden}), got {tuple(inputs_embeds.shape)}")
        if tuple(positions.shape) != tuple(inputs_embeds.shape[:2]):
            raise ValueError(
                f"forward_dense: positions {tuple(positions.shape)} must be (B, T) = {tuple(inputs_embeds.shape[:2])}"
            )
        # Angles in float32, tables cast to the activation dtype (as transformers does).
        cos, sin = rope_cos_sin(positions, self.config.head_dim, self.config.rope_theta, inputs_embeds.dtype)
        x = inputs_embeds
        for layer in self.model.layers:
            x = layer(x, cos, sin)
        return self.compute_logits(self.model.norm(x))

    def forward_paged(self, inputs_embeds: torch.Tensor, batch: PagedBatch, cache: PagedKVCache) -> torch.Tensor:
        """One ragged step over the paged cache: (N, H) -> final-norm hidden states (N, H).

        Writes the K/V of all N tokens into their slots; sequences read earlier tokens from
        their block tables. Call ``compute_logits`` / ``logits_at`` on the result.
        """
        cfg = self.config
        check_paged_step(
            "Thinker", inputs_embeds, batch, cache, hidden_size=cfg.hidden_size,
            num_layers=cfg.num_hidden_layers, num_kv_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim,
        )  # fmt: skip
        cos, sin = rope_cos_sin(batch.positions, self.config.head_dim, self.config.rope_theta, inputs_embeds.dtype)
        x = inputs_embeds
        for layer in self.model.layers:
            x = layer(x, cos, sin, batch, cache)
        return self.model.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def logits_at(self, hidden: torch.Tensor, batch: PagedBatch, seq_indices: list[int] | None = None) -> torch.Tensor:
        """Logits of the last new token of each sequence (or of ``seq_indices``): (B, V).

        A sequence with no new token in this step (a full cache hit) has no last token here;
        asking for it is an error, since its logits need the last token recomputed.
        """
        last = batch.last_token_indices
        wanted = range(batch.num_seqs) if seq_indices is None else seq_indices
        rows = []
        for b in wanted:
            if last[b] is None:
                raise ValueError(f"logits_at: sequence {b} has no new tokens in this batch")
            rows.append(last[b])
        return self.compute_logits(hidden[torch.tensor(rows, dtype=torch.long).to(hidden.device, non_blocking=True)])

    # cache and loading

    def make_kv_cache(
        self,
        num_blocks: int,
        block_size: int = 16,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        storage_dtype: torch.dtype | None = None,
    ) -> PagedKVCache:
        """A KV pool shaped for this model (defaults: the weights' dtype and device; ``storage_dtype``
        ``torch.float8_e4m3fn`` stores fp8 with per-token scales, ``precision.kv_cache_dtype``)."""
        weight = self.lm_head.weight
        return PagedKVCache(
            self.config.num_hidden_layers, num_blocks, block_size, self.config.num_key_value_heads,
            self.config.head_dim, dtype or weight.dtype, device or weight.device, storage_dtype,
        )  # fmt: skip

    @classmethod
    def from_pretrained(
        cls, path: str | Path, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"
    ) -> "Thinker":
        """Load a plain Qwen3 checkpoint dir, or the ``llm.`` part of a MiniCPM-o one."""
        try:
            config = ThinkerConfig.from_hf_config(select_qwen3_config(read_hf_config(path)))
        except ValueError as exc:   # a config.json this model cannot be: the checkpoint's fault
            raise CheckpointError("thinker config", reason=f"{path}: {exc}") from exc
        prefix = _detect_prefix(checkpoint_keys(path))
        state = load_state_dict(path, prefix=prefix)
        state = {k: v.to(device, dtype) if v.is_floating_point() else v.to(device) for k, v in state.items()}
        if config.tie_word_embeddings and "lm_head.weight" not in state and "model.embed_tokens.weight" in state:
            state["lm_head.weight"] = state["model.embed_tokens.weight"]  # tied files store it once
        with torch.device("meta"):
            model = cls(config)
        load_strict(model, state, component="thinker", assign=True)
        if config.tie_word_embeddings:
            model.tie_weights()  # assign=True replaced the shared parameter with two
        logger.info("thinker: loaded %s (prefix %r, %s, %s)", path, prefix, dtype, device)
        return model.eval()


def _detect_prefix(keys: list[str]) -> str | None:
    if "model.embed_tokens.weight" in keys:
        return None
    if "llm.model.embed_tokens.weight" in keys:
        return "llm."
    raise CheckpointError(
        "thinker",
        reason="found neither 'model.embed_tokens.weight' (Qwen3) nor 'llm.model.embed_tokens.weight' (MiniCPM-o); "
        f"first keys: {sorted(keys)[:5]}",
    )


def num_parameters(config: ThinkerConfig) -> int:
    """Parameter count of a config, computed on the meta device (no memory)."""
    with torch.device("meta"):
        model = Thinker(config)
    return sum(p.numel() for p in model.parameters())


__all__ = [
    "MINICPMO_MAX_SPECIAL_TOKEN_ID",
    "Thinker",
    "ThinkerConfig",
    "num_parameters",
    "select_qwen3_config",
]
