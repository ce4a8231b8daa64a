"""The tick's Code2Wav stage: a session's audio turn, from the Talker's codes to PCM.

Chunking, as MiniCPM-o 4.5's own duplex driver feeds ``Token2wav.stream``: each turn's code
buffer starts with 3 silence tokens (4218, the token the voice prompt is padded with), and a
chunk is the buffer's first 28 codes (25 + 3 lookahead), after which 25 are consumed. A unit's
25 codes therefore complete a chunk in the tick that made them: the chunk is the 3 codes carried
over (``EngineSession.held``: silence at a turn start, else the previous unit's last 3) and the
unit's 25, whose last 3 are the lookahead. When the turn ends, the 3 carried codes go out as the
final chunk (``last``: 6 mel frames plus the vocoder's cross-fade tail) in the same tick::

    unit        u1               u2                 u3 (turn_eos)
    Talker      c1               c2                 c3
    Code2Wav    sil3 + c1        c1[-3:] + c2       c2[-3:] + c3, then c3[-3:] (final)

So a reply's first audio leaves in the tick of its first speaking unit, not one unit later.

Each turn is one Code2Wav stream (``"<sid>#<turn>"``, prompt state from the voice, caches
reset), as in the reference's per-response ``Token2wav.stream``; its noise is seeded by the
session's admission ordinal and the turn number, never by the server's wire ids.

Ownership: ``BatchedCode2Wav`` owns the streams; this stage owns the session's turn fields
(``c2w_sid``, ``held``, ``turn_index``) and ends a turn as a whole: stream, carried codes and
the Talker KV of the turn (through ``TalkerBlocks``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import zlib
from collections.abc import Callable

import torch

from duplexcache.cfm.code2wav import BatchedCode2Wav
from duplexcache.cfm.config import Code2WavConfig as CfmConfig
from duplexcache.cfm.config import Code2WavShape
from duplexcache.config import DeployConfig
from duplexcache.kv.talker_blocks import TalkerBlocks
from duplexcache.runtime import turns
from duplexcache.runtime.bundle import ModelBundle, engine_flow
from duplexcache.runtime.engine_api import AudioDelta, EngineEvent, ResponseDone, SessionError
from duplexcache.runtime.engine_session import EndSession, EngineSession, FinalChunk, SessionTable, Unit, ended
from duplexcache.runtime.isolation import FaultInjector, precheck
from duplexcache.runtime.policy import ControlTokens

logger = logging.getLogger(__name__)

LOOKAHEAD = 3   # codes of a chunk that only condition it (Code2WavConfig.pre_lookahead_len)


def chunk_widths(config: CfmConfig, tokens_per_unit: int) -> tuple[int, int]:
    """Mel frames of the chunks this stage sends: non-final (3 carried + the unit's codes, the
    last 3 the lookahead the conformer consumes) and final (the 3 carried codes, their lookahead
    padded)."""
    return (LOOKAHEAD + tokens_per_unit - config.pre_lookahead_len) * config.up_rate, LOOKAHEAD * config.up_rate


def vocoder_graph_shapes(config: CfmConfig, tokens_per_unit: int) -> tuple[tuple[int, int], ...]:
    """(mel frames with the cache, source-cache samples) of every vocoder call a stream makes:
    its first chunk (no cache), the continuing ones, its final one, and a final first chunk."""
    non_final, final = chunk_widths(config, tokens_per_unit)
    cache, source = config.mel_cache_len, config.source_cache_len
    return (non_final, 0), (cache + non_final, source), (cache + final, source), (final, 0)


def code2wav_config(deploy: DeployConfig, models: ModelBundle) -> CfmConfig:
    """Code2Wav's config for the deploy's switches, its arena sized for the longest voice prompt."""
    c = deploy.code2wav
    frames = [models.voices.get(v).prompt_frames for v in models.voices.names()]
    prompt = max(frames)
    config = CfmConfig(shape=Code2WavShape.from_flow(models.flow), max_num_seqs=c.max_num_seqs,
                       prompt_att_sharing=c.cfm_prompt_att_sharing,
                       arena_rows_from_graph_grid=c.cfm_arena_rows_from_graph_grid,
                       graph_grid=c.graph_grid or (), max_prompt_frames=max(prompt, 100),
                       prompt_bank_frames=1 + sum(frames),   # every voice's prompt, stored once
                       use_cuda_graphs=models.device.type == "cuda",
                       vocoder_cuda_graphs=deploy.engine.cuda_graphs,   # the vocoder's graphs: CUDA only
                       fixed_key_length=deploy.engine.batch_invariant)
    return dataclasses.replace(
        config, vocoder_graph_shapes=vocoder_graph_shapes(config, models.talker.config.tokens_per_unit))


def build_code2wav(deploy: DeployConfig, models: ModelBundle) -> BatchedCode2Wav:
    """Code2Wav with every voice registered: each voice's prompt state is computed here, once,
    and lives as long as the engine (shared by the voice's streams when sharing is on)."""
    config = code2wav_config(deploy, models)
    # The stage hands Code2Wav the Talker's codes unchecked (``ids_in_vocab``): they are drawn below
    # the end code, so every one of them must be a Code2Wav token.
    if models.talker.config.end_token_id > min(config.vocab_size, models.flow.vocab_size):
        raise ValueError(f"the Talker draws codes below {models.talker.config.end_token_id}, past Code2Wav's "
                         f"vocabulary of {min(config.vocab_size, models.flow.vocab_size)}")
    code2wav = BatchedCode2Wav(engine_flow(deploy, models), models.hift, config)
    for v in models.voices.names():
        voice = models.voices.get(v)
        code2wav.register_voice(v, voice.prompt_tokens, voice.prompt_mel, voice.spk)
    return code2wav


def pcm16_bytes(pcm: torch.Tensor) -> bytes:
    """float PCM in [-1, 1] -> little-endian int16 bytes (clipped)."""
    return pcm16_batch([pcm])[0]


def pcm16_batch(pcms: list[torch.Tensor]) -> list[bytes]:
    """``pcm16_bytes`` of each chunk, converted together on their device and copied to the host
    once: one device sync per Code2Wav step instead of one per session. Clamp, scale and
    round-half-to-even are exact float32 operations, so the bytes are those of the host path."""
    if not pcms:
        return []
    flat = torch.cat([p.detach().reshape(-1).float() for p in pcms])
    ints = torch.round(torch.clamp(flat, -1.0, 1.0) * 32767.0).to(torch.int16).cpu().numpy().astype("<i2")
    out, start = [], 0
    for p in pcms:
        out.append(ints[start:start + p.numel()].tobytes())
        start += p.numel()
    return out


@dataclasses.dataclass(frozen=True)
class _QueuedAudio:
    """A chunk's PCM still on the device, in its place among the stage's events until
    ``_audio_to_host`` turns every queued chunk of the tick into an ``AudioDelta``."""

    sid: str
    pcm: torch.Tensor


def _audio_to_host(events: list[EngineEvent | _QueuedAudio]) -> list[EngineEvent]:
    """Every queued chunk to int16 bytes with one copy to the host, in event order.

    The stage's steps (a restarted turn's final chunk, the unit's chunks, the final chunks) used
    to copy their PCM after each step; that wait left the device idle while the host issued the
    next step (its conformer is host-bound). Copying once after the last step lets the host issue
    every step while the device still runs the ones before; the bytes are the same."""
    queued = [e for e in events if isinstance(e, _QueuedAudio)]
    converted = iter(pcm16_batch([e.pcm for e in queued]))
    return [AudioDelta(e.sid, next(converted)) if isinstance(e, _QueuedAudio) else e for e in events]


class Code2WavStage:
    """Audio turns over one ``BatchedCode2Wav``."""

    def __init__(self, code2wav: BatchedCode2Wav, talker_kv: TalkerBlocks, control: ControlTokens,
                 table: SessionTable, end: EndSession, on_step: Callable[[], None]) -> None:
        self.code2wav = code2wav
        self.talker_kv = talker_kv
        self.control = control
        self.table = table
        self.end = end
        self.on_step = on_step          # after the steps, while the tick's streams are all open
        self.faults: FaultInjector | None = None

    # ------------------------------------------------------------------ turns

    def close_turn(self, s: EngineSession, finals: dict[str, FinalChunk], response_done: bool = True) -> None:
        """End the audio turn: its carried codes become the final chunk; the Talker KV resets."""
        assert s.c2w_sid is not None
        if s.held is not None:
            finals[s.c2w_sid] = FinalChunk(s, s.held, response_done)
        else:
            self.code2wav.remove_session(s.c2w_sid)
        s.held, s.c2w_sid = None, None
        self.talker_kv.free(s.sid)

    def drop_turn(self, s: EngineSession) -> None:
        """Forget the current audio turn without a final chunk (a cancel, or the session ends):
        its stream, its carried codes and its Talker KV."""
        if s.c2w_sid is not None:
            self.code2wav.remove_session(s.c2w_sid)
            s.c2w_sid, s.held = None, None
        self.talker_kv.free(s.sid)

    def drop_ended_finals(self, finals: dict[str, FinalChunk], gone: set[str]) -> dict[str, FinalChunk]:
        """Remove the closed-turn streams of sessions this tick ended (ending a session only
        knows its current turn's stream); returns the finals of the others."""
        for csid, f in finals.items():
            if f.session.sid in gone:
                with contextlib.suppress(ValueError):   # already removed (unknown stream)
                    self.code2wav.remove_session(csid)
        return {csid: f for csid, f in finals.items() if f.session.sid not in gone}

    # ------------------------------------------------------------------ the stage

    def run(self, units: list[Unit], finals: dict[str, FinalChunk]) -> list[EngineEvent]:
        """Every speaking unit's chunk (carried codes + its 25) in one batched step, then the
        final chunks of every turn that ended in this tick in a second one.

        ``finals`` holds the turns the Talker stage closed before this unit. One of them whose
        session speaks again in this unit (a Talker turn at its limit restarts the audio stream)
        is flushed in a step of its own first, so the old turn's tail plays before the new one.
        The steps' PCM goes to the host in one copy after the last of them (``_audio_to_host``)."""
        chunks: dict[str, torch.Tensor] = {}
        owner = {csid: f.session for csid, f in finals.items()}
        closed_before = set(finals)
        silence = self.code2wav.config.silence_token
        for u in units:
            s = u.session
            if u.codes is None:
                continue
            if s.c2w_sid is None:
                s.turn_index += 1
                s.c2w_sid = f"{s.sid}#{s.turn_index}"
                seed = zlib.crc32(f"{s.seed_name}#{s.turn_index}".encode())
                self.code2wav.add_session(s.c2w_sid, s.voice.name, seed=seed)
                s.held = torch.full((LOOKAHEAD,), silence, dtype=u.codes.dtype, device=u.codes.device)
            owner[s.c2w_sid] = s
            chunks[s.c2w_sid] = torch.cat([s.held, u.codes])
            s.held = u.codes[-LOOKAHEAD:]
            if u.tokens and u.tokens[-1] == self.control.turn_eos:
                self.close_turn(s, finals)
        events: list[EngineEvent | _QueuedAudio] = []
        speaking = {owner[csid].sid for csid in chunks}
        restarted = {csid: f.codes for csid, f in finals.items()
                     if csid in closed_before and f.session.sid in speaking}
        final_chunks = {csid: f.codes for csid, f in finals.items() if csid not in restarted}
        for batch, last in ((restarted, True), (chunks, False), (final_chunks, True)):
            gone = ended(events)   # a session ended by an earlier step has no later chunk
            batch = {csid: codes for csid, codes in batch.items() if owner[csid].sid not in gone}
            if batch:
                events += self._step(batch, last, owner)
        self.on_step()
        events = _audio_to_host(events)
        for csid, f in self.drop_ended_finals(finals, ended(events)).items():
            self.code2wav.remove_session(csid)
            if f.response_done:
                events.append(ResponseDone(f.session.sid, "completed", self.table.finish_reply(f.session)))
        return events

    def _step(self, batch: dict[str, torch.Tensor], last: bool,
              owner: dict[str, EngineSession]) -> list[EngineEvent | _QueuedAudio]:
        """One Code2Wav step. A chunk that fails its check (the injected fault, or
        ``BatchedCode2Wav``'s own per-session validation) ends its session only. Code2Wav
        mutates every stream's caches group by group, so a batch that raises anyway cannot be
        re-run: that step's sessions skip this unit's audio (non-fatal ``audio_skipped``, their
        turn's stream restarts at the next speaking unit); the tick's other work is kept."""
        events: list[EngineEvent | _QueuedAudio] = []
        kept, errors = precheck(self.faults, "code2wav", list(batch), lambda csid: owner[csid].sid)
        for csid, err in ((c, errors[owner[c].sid]) for c in batch if owner[c].sid in errors):
            events.append(self.end(owner[csid], err))
        batch = {csid: batch[csid] for csid in kept}
        if not batch:
            return events
        try:
            # the chunks are the Talker's codes and the silence token, all in the vocabulary
            out = self.code2wav.step(batch, {sid: last for sid in batch}, ids_in_vocab=True)
        except Exception as err:  # noqa: BLE001 - see the docstring: the unit is skipped
            logger.error("Code2Wav step over %d streams failed; their audio for this unit is skipped: %r",
                         len(batch), err)
            for csid in batch:
                s = owner[csid]
                if s.c2w_sid == csid:
                    self.code2wav.remove_session(csid)
                    s.c2w_sid, s.held = None, None
                turns.note_audio(s.turn, 0, final=last)
                events.append(SessionError(s.sid, "audio_skipped", "this unit's audio could not be produced",
                                           fatal=False))
            return events
        for csid, err in out.errors.items():
            logger.error("Code2Wav refused %s: %s", csid, err)
            turns.note_audio(owner[csid].turn, 0, final=last)
            events.append(self.end(owner[csid], err))
        for csid, pcm in out.items():
            events.append(_QueuedAudio(owner[csid].sid, pcm))
            owner[csid].code2wav_chunks += 1
            turns.note_audio(owner[csid].turn, int(pcm.numel()), final=last)
        return events
