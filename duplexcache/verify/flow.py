"""``duplexcache verify flow``: our Stage 2 (flow + HiFT) against minicpmo-utils 1.0.5.

Both sides get the same weights (``--checkpoint DIR`` with ``flow.pt`` and ``hift.pt``, or
``--preset NAME --random-weights``) and the same noise buffer. One session is then streamed
through both exactly as ``Token2wav.stream`` does it: ``setup_cache`` over a random voice
prompt (P mel frames, prompt tokens + 3 pad tokens), ``inference_chunk`` per 25-token chunk
plus 3 lookahead tokens (the last chunk without lookahead, ``last_chunk=True``), the cache
trim to the first P + last 100 frames, then the HiFT streaming step, with the same RNG seed
before each vocoder call. Relative error = max|ours - ref| / max|ref| over all chunks.

Exit codes: 0 mel and waveform within tolerance, 1 above it, 2 a checkpoint that cannot be
loaded (or unusable arguments).

The reference is a test-only dependency: it is imported lazily, by ``import_reference`` only,
never at module import. ``stepaudio2/__init__.py`` imports token2wav.py, which needs
s3tokenizer, torchaudio and hyperpyyaml; we register an empty package object for
``stepaudio2`` so that only the flow and HiFT submodules are imported. ``minicpmo45``
with ``--random-weights`` is meant for a GPU (8B-free, but ~0.6 GB of float32 weights and a
2 GB reference scratch buffer).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import logging
import sys
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.nn as nn

from duplexcache.models.checkpoint import CheckpointError, load_state_dict, load_strict
from duplexcache.models.flow import CausalMaskedDiffWithXvec, FlowConfig, build_flow, trim_stream_cache
from duplexcache.models.vocoder import (
    HiFTGenerator, HiftStreamState, VocoderConfig, build_vocoder, hift_state_dict_from_checkpoint, hift_stream_step,
)
from duplexcache.verify.common import (
    FLOAT32_TOLERANCE,
    exit_unusable,
    missing_reference,
    reference_import_failed,
    relative_error,
    verdict,
)

logger = logging.getLogger(__name__)

PRESETS: dict[str, Callable[[], tuple[FlowConfig, VocoderConfig]]] = {
    "tiny": lambda: (FlowConfig.tiny(), VocoderConfig.tiny()),
    "minicpmo45": lambda: (FlowConfig.minicpmo45(), VocoderConfig.minicpmo45()),
}
TARGET = "flow"
# reference module -> the pip requirement providing it (checked before anything runs)
REFERENCE_PACKAGES = {"stepaudio2": "minicpmo-utils==1.0.5"}
TOLERANCE = FLOAT32_TOLERANCE
CHUNK_TOKENS = 25
SILENCE_TOKEN = 4218  # Token2wav.set_stream_cache's right pad
REF_SCRATCH_STEPS = 16  # the reference's scratch buffers hold 16 Euler steps ...
REF_SCRATCH_FRAMES = 1000  # ... of up to 1000 frames


# ----------------------------------------------------------------------------------------
# The reference (lazy)
# ----------------------------------------------------------------------------------------


def import_reference() -> types.SimpleNamespace:
    """Import the reference flow/HiFT modules without running ``stepaudio2/__init__``."""
    if "stepaudio2" not in sys.modules:
        spec = importlib.util.find_spec("stepaudio2")
        if spec is None or not spec.submodule_search_locations:
            raise ModuleNotFoundError("minicpmo-utils (package stepaudio2) is not installed")
        pkg = types.ModuleType("stepaudio2")
        pkg.__path__ = list(spec.submodule_search_locations)
        sys.modules["stepaudio2"] = pkg
    return types.SimpleNamespace(
        flow=importlib.import_module("stepaudio2.cosyvoice2.flow.flow"),
        flow_matching=importlib.import_module("stepaudio2.cosyvoice2.flow.flow_matching"),
        decoder_dit=importlib.import_module("stepaudio2.cosyvoice2.flow.decoder_dit"),
        encoder=importlib.import_module("stepaudio2.cosyvoice2.transformer.upsample_encoder_v2"),
        hifigan=importlib.import_module("stepaudio2.flashcosyvoice.modules.hifigan"),
        common=importlib.import_module("stepaudio2.cosyvoice2.utils.common"),
    )


def build_reference_flow(cfg: FlowConfig, device: torch.device | str = "cpu") -> nn.Module:
    """The reference CausalMaskedDiffWithXvec with `cfg`'s hyperparameters (random init).

    The reference hard-codes its scratch buffers for the full shapes (16 layers, 8 heads,
    1024 conv channels); they are rebuilt for `cfg`'s widths with the same 16 steps x 1000
    frames, which for ``minicpmo45`` is exactly the original size.
    """
    ref = import_reference()
    with torch.device(device):
        encoder = ref.encoder.UpsampleConformerEncoderV2(
            input_size=cfg.input_size, output_size=cfg.encoder_output_size, input_layer="linear",
            pre_lookahead_len=cfg.pre_lookahead_len, num_blocks=cfg.num_blocks, num_up_blocks=cfg.num_up_blocks,
            up_stride=cfg.up_stride, up_scale_factor=cfg.up_scale_factor, attention_heads=cfg.encoder_heads,
            pos_enc_layer_type="rel_pos_espnet", selfattention_layer_type="rel_selfattn", key_bias=cfg.key_bias,
            linear_units=cfg.encoder_linear_units, normalize_before=True, activation_type="swish",
        )
        dit = ref.decoder_dit.DiT(
            in_channels=cfg.dit_in_channels, out_channels=cfg.output_size, mlp_ratio=cfg.dit_mlp_ratio,
            depth=cfg.dit_depth, num_heads=cfg.dit_heads, head_dim=cfg.dit_head_dim, hidden_size=cfg.dit_hidden_size,
        )
    # build the solver on meta: its 2 GB scratch is replaced right below
    with torch.device("meta"):
        cfm = ref.flow_matching.CausalConditionalCFM(dit, inference_cfg_rate=cfg.inference_cfg_rate)
    with torch.device(device):
        flow = ref.flow.CausalMaskedDiffWithXvec(
            input_size=cfg.input_size, output_size=cfg.output_size, spk_embed_dim=cfg.spk_embed_dim,
            vocab_size=cfg.vocab_size, encoder=encoder, decoder=cfm,
        )
    h, hd2, depth = cfg.dit_heads, 2 * cfg.dit_head_dim, cfg.dit_depth
    z = dict(device=device, dtype=torch.float32)
    dit.cnn_cache_buffer = torch.zeros(depth, 2, 2 * cfg.dit_hidden_size, 2, **z)
    dit.att_cache_buffer = torch.zeros(depth, 2, h, REF_SCRATCH_FRAMES, hd2, **z)
    cfm.cnn_cache_buffer = torch.zeros(REF_SCRATCH_STEPS, depth, 2, 2 * cfg.dit_hidden_size, 2, **z)
    cfm.att_cache_buffer = torch.zeros(REF_SCRATCH_STEPS, depth, 2, h, REF_SCRATCH_FRAMES, hd2, **z)
    cfm.rand_noise = torch.zeros(1, cfg.output_size, cfg.noise_frames, **z)  # set by copy_noise
    if torch.device(device).type != "meta":
        # pos_bias_u/v are built with the legacy torch.Tensor() constructor, which ignores the
        # default device: move them with the rest
        flow.to(device)
    return flow.eval()


def build_reference_hift(cfg: VocoderConfig, device: torch.device | str = "cpu") -> nn.Module:
    ref = import_reference()
    with torch.device(device):
        f0 = ref.hifigan.ConvRNNF0Predictor(cond_channels=cfg.f0_cond_channels)
        hift = ref.hifigan.HiFTGenerator(
            in_channels=cfg.in_channels, base_channels=cfg.base_channels, nb_harmonics=cfg.nb_harmonics,
            sampling_rate=cfg.sampling_rate, nsf_alpha=cfg.nsf_alpha, nsf_sigma=cfg.nsf_sigma,
            nsf_voiced_threshold=cfg.nsf_voiced_threshold, upsample_rates=list(cfg.upsample_rates),
            upsample_kernel_sizes=list(cfg.upsample_kernel_sizes),
            istft_params={"n_fft": cfg.n_fft, "hop_len": cfg.hop_len},
            resblock_kernel_sizes=list(cfg.resblock_kernel_sizes),
            resblock_dilation_sizes=[list(d) for d in cfg.resblock_dilation_sizes],
            source_resblock_kernel_sizes=list(cfg.source_resblock_kernel_sizes),
            source_resblock_dilation_sizes=[list(d) for d in cfg.source_resblock_dilation_sizes],
            lrelu_slope=cfg.lrelu_slope, audio_limit=cfg.audio_limit, f0_predictor=f0,
        )
    return hift.eval()


def copy_noise(ours: CausalMaskedDiffWithXvec, ref_flow: nn.Module) -> None:
    """The noise buffer is not in flow.pt; give the reference ours (fixed seed)."""
    ref_flow.decoder.rand_noise = ours.decoder.rand_noise.clone()


# ----------------------------------------------------------------------------------------
# Weights
# ----------------------------------------------------------------------------------------


@torch.no_grad()
def randomize_flow_(flow: nn.Module, seed: int) -> None:
    """Random weights that exercise every path (the reference zero-inits adaLN and the
    final layer, which would make the estimator output exactly zero)."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in flow.named_parameters():
        r = torch.randn(p.shape, generator=gen)
        if p.dim() == 1 and ("norm" in name or name.endswith(".out.1.weight") or name.endswith(".block.3.weight")):
            if name.endswith("weight"):
                r = 1.0 + 0.1 * r
            else:
                r = 0.1 * r
        elif p.dim() == 1:
            r = 0.02 * r
        else:
            r = r / (p[0].numel() ** 0.5)
        p.copy_(r.to(p.device, p.dtype))


@torch.no_grad()
def randomize_hift_(hift: nn.Module, seed: int) -> None:
    """Keep HiFT's own random init but make the F0 predictor voiced (~100-200 Hz), so the
    harmonic source path is exercised rather than only the unvoiced noise."""
    gen = torch.Generator().manual_seed(seed)
    cls = hift.f0_predictor.classifier
    cls.weight.copy_((0.01 * torch.randn(cls.weight.shape, generator=gen)).to(cls.weight.device))
    cls.bias.copy_((100 + 100 * torch.rand(cls.bias.shape, generator=gen)).to(cls.bias.device))


def load_checkpoint_dir(directory: str | Path) -> tuple[dict, dict]:
    """flow.pt and hift.pt state dicts of a MiniCPM-o ``assets/token2wav`` directory."""
    directory = Path(directory)
    out = []
    for name in ("flow.pt", "hift.pt"):
        path = directory / name
        if not path.is_file():
            raise CheckpointError(name.split(".")[0], reason=f"no {name} in {directory}")
        out.append(load_state_dict(path))
    return out[0], hift_state_dict_from_checkpoint(out[1])


# ----------------------------------------------------------------------------------------
# Streaming both sides
# ----------------------------------------------------------------------------------------


@dataclass
class StreamInputs:
    prompt_token: torch.Tensor  # (1, P/2 + 3) prompt tokens + 3 silence tokens
    prompt_mel: torch.Tensor  # (1, P, 80)
    spk: torch.Tensor  # (1, spk_dim)
    chunks: list[tuple[torch.Tensor, bool]]  # (tokens (1, 28) or last (1, 25), last_chunk)
    seed: int


def make_inputs(cfg: FlowConfig, prompt_tokens: int, num_chunks: int, seed: int,
                device: torch.device | str = "cpu") -> StreamInputs:
    if prompt_tokens < 1 or num_chunks < 1:
        raise ValueError("prompt_tokens and num_chunks must be >= 1")
    gen = torch.Generator().manual_seed(seed)
    la = cfg.pre_lookahead_len
    prompt = torch.randint(0, cfg.vocab_size, (1, prompt_tokens), generator=gen)
    pad = torch.full((1, la), SILENCE_TOKEN % cfg.vocab_size, dtype=prompt.dtype)
    mel = torch.randn(1, prompt_tokens * cfg.up_stride, cfg.output_size, generator=gen)
    spk = torch.randn(1, cfg.spk_embed_dim, generator=gen)
    tokens = torch.randint(0, cfg.vocab_size, (1, num_chunks * CHUNK_TOKENS + la), generator=gen)
    chunks = []
    for i in range(num_chunks):
        last = i == num_chunks - 1
        end = (i + 1) * CHUNK_TOKENS + (0 if last else la)
        chunks.append((tokens[:, i * CHUNK_TOKENS: end].to(device), last))
    return StreamInputs(torch.cat([prompt, pad], 1).to(device), mel.to(device), spk.to(device), chunks, seed)


def stream_ours(flow: CausalMaskedDiffWithXvec, hift: HiFTGenerator, inp: StreamInputs,
                n_timesteps: int) -> tuple[list[torch.Tensor], list[torch.Tensor], dict]:
    """-> per-chunk mel (1, 80, t), per-chunk pcm (1, n), the final flow cache."""
    p = inp.prompt_mel.shape[1]
    cache = flow.setup_cache(inp.prompt_token, inp.prompt_mel, inp.spk, n_timesteps=n_timesteps)
    state = HiftStreamState.create(flow.output_size, inp.prompt_mel.device)
    mels, wavs = [], []
    for i, (tokens, last) in enumerate(inp.chunks):
        mel, cache = flow.inference_chunk(tokens, inp.spk, cache, last_chunk=last, n_timesteps=n_timesteps)
        cache = trim_stream_cache(cache, p)
        torch.manual_seed(inp.seed * 1000 + i)  # the NSF source draws from the RNG
        wavs.append(hift_stream_step(hift, state, mel, last))
        mels.append(mel)
    return mels, wavs, cache


def stream_reference(flow: nn.Module, hift: nn.Module, inp: StreamInputs,
                     n_timesteps: int) -> tuple[list[torch.Tensor], list[torch.Tensor], dict]:
    """Token2wav.set_stream_cache + Token2wav.stream, transcribed (its own module needs CUDA,
    torchaudio and s3tokenizer) around the reference modules."""
    import numpy as np

    common = import_reference().common
    p = inp.prompt_mel.shape[1]
    dev = inp.prompt_mel.device
    mel_cache_len, source_cache_len = 8, 8 * 480
    window = torch.from_numpy(np.hamming(2 * source_cache_len))  # float64, CPU (common.fade_in_out works on CPU)
    stream_cache = flow.setup_cache(inp.prompt_token, inp.prompt_mel, inp.spk, n_timesteps=n_timesteps)
    hc = dict(mel=torch.zeros(1, inp.prompt_mel.shape[2], 0, device=dev), source=torch.zeros(1, 1, 0, device=dev),
              speech=torch.zeros(1, 0, device=dev))
    mels, wavs = [], []
    for i, (tokens, last) in enumerate(inp.chunks):
        chunk_mel, stream_cache = flow.inference_chunk(token=tokens, spk=inp.spk, cache=stream_cache,
                                                       last_chunk=last, n_timesteps=n_timesteps)
        # the scratch buffers are overwritten by the next call; keep our own copy of the output
        chunk_mel = chunk_mel.clone()
        if stream_cache["estimator_att_cache"].shape[4] > p + 100:
            att = stream_cache["estimator_att_cache"]
            stream_cache["estimator_att_cache"] = torch.cat([att[:, :, :, :, :p], att[:, :, :, :, -100:]], dim=4)
        if stream_cache["conformer_att_cache"].shape[3] > p + 100:
            att = stream_cache["conformer_att_cache"]
            stream_cache["conformer_att_cache"] = torch.cat([att[:, :, :, :p, :], att[:, :, :, -100:, :]], dim=3)
        mel = torch.concat([hc["mel"], chunk_mel], dim=2)
        torch.manual_seed(inp.seed * 1000 + i)
        speech, source = hift(mel, hc["source"])
        if hc["speech"].shape[-1] > 0:
            speech = common.fade_in_out(speech, hc["speech"], window)
        is_first_chunk = hc["speech"].shape[-1] == 0
        hc = dict(mel=mel[..., -mel_cache_len:].clone(), source=source[:, :, -source_cache_len:].clone(),
                  speech=speech[:, -source_cache_len:].clone())
        if not last:
            if is_first_chunk:
                speech = torch.cat([torch.zeros(1, source_cache_len, device=dev), speech[:, :-source_cache_len]], 1)
            else:
                speech = speech[:, :-source_cache_len]
        mels.append(chunk_mel)
        wavs.append(speech)
    return mels, wavs, stream_cache


# ----------------------------------------------------------------------------------------
# CLI
# ----------------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--checkpoint", help="directory with flow.pt and hift.pt (assets/token2wav)")
    parser.add_argument("--preset", choices=sorted(PRESETS), default=None,
                        help="model shape (default minicpmo45 with --checkpoint); tiny for CPU")
    parser.add_argument("--random-weights", action="store_true", help="seeded random weights instead of a checkpoint")
    parser.add_argument("--chunks", type=int, default=4, help="streamed chunks of 25 tokens (>= 3)")
    parser.add_argument("--prompt-tokens", type=int, default=None, help="voice prompt tokens (default 10 tiny, 150)")
    parser.add_argument("--n-timesteps", type=int, default=10)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tolerance", type=float, default=TOLERANCE)


def run(args: argparse.Namespace) -> int:
    missing = missing_reference(TARGET, REFERENCE_PACKAGES)
    if missing is not None:
        return missing
    # Unlike the other targets, --preset also names the shape of a --checkpoint here.
    if (args.checkpoint is None) == (not args.random_weights):
        return exit_unusable(TARGET, "give exactly one of --checkpoint DIR or --random-weights (with --preset)")
    if args.chunks < 3:
        return exit_unusable(TARGET, "--chunks must be >= 3")
    preset = args.preset or ("minicpmo45" if args.checkpoint else "tiny")
    flow_cfg, voc_cfg = PRESETS[preset]()
    device = torch.device(args.device)
    torch.manual_seed(args.seed)
    ours_flow, ours_hift = build_flow(flow_cfg, device), build_vocoder(voc_cfg, device)
    try:
        ref_flow, ref_hift = build_reference_flow(flow_cfg, device), build_reference_hift(voc_cfg, device)
    except ImportError as exc:  # installed, but one of the reference's own dependencies is not
        return reference_import_failed(TARGET, exc)
    try:
        if args.checkpoint:
            flow_sd, hift_sd = load_checkpoint_dir(args.checkpoint)
            load_strict(ours_flow, flow_sd, "flow")
            load_strict(ours_hift, hift_sd, "hift")
        else:
            randomize_flow_(ref_flow, args.seed)
            randomize_hift_(ref_hift, args.seed + 1)
            load_strict(ours_flow, ref_flow.state_dict(), "flow")
            load_strict(ours_hift, ref_hift.state_dict(), "hift")
    except CheckpointError as exc:
        return exit_unusable(TARGET, f"cannot load checkpoint: {exc}")
    if args.checkpoint:  # same weights on the reference side
        ref_flow.load_state_dict(ours_flow.state_dict(), strict=True)
        ref_hift.load_state_dict(ours_hift.state_dict(), strict=True)
    copy_noise(ours_flow, ref_flow)
    prompt_tokens = args.prompt_tokens or (10 if preset == "tiny" else 150)
    inp = make_inputs(flow_cfg, prompt_tokens, args.chunks, args.seed, device)
    ref_mels, ref_wavs, _ = stream_reference(ref_flow, ref_hift, inp, args.n_timesteps)
    our_mels, our_wavs, _ = stream_ours(ours_flow, ours_hift, inp, args.n_timesteps)
    mel_err = relative_error(torch.cat(our_mels, 2), torch.cat(ref_mels, 2))
    wav_err = relative_error(torch.cat(our_wavs, 1), torch.cat(ref_wavs, 1))
    exact = all(torch.equal(a, b) for a, b in zip(our_mels + our_wavs, ref_mels + ref_wavs))
    print(f"verify flow: preset={preset} device={device} chunks={args.chunks} prompt_frames={inp.prompt_mel.shape[1]}")
    print(f"  mel      max rel err {mel_err:.3e}")
    print(f"  waveform max rel err {wav_err:.3e}")
    print(f"  bit-exact: {exact}")
    if args.chunks < 4:
        # P -> P+50 -> P+100 -> trimmed after chunk 3: only chunk 4 onwards reads a trimmed cache
        print("  note: the P+100 cache trim first affects chunk 4; use --chunks >= 4 to cover it")
    return verdict(TARGET, mel_err <= args.tolerance and wav_err <= args.tolerance, f"{args.tolerance:g}")
