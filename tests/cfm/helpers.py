"""Tiny Stage-2 models and the single-session reference loop for the cfm tests."""
from __future__ import annotations

import math

import torch

from duplexcache.cfm.code2wav import BatchedCode2Wav
from duplexcache.cfm.config import Code2WavConfig, Code2WavShape
from duplexcache.models.flow import FlowConfig, build_flow, trim_stream_cache
from duplexcache.models.vocoder import HiftStreamState, VocoderConfig, build_vocoder, hift_stream_step

TAIL = 8            # cache tail (100 in production; small here so trims happen within 3 chunks)
CHUNK = 5           # tokens per chunk, + 3 lookahead
LOOKAHEAD = 3


def randomize(module: torch.nn.Module, seed: int) -> None:
    """Random weights everywhere (the reference zero-inits adaLN and output layers)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            fan_in = p.shape[-1] if p.dim() >= 2 else 1
            std = 0.5 / math.sqrt(fan_in) if p.dim() >= 2 else 0.1
            p.copy_(torch.randn(p.shape, generator=gen) * std)


_MODELS: dict = {}


def tiny_models():
    """(flow, hift), built once per test session (deterministic)."""
    if not _MODELS:
        torch.manual_seed(0)
        flow = build_flow(FlowConfig.tiny())
        randomize(flow, 1)
        hift = build_vocoder(VocoderConfig.tiny())
        randomize(hift, 2)
        _MODELS["m"] = (flow, hift)
    return _MODELS["m"]


def make_config(flow, **kw) -> Code2WavConfig:
    base = dict(shape=Code2WavShape.from_flow(flow), max_num_seqs=8, cache_tail_frames=TAIL,
                max_prompt_frames=24, max_chunk_tokens=CHUNK + LOOKAHEAD, key_bucket=8,
                prompt_bank_frames=1 + 4 * 24,   # room for the tests' voices: the bank never moves
                use_cuda_graphs=False)
    base.update(kw)
    return Code2WavConfig(**base)


def voice_inputs(seed: int, num_tokens: int):
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 6561, (num_tokens,), generator=gen)
    mel = torch.randn(num_tokens * 2, 80, generator=gen)
    spk = torch.randn(192, generator=gen)
    return tokens, mel, spk


def token_stream(seed: int, num_chunks: int, last_keeps_lookahead: bool = False) -> list[torch.Tensor]:
    """Chunks of CHUNK + LOOKAHEAD tokens (the lookahead is the next chunk's start). The final
    chunk has no lookahead left (CHUNK tokens), or keeps 3 extra tokens (a wider final chunk)."""
    gen = torch.Generator().manual_seed(seed)
    toks = torch.randint(0, 6561, (num_chunks * CHUNK + LOOKAHEAD,), generator=gen)
    out = []
    for k in range(num_chunks):
        end = (k + 1) * CHUNK
        last = k == num_chunks - 1
        keep = LOOKAHEAD if (not last or last_keeps_lookahead) else 0
        out.append(toks[k * CHUNK:end + keep])
    return out


def reference_stream(flow, hift, voice, chunks, pad_token: int, tail: int = TAIL, seed: int = 0):
    """Single-session path: flow.setup_cache / inference_chunk + trim + hift_stream_step."""
    tokens, mel, spk = voice
    pad = torch.full((LOOKAHEAD,), pad_token, dtype=torch.long)
    cache = flow.setup_cache(torch.cat([tokens, pad])[None], mel[None], spk[None])
    state = HiftStreamState.create(80)
    gen = torch.Generator().manual_seed(seed)
    mels, pcms = [], []
    for k, tok in enumerate(chunks):
        last = k == len(chunks) - 1
        feat, cache = flow.inference_chunk(tok[None], spk[None], cache, last_chunk=last)
        cache = trim_stream_cache(cache, mel.shape[0], tail)
        mels.append(feat[0])
        pcms.append(hift_stream_step(hift, state, feat, last, gen)[0])
    return mels, pcms


def new_stage(flow, hift, graph_backend=None, **kw) -> BatchedCode2Wav:
    return BatchedCode2Wav(flow, hift, make_config(flow, **kw), graph_backend=graph_backend)


def run_plan(stage, voices, plan, num_ticks, device="cpu"):
    """Drive ``stage`` tick by tick. plan: sid -> (voice, start tick, chunks); every session
    starts at its tick and sends one chunk per tick, the last marked final. Returns
    sid -> (mels, pcms), the mels on the CPU."""
    for name, (tok, mel, spk) in voices.items():
        stage.register_voice(name, tok, mel, spk)
    got = {sid: ([], []) for sid in plan}
    for tick in range(num_ticks):
        chunks, last = {}, {}
        for sid, (voice, start, toks) in plan.items():
            if tick == start:
                stage.add_session(sid, voice, seed=len(sid))
            k = tick - start
            if 0 <= k < len(toks):
                chunks[sid], last[sid] = toks[k].to(device), k == len(toks) - 1
        out = stage.step(chunks, last)
        assert not out.errors, out.errors
        for sid in chunks:
            got[sid][0].append(stage.sessions[sid].last_mel.cpu().clone())
            got[sid][1].append(out[sid])
    return got
