"""The engine feeds Code2Wav as MiniCPM-o 4.5's duplex driver feeds ``Token2wav.stream``.

The driver, written out here from its description (runtime/stages/code2wav_stage.py): each turn's buffer
starts with 3 silence tokens (4218); every time it holds 28 codes, its first 28 are a chunk and
25 are consumed; when the turn ends, whatever is left is the final chunk. The engine must send
exactly these chunks, each unit's chunk in the tick of that unit, and its audio must be the
single-stream reference loop's (flow.setup_cache / inference_chunk / trim, hift_stream_step) over
them.
"""
from __future__ import annotations

import sys
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
import engine_helpers
from engine_helpers import audio, collect, engine

from duplexcache.models.flow import trim_stream_cache
from duplexcache.models.vocoder import HiftStreamState, hift_stream_step
from duplexcache.runtime.stages.code2wav_stage import Code2WavStage, pcm16_bytes

SILENCE, CHUNK, LOOKAHEAD = 4218, 25, 3
# k = 5, turn_units = 3: units 0-1 listen, 2-4 speak (one turn, <|turn_eos|> in unit 4), 5-6 listen
POLICY = {"engine": {"speak_policy": {"mode": "every_k_units", "k": 5, "turn_units": 3}}}
TICKS = 7


def driver_windows(codes: list[int]) -> list[tuple[list[int], bool]]:
    """The official driver over one turn's codes: (chunk, last) in order."""
    buf, out = [SILENCE] * LOOKAHEAD + codes, []
    while len(buf) >= CHUNK + LOOKAHEAD:
        out.append((buf[:CHUNK + LOOKAHEAD], False))
        buf = buf[CHUNK:]
    out.append((buf, True))
    return out


def reference_pcm(eng, voice_name: str, windows, seed: int) -> list[torch.Tensor]:
    """One stream alone: the voice prompt's setup, then each window, trimmed as Token2wav.stream."""
    flow, hift, voice = eng.models.flow, eng.models.hift, eng.voices.get(voice_name)
    pad = torch.full((LOOKAHEAD,), SILENCE, dtype=torch.long)
    tokens = torch.cat([voice.prompt_tokens.long(), pad])[None]
    cache = flow.setup_cache(tokens, voice.prompt_mel[None], voice.spk[None])
    state, gen, out = HiftStreamState.create(80), torch.Generator().manual_seed(seed), []
    with torch.inference_mode():
        for chunk, last in windows:
            feat, cache = flow.inference_chunk(torch.tensor(chunk)[None], voice.spk[None], cache, last_chunk=last)
            cache = trim_stream_cache(cache, voice.prompt_mel.shape[0], eng.code2wav.config.cache_tail_frames)
            out.append(hift_stream_step(hift, state, feat, last, gen)[0])
    return out


def run_turn(tmp_path, monkeypatch):
    """One session through TICKS ticks; records per tick the Talker's codes, the chunks sent to
    Code2Wav and the session's events, and the turn's stream seed."""
    eng = engine(tmp_path, "driver", POLICY)
    codes_by_tick: list[list[int]] = []
    chunks_by_tick: list[list[tuple[list[int], bool]]] = []
    seeds: dict[str, int] = {}
    real_run, real_step, real_add = Code2WavStage.run, eng.code2wav.step, eng.code2wav.add_session

    def run(self, units, finals):
        codes_by_tick.append([c for u in units if u.codes is not None for c in u.codes.tolist()])
        chunks_by_tick.append([])
        return real_run(self, units, finals)

    def step(chunks, last=None, ids_in_vocab=False):
        for csid, tok in chunks.items():
            chunks_by_tick[-1].append((torch.as_tensor(tok).tolist(), bool((last or {}).get(csid, False))))
        return real_step(chunks, last, ids_in_vocab)

    def add_session(csid, voice, seed=0):
        seeds[csid] = seed
        return real_add(csid, voice, seed=seed)

    monkeypatch.setattr(Code2WavStage, "run", run)
    monkeypatch.setattr(eng.code2wav, "step", step)
    monkeypatch.setattr(eng.code2wav, "add_session", add_session)
    sid = eng.open_session({"voice": "alt"})
    eng.push_audio(sid, audio(3, TICKS))
    events = [collect(eng.tick()).get(sid, {"audio": [], "text": [], "done": 0, "errors": []}) for _ in range(TICKS)]
    return eng, sid, codes_by_tick, chunks_by_tick, seeds, events


def test_chunks_are_the_official_drivers_and_leave_in_the_units_tick(tmp_path, monkeypatch):
    eng, sid, codes, chunks, seeds, events = run_turn(tmp_path, monkeypatch)
    assert [len(c) for c in codes] == [0, 0, CHUNK, CHUNK, CHUNK, 0, 0]
    turn = codes[2] + codes[3] + codes[4]
    windows = driver_windows(turn)
    assert [len(w) for w, _ in windows] == [28, 28, 28, 3]
    # tick 2: the turn's first chunk (silence + unit 2's codes); tick 4: unit 4's chunk, then the final
    assert chunks == [[], [], windows[0:1], windows[1:2], windows[2:4], [], []]
    assert [len(e["audio"]) for e in events] == [0, 0, 1, 1, 2, 0, 0]
    assert [e["done"] for e in events] == [0, 0, 0, 0, 1, 0, 0]
    assert all(not e["errors"] for e in events)
    assert len(seeds) == 1 and eng.stats().live_sessions == 1


def test_audio_equals_the_single_stream_reference_over_the_drivers_chunks(tmp_path, monkeypatch):
    eng, sid, codes, _, seeds, events = run_turn(tmp_path, monkeypatch)
    windows = driver_windows(codes[2] + codes[3] + codes[4])
    (seed,) = seeds.values()
    ref = [pcm16_bytes(p) for p in reference_pcm(eng, "alt", windows, seed)]
    got = [a for e in events for a in e["audio"]]
    assert len(got) == len(ref) == 4
    cfg = eng.code2wav.config
    frames = 2 * CHUNK * cfg.samples_per_frame
    assert [len(a) // 2 for a in got] == [frames, frames, frames, 2 * LOOKAHEAD * cfg.samples_per_frame
                                          + cfg.source_cache_len]
    for a, b in zip(got, ref):
        x, y = np.frombuffer(a, "<i2").astype(np.int32), np.frombuffer(b, "<i2").astype(np.int32)
        assert np.abs(x - y).max() <= 1, "engine audio differs from the reference stream"
    assert np.abs(np.frombuffer(got[0], "<i2")).max() > 0
    assert seed == zlib.crc32(f"{eng.table.get_live(sid).seed_name}#1".encode())


def test_a_ticks_chunks_reach_the_host_in_one_copy(tmp_path, monkeypatch):
    """The tick that ends the turn runs two Code2Wav steps (unit 4's chunk, then the final one);
    their PCM is copied to the host once, after both, so the host issues the second step while
    the device still runs the first (one wait per tick, not per step)."""
    from duplexcache.runtime.stages import code2wav_stage
    copies: list[int] = []
    real = code2wav_stage.pcm16_batch

    def counting(pcms):
        copies.append(len(pcms))
        return real(pcms)

    monkeypatch.setattr(code2wav_stage, "pcm16_batch", counting)
    _, _, _, chunks, _, events = run_turn(tmp_path, monkeypatch)
    assert [len(c) for c in chunks] == [0, 0, 1, 1, 2, 0, 0]
    assert copies == [0, 0, 1, 1, 2, 0, 0]   # one conversion per tick, with all its chunks
    assert [len(e["audio"]) for e in events] == [0, 0, 1, 1, 2, 0, 0]


def test_the_engine_hands_code2wav_the_talkers_codes_unchecked_and_refuses_codes_past_its_vocabulary(
        tmp_path, monkeypatch):
    """The engine's chunks skip Code2Wav's range check (their codes are drawn below the Talker's end
    code); building Code2Wav refuses a Talker whose codes could reach past its vocabulary."""
    import dataclasses

    from duplexcache.cfm.code2wav import BatchedCode2Wav
    from duplexcache.config import DeployConfig
    from duplexcache.runtime.stages.code2wav_stage import build_code2wav

    checked: list[str] = []
    real = BatchedCode2Wav._check_tokens
    monkeypatch.setattr(BatchedCode2Wav, "_check_tokens",
                        lambda self, tok, who: (checked.append(who), real(self, tok, who)))
    _, _, _, chunks, _, events = run_turn(tmp_path, monkeypatch)
    assert sum(len(c) for c in chunks) == 4 and not [w for w in checked if w.startswith("session")]
    assert [len(e["audio"]) for e in events] == [0, 0, 1, 1, 2, 0, 0]
    models = engine_helpers.tiny_models()
    vocab = models.flow.vocab_size
    wide = dataclasses.replace(models.talker.config, num_audio_tokens=vocab + 2)   # end code at vocab + 1
    monkeypatch.setattr(models.talker, "config", wide)
    with pytest.raises(ValueError, match=f"codes below {vocab + 1}, past Code2Wav's vocabulary of {vocab}"):
        build_code2wav(DeployConfig.default("tiny"), models)
