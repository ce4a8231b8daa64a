"""Configuration of the batched Stage-2 (Code2Wav) runner.

Leaf classes (arena, caches, registry) take plain values; only `BatchedCode2Wav` reads this.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class Code2WavShape:
    """Shapes that decide Stage-2 cache bytes (the flow's estimator and conformer)."""

    n_timesteps: int = 10
    depth: int = 16            # DiT blocks
    num_heads: int = 8
    head_dim: int = 64
    hidden_size: int = 512
    mel_bins: int = 80
    conformer_blocks: int = 6 + 4    # encoders + up_encoders
    conformer_heads: int = 8
    conformer_size: int = 512

    @classmethod
    def minicpmo45(cls) -> "Code2WavShape":
        return cls()

    @classmethod
    def from_flow(cls, flow: torch.nn.Module, n_timesteps: int = 10) -> "Code2WavShape":
        est = flow.decoder.estimator
        attn = est.blocks[0].attn
        enc = flow.encoder
        enc_attn = enc.encoders[0].self_attn
        return cls(
            n_timesteps=n_timesteps,
            depth=len(est.blocks),
            num_heads=attn.num_heads,
            head_dim=attn.head_dim,
            hidden_size=est.in_proj.out_features,
            mel_bins=est.out_channels,
            conformer_blocks=len(enc.encoders) + len(enc.up_encoders),
            conformer_heads=enc_attn.h,
            conformer_size=enc.output_size(),
        )

    def att_frame_bytes(self, dtype_bytes: int = 4) -> int:
        """Bytes of one frame of one session's estimator attention cache (K and V, cfg 2)."""
        return self.n_timesteps * self.depth * 2 * self.num_heads * 2 * self.head_dim * dtype_bytes

    def conformer_frame_bytes(self, dtype_bytes: int = 4) -> int:
        d_k = self.conformer_size // self.conformer_heads
        return self.conformer_blocks * self.conformer_heads * 2 * d_k * dtype_bytes

    def estimator_cnn_bytes(self, dtype_bytes: int = 4) -> int:
        # each block's causal conv pair keeps 2 frames of (hidden + hidden) channels, cfg 2
        return self.n_timesteps * self.depth * 2 * 2 * self.hidden_size * 2 * dtype_bytes


@dataclass
class Code2WavConfig:
    """Runtime settings of `BatchedCode2Wav`.

    `prompt_att_sharing` is the deploy switch `cfm_prompt_att_sharing`;
    `arena_rows_from_graph_grid` is `cfm_arena_rows_from_graph_grid`; `graph_grid` is the
    parsed `DUPLEXCACHE_CFM_GRAPH_GRID` (see `duplexcache.config_values.parse_graph_grid`).
    """

    shape: Code2WavShape = field(default_factory=Code2WavShape)
    max_num_seqs: int = 16
    prompt_att_sharing: bool = False
    arena_rows_from_graph_grid: bool = False
    graph_grid: tuple[int, ...] = ()
    cfg_rate: float = 0.7
    cache_tail_frames: int = 100     # Token2wav.stream keeps the last 100 cache entries
    max_prompt_frames: int = 300     # largest voice prompt P in mel frames (6 s reference)
    max_chunk_tokens: int = 28       # 25 + 3 lookahead
    pre_lookahead_len: int = 3
    up_rate: int = 2
    vocab_size: int = 6561
    # The speech tokenizer's silence token: Token2wav pads the voice prompt with 3 of them, and
    # MiniCPM-o's duplex driver seeds each turn's chunk buffer with 3 (runtime/stages/code2wav_stage.py).
    prompt_pad_token: int = 4218
    key_bucket: int = 64             # cache-length bucket granularity of captured graphs
    # engine.batch_invariant: every solve attends over the arena's whole key capacity instead of
    # the group's largest cache bucket, so a row's reduction over keys has one length whatever
    # the cache lengths of the rows beside it (the masked keys add exact zeros, but a longer
    # reduction is blocked differently: the last bits moved, issue 42).
    fixed_key_length: bool = False
    # Frames of the arena's prompt bank allocated up front (every voice's P + 1 zero frame): a
    # voice that does not fit reallocates the bank and drops the graphs that read it.
    prompt_bank_frames: int = 1
    mel_cache_len: int = 8           # vocoder: 160 ms of mel kept between chunks
    samples_per_frame: int = 480     # 24 kHz / 50 Hz
    use_cuda_graphs: bool = True     # only used on CUDA devices
    # The vocoder as CUDA graphs too (deploy engine.cuda_graphs; with the arena's graph
    # backend, so CUDA only), for calls of these (mel frames with the cache, source-cache
    # samples) shapes: the engine's chunks (runtime/code2wav_stage.vocoder_graph_shapes).
    vocoder_cuda_graphs: bool = True
    vocoder_graph_shapes: tuple[tuple[int, int], ...] = ()

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if not 0.0 < self.cfg_rate:
            raise ValueError(f"cfg_rate must be > 0, got {self.cfg_rate}")
        if self.cache_tail_frames < 1:
            raise ValueError(f"cache_tail_frames must be >= 1, got {self.cache_tail_frames}")
        if self.max_prompt_frames < self.cache_tail_frames:
            raise ValueError(
                f"max_prompt_frames ({self.max_prompt_frames}) must be >= cache_tail_frames "
                f"({self.cache_tail_frames})")
        if not 0 <= self.prompt_pad_token < self.vocab_size:
            raise ValueError(
                f"prompt_pad_token {self.prompt_pad_token} outside vocabulary of {self.vocab_size}")
        if self.prompt_bank_frames < 1:
            raise ValueError(f"prompt_bank_frames must be >= 1 (the zero frame), got {self.prompt_bank_frames}")
        if self.max_chunk_tokens <= self.pre_lookahead_len:
            raise ValueError("max_chunk_tokens must exceed pre_lookahead_len")

    @property
    def silence_token(self) -> int:
        return self.prompt_pad_token

    @property
    def source_cache_len(self) -> int:
        return self.mel_cache_len * self.samples_per_frame

    @property
    def max_chunk_frames(self) -> int:
        # a final chunk keeps its lookahead tokens, so all tokens become frames
        return self.max_chunk_tokens * self.up_rate

    @property
    def max_cache_frames(self) -> int:
        return self.max_prompt_frames + self.cache_tail_frames
