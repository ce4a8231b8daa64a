"""The duplex engine end to end on the tiny preset (CPU, random weights)."""
from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from engine_helpers import audio, collect, engine, tiny_models

from duplexcache.models.thinker import Thinker
from duplexcache.runtime.engine_api import EngineAPI, ServerBehindError, SessionAdmitted
from duplexcache.server.metrics import ServerMetrics

SHARING_ON = {"stage0": {"shared_anchor_blocks": True},
              "context_cache": {"duplex_context_caching": True},
              "code2wav": {"cfm_prompt_att_sharing": True}}
VOICES = ["default", "alt", "default", "alt"]


def _run_four(eng, ticks: int = 2) -> dict:
    sids = [eng.open_session({"voice": v, "instructions": "be brief"}) for v in VOICES]
    for i, sid in enumerate(sids):
        eng.push_audio(sid, audio(i, ticks))
    got = {}
    for _ in range(ticks):
        for sid, d in collect(eng.tick()).items():
            slot = got.setdefault(sid, {"audio": [], "text": [], "done": 0, "errors": []})
            for k in ("audio", "text", "errors"):
                slot[k] += d[k]
            slot["done"] += d["done"]
    return {VOICES[i] + str(i): got[sid] for i, sid in enumerate(sids)}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("engine")
    on, off = engine(tmp, "on", SHARING_ON), engine(tmp, "off")
    assert isinstance(on, EngineAPI)
    return _run_four(on), _run_four(off), on


def test_four_sessions_two_voices_speak_one_turn(runs):
    on, _, eng = runs
    cfg = eng.code2wav.config
    chunk = cfg.shape.mel_bins and 25 * cfg.up_rate * cfg.samples_per_frame      # 1 s at 24 kHz
    for name, d in on.items():
        assert not d["errors"], d["errors"]
        # default policy (k=2): units 0 and 1 are one turn; each unit's chunk leaves in its own
        # tick (3 silence codes + unit 0's, then unit 0's last 3 + unit 1's); unit 1's last 3
        # codes are the final chunk (6 frames + the vocoder's cross-fade tail).
        tail = 2 * 3 * cfg.samples_per_frame + cfg.source_cache_len
        assert [len(a) // 2 for a in d["audio"]] == [chunk, chunk, tail], name
        assert chunk == 24_000
        assert d["done"] == 1 and len(d["text"]) == 2 and all(d["text"])
    pcm = np.frombuffer(on["default0"]["audio"][0], dtype="<i2")
    assert np.abs(pcm).max() > 0


def test_sharing_switches_do_not_change_audio_bytes(runs):
    on, off, _ = runs
    assert on.keys() == off.keys()
    for name in on:
        assert len(on[name]["audio"]) >= 2
        assert on[name]["audio"] == off[name]["audio"], name   # bytes equality, both chunks
        assert on[name]["text"] == off[name]["text"]
    # different voices give different audio (the comparison above is not vacuous)
    assert on["default0"]["audio"] != on["alt1"]["audio"]


def test_200_open_stream_close_cycles_leave_pools_as_they_started(tmp_path):
    eng = engine(tmp_path, "cycles", SHARING_ON)
    start_talker = eng.talker_pool.num_free

    def cycle(i: int) -> None:
        sid = eng.open_session({"voice": VOICES[i % 2], "instructions": f"cycle {i % 3}"})
        eng.tick()                        # opens it in Stage 0 (context cache, shared anchors)
        if i % 10 == 0:                   # every 10th also streams a speaking unit (Talker + Code2Wav)
            eng.push_audio(sid, audio(i, 1))
            eng.tick()
        eng.close_session(sid)
        eng.tick()                        # frees it

    for i in range(6):                    # every distinct context (2 voices x 3 instructions) once
        cycle(i)
    warm = eng.stage0.pool_stats()        # shared context blocks stay cached (LRU) by design
    assert warm.cached_free > 0
    for i in range(6, 200):
        cycle(i)
    assert eng.stage0.pool_stats() == warm
    assert warm.used == 0 and warm.free == warm.num_blocks
    eng.thinker_manager.check_invariants()
    assert eng.talker_pool.num_free == start_talker == eng.talker_pool.num_usable_blocks
    assert not eng.code2wav.sessions and not eng.code2wav._pending
    # no stream left, but the voice's prompt state stays (fixed): 200 sessions' turns, one pass per voice
    assert eng.code2wav.registry.ref_count("default") == 0 and eng.code2wav.voice_bytes("default") > 0
    assert eng.stats().cfm_prompt_passes == {v: 1 for v in eng.voices.names()}
    assert len(eng.ledger) == 0
    assert (eng.ledger.thinker_reserved, eng.ledger.talker_reserved, eng.ledger.dynamic_reserved) == (0, 0, 0)
    s = eng.stats()
    assert s.live_sessions == 0 and s.pools["thinker_kv"].private == 0 and s.pools["code2wav"].private == 0


def test_context_length_exceeded_ends_only_that_session(tmp_path):
    base = tiny_models()
    torch.manual_seed(0)
    short_thinker = Thinker(dataclasses.replace(base.thinker.config, max_position_embeddings=160)).eval()
    models = dataclasses.replace(base, thinker=short_thinker)
    eng = engine(tmp_path, "cle", {"stage0": {"window": {"mode": "off"}}}, models=models)
    long_sid = eng.open_session({"voice": "default", "instructions": "x" * 100})
    short_sid = eng.open_session({"voice": "alt"})
    for i, sid in enumerate((long_sid, short_sid)):
        eng.push_audio(sid, audio(i, 4))
    errors, short_events = [], []
    for _ in range(4):
        got = collect(eng.tick())
        errors += got.get(long_sid, {}).get("errors", [])
        short_events.append(got.get(short_sid, {}))
        assert not got.get(short_sid, {}).get("errors")
    assert len(errors) == 1 and errors[0].code == "context_length_exceeded" and errors[0].fatal
    assert long_sid not in eng.stage0.sessions and long_sid not in eng.ledger
    assert short_sid in eng.stage0.sessions and eng.stats().live_sessions == 1
    assert all(e.get("text") for e in short_events)          # the other session kept going
    with pytest.raises(ValueError, match="unknown"):
        eng.push_audio(long_sid, audio(0, 1))
    eng.close_session(long_sid)                               # idempotent after a fatal error


def test_queued_session_is_admitted_when_one_closes(tmp_path):
    eng = engine(tmp_path, "queue")
    cap = eng.plan.planned_sessions
    sids = [eng.open_session({"voice": "default"}) for _ in range(cap)]
    queued = eng.open_session({"voice": "default"}, queue_if_full=True)
    assert eng.is_queued(queued) and eng.stats().queued_sessions == 1
    with pytest.raises(ValueError, match="queued"):
        eng.push_audio(queued, audio(0, 1))
    eng.tick()
    assert eng.is_queued(queued)
    eng.close_session(sids[0])
    events = eng.tick()
    assert SessionAdmitted(queued) in events and not eng.is_queued(queued)
    eng.push_audio(queued, audio(0, 1))
    eng.shutdown()
    assert eng.stats().live_sessions == 0


def test_talker_is_conditioned_on_the_rows_lm_head_consumed(tmp_path, monkeypatch):
    """The Talker's condition rows are the Thinker hidden states that produced each text/end
    token: row j equals (torch.equal) the lm_head input of the session in decode call j,
    captured here independently with a pre-hook (the engine itself reads StepResult.hidden)."""
    import duplexcache.runtime.stages.talker_stage as talker_mod

    eng = engine(tmp_path, "cond")
    reqs = []
    real = talker_mod.generate_unit

    def recording(model, cache, requests, **kw):
        reqs.extend(requests)
        return real(model, cache, requests, **kw)

    monkeypatch.setattr(talker_mod, "generate_unit", recording)
    sids = [eng.open_session({"voice": v}) for v in ("default", "alt")]
    eng.tick()                                    # opens both in Stage 0
    for i, sid in enumerate(sids):
        eng.push_audio(sid, audio(i, 1))
    calls: list[torch.Tensor] = []
    hook = eng.models.thinker.lm_head.register_forward_pre_hook(lambda m, a: calls.append(a[0].clone()))
    try:
        eng.tick()                                # one speaking unit each (k=2)
    finally:
        hook.remove()
    assert len(reqs) == 2
    hidden = [torch.stack(list(req.thinker_hidden)) for req in reqs]   # rows as the stage passes them
    for req, rows in zip(reqs, hidden):
        assert rows.shape == (len(req.text_token_ids), eng.models.thinker.config.hidden_size) and len(rows) >= 2
        for j in range(len(rows)):                # calls[0] is the append that chose <|speak|>
            assert sum(torch.equal(rows[j], r) for r in calls[1 + j]) == 1, j
    assert not torch.equal(hidden[0], hidden[1])


def test_audio_faster_than_real_time_is_refused_without_losing_the_session(tmp_path):
    from duplexcache.runtime.engine import MAX_BUFFERED_SAMPLES

    eng = engine(tmp_path, "flood")
    sid = eng.open_session({"voice": "default"})
    second = np.zeros(16000, dtype=np.float32)
    for _ in range(MAX_BUFFERED_SAMPLES // second.size):
        eng.push_audio(sid, second)
    with pytest.raises(ValueError, match="buffer of session .* is full.*send audio in real time") as refused:
        eng.push_audio(sid, second[:1])
    assert not isinstance(refused.value, ServerBehindError)   # 10 s sent at once: the client's fault
    eng.tick()  # consumes a unit, which makes room again
    eng.push_audio(sid, second)
    eng.shutdown()


def test_a_full_buffer_of_a_real_time_client_is_the_servers_fault(tmp_path):
    """Audio sent in real time piles up only when the ticks fall behind: the refusal must say
    so (server_behind), not tell a real-time client to slow down (issue 11)."""
    from duplexcache.runtime.engine import MAX_BUFFERED_SAMPLES

    eng = engine(tmp_path, "behind_client")
    now = [100.0]
    eng.table.clock = lambda: now[0]
    sid = eng.open_session({"voice": "default"})
    second = np.zeros(16000, dtype=np.float32)
    for _ in range(MAX_BUFFERED_SAMPLES // second.size):   # one second per second, no tick runs
        eng.push_audio(sid, second)
        now[0] += 1.0
    with pytest.raises(ServerBehindError, match="server is running behind real time") as refused:
        eng.push_audio(sid, second)
    assert refused.value.code == "server_behind"
    eng.shutdown()


def test_a_caller_named_session_hears_what_the_engine_numbered_one_hears(tmp_path, runs):
    """The server names engine sessions with its wire ids; the random draws stay seeded by the
    engine's admission ordinal, so naming changes no audio byte. An id in use is refused."""
    _, off, _ = runs
    eng = engine(tmp_path, "named")
    sids = [eng.open_session({"voice": v, "instructions": "be brief"}, sid=f"wire_{i}") for i, v in enumerate(VOICES)]
    assert sids == [f"wire_{i}" for i in range(len(VOICES))] and eng.session_ids() == sids
    with pytest.raises(ValueError, match="in use"):
        eng.open_session({"voice": VOICES[0]}, sid="wire_0")
    for i, sid in enumerate(sids):
        eng.push_audio(sid, audio(i, 2))
    got: dict = {}
    for _ in range(2):
        for sid, d in collect(eng.tick()).items():
            got.setdefault(sid, []).extend(d["audio"])
    for i, sid in enumerate(sids):
        assert got[sid] == off[VOICES[i] + str(i)]["audio"], sid


def test_sessions_behind_counts_sessions_holding_a_whole_extra_unit(tmp_path):
    eng = engine(tmp_path, "behind")
    late, on_time = eng.open_session({"voice": "default"}), eng.open_session({"voice": "alt"})
    eng.push_audio(late, audio(0, 3))      # three units: the next tick takes one, two stay
    eng.push_audio(on_time, audio(1, 1))
    assert eng.sessions_behind() == 0      # not opened yet: the first tick prefills their contexts
    eng.tick()
    assert eng.sessions_behind() == 1      # `late` still holds two whole units
    # `on_time` gets its next unit, and a part of the one after: audio that arrives while a tick
    # runs is not a unit behind (it held nothing right after its take)
    eng.push_audio(on_time, audio(2, 2)[:16000 + 9000])
    assert eng.sessions_behind() == 1
    eng.tick()
    assert eng.sessions_behind() == 1      # `late` held two units at this tick: one is still due
    eng.push_audio(on_time, audio(3, 2)[:16000 - 9000])
    eng.tick()
    assert eng.sessions_behind() == 0      # `late` caught up; `on_time` never was behind
    for sid in (late, on_time):
        eng.close_session(sid)


def test_a_session_one_unit_behind_is_behind(tmp_path):
    """A session that held a whole unit after its take (it opened with a unit of backlog, and its
    audio keeps coming in real time) is a unit behind for good unless it gets an extra tick; the
    first rule (two whole units held after a tick) never saw it."""
    eng = engine(tmp_path, "one_behind")
    sid = eng.open_session({"voice": "default"})
    eng.push_audio(sid, audio(4, 3)[:16_560 + 16_000 + 4_000])   # a unit of backlog and a part
    eng.tick()
    assert eng.table.get_live(sid).left_after_take == 20_000
    assert eng.sessions_behind() == 1
    eng.tick()                                                   # the extra tick takes it
    assert eng.sessions_behind() == 0 and eng.table.get_live(sid).left_after_take == 4_000
    eng.close_session(sid)


def test_prefill_between_ticks_keeps_chunks_out_of_the_tick_and_changes_no_byte(tmp_path):
    """scheduler.prefill_between_ticks: the server runs the chunks with ``prefill_step`` before the
    tick, the tick then runs none, and the session hears and says exactly what it does when its
    context prefills inside ticks (the same chunks, the same KV)."""
    sections = {"engine": {"prefill_chunk_tokens": 32}}
    session = {"voice": "default", "instructions": "speak slowly and kindly " * 12}

    def run(between: bool) -> tuple[dict, dict]:
        eng = engine(tmp_path, f"between_{between}", sections)
        chunks = {"tick": 0, "between": 0}
        where = ["tick"]
        real = eng.thinker_stage.open_pending

        def counted(*args, **kwargs):   # called only when a session is pending
            chunks[where[0]] += 1
            return real(*args, **kwargs)

        eng.thinker_stage.open_pending = counted
        sid = eng.open_session(session)
        while eng.prefill_pending():
            assert sum(chunks.values()) < 100
            if between:   # as the server does: a chunk in the slack, then the tick
                where[0] = "between"
                assert eng.prefill_step() == []
                where[0] = "tick"
            eng.tick()
        assert eng.session_info(sid).opened
        assert (eng.predicted_prefill_s() is not None) == between
        eng.push_audio(sid, audio(3, 3))
        got = {"audio": [], "text": []}
        for _ in range(3):
            d = collect(eng.tick()).get(sid, {"audio": [], "text": [], "errors": []})
            assert not d["errors"]
            got["audio"] += d["audio"]
            got["text"] += d["text"]
        eng.shutdown()
        return got, chunks

    inside, inside_chunks = run(between=False)
    between, between_chunks = run(between=True)
    assert inside_chunks["tick"] >= 3 and inside_chunks["between"] == 0   # several 32-token chunks
    assert between_chunks == {"tick": 0, "between": inside_chunks["tick"]}  # the same chunks, before the ticks
    assert between["audio"] and between["audio"] == inside["audio"]
    assert between["text"] == inside["text"]


def test_a_paced_engine_times_the_chunks_its_ticks_run(tmp_path):
    """With a server pacing chunks, a chunk the tick runs itself (the slack was too short) is
    timed, so the next one can be predicted and placed in the slack; it does not count as a chunk
    run between ticks."""
    eng = engine(tmp_path, "paced_tick_chunk", {"engine": {"prefill_chunk_tokens": 32}})
    eng.set_prefill_between_ticks(True)
    eng.open_session({"voice": "default", "instructions": "speak slowly and kindly " * 12})
    eng.tick()                                    # pending since this tick: left to the slack
    assert eng.predicted_prefill_s() is None and eng.prefill_pending()
    eng.tick()                                    # waited a whole tick: the tick runs a chunk
    assert eng.predicted_prefill_s() is not None
    assert not eng.scheduler.prefill_times.ran_since_tick
    eng.shutdown()


def test_a_late_tick_is_logged_with_its_stage_breakdown(tmp_path, caplog):
    eng = engine(tmp_path, "late_log")
    lat = {"encoder": 0.1, "thinker": 0.2, "talker": 0.3, "code2wav": 0.4, "tick": 1.5}
    with caplog.at_level("WARNING", logger="duplexcache.runtime.engine_stats"):
        eng.recorder.finish_tick(lat, period=1.0)
        eng.recorder.finish_tick({**lat, "tick": 0.99}, period=1.0)     # on time: not logged
    (record,) = [r for r in caplog.records if "ran late" in r.getMessage()]
    assert ("1.500 s > its period 1.000 s (ms: encoder 100, thinker 200, talker 300, code2wav 400, other 500; "
            "back-pressure: 1 late ticks)") in record.getMessage()
    assert eng.recorder.late_ticks == 1


@pytest.mark.parametrize("caching", [True, False])
def test_stats_pools_list_arena_and_context_cache(tmp_path, caching):
    window = {"mode": "basic", "high_tokens": 80, "low_tokens": 40}
    eng = engine(tmp_path, f"pools{caching}", {"stage0": {"window": window},
                                                "engine": {"speak_policy": {"k": 8}},   # listen units: cheap ticks
                                                "context_cache": {"duplex_context_caching": caching}})
    sid = eng.open_session({"voice": "default"})
    eng.push_audio(sid, audio(0, 1))
    assert not collect(eng.tick()).get(sid, {}).get("errors")
    with pytest.raises(ValueError, match="unknown session"):
        eng.session_info("nope")
    pools = eng.stats().pools
    assert pools["cfm_arena"].shared == eng.code2wav.arena.nbytes() > 0
    # one cached context: its embeddings (float32) and token ids (int64), from the layout
    hidden = eng.models.thinker.config.hidden_size
    anchor = eng.session_info(sid).thinker_anchor_tokens
    assert pools["context_cache"].shared == (anchor * (hidden * 4 + 8) if caching else 0)
    assert pools["cfm_arena"].private == pools["context_cache"].private == 0
    text, _ = (lambda m: (m.update(eng.stats()), m.render())[1])(ServerMetrics())
    assert b'pool="cfm_arena"' in text and b'pool="context_cache"' in text
