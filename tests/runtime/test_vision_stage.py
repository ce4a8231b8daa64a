"""Issue 47: camera frames in a live session (runtime/stages/vision_stage.py), tiny preset on CPU.

Where a frame's rows land in the Thinker's input (checked against models/vision.unit_input_ids and
the vision model run on its own, from models/vision.preprocess_frame), that an audio-only session
beside a video one gives the same bytes as alone, batched vision against per-session vision, the
deploy switch from YAML, admission of video sessions, and bad frames refused without harm."""
from __future__ import annotations

import dataclasses
import io
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

sys.path.insert(0, str(Path(__file__).parent))
from engine_helpers import audio, collect, deploy_from_yaml, engine, tiny_models

from duplexcache.config import SessionConfigError
from duplexcache.models.vision import decode_jpeg, preprocess_frame, unit_input_ids
from duplexcache.runtime.bundle import build_models
from duplexcache.runtime.engine import DuplexEngine
from duplexcache.runtime.engine_api import AdmissionError, AudioDelta, TextDelta
from duplexcache.runtime.engine_session import Unit
from duplexcache.runtime.stages.vision_stage import (InvalidImageError, TooManyFrames, VisionUnavailable,
                                                     build_vision_model, decode_frame, frame_activation_bytes,
                                                     normalise)

VISION = {"model": {"vision": True}}
_VISION_MODELS: dict[str, object] = {}


def vision_models():
    """The shared tiny bundle plus a tiny vision model (built once)."""
    if "tiny" not in _VISION_MODELS:
        base = tiny_models()
        _VISION_MODELS["tiny"] = dataclasses.replace(
            base, vision=build_vision_model("tiny", base.thinker.config.hidden_size, base.dtype, base.device))
    return _VISION_MODELS["tiny"]


def jpeg(seed: int, width: int = 640, height: int = 480, fmt: str = "JPEG") -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, fmt)
    return buf.getvalue()


def _open(eng: DuplexEngine, *sessions: dict) -> list[str]:
    sids = [eng.open_session(s) for s in sessions]
    while eng.prefill_pending():
        eng.prefill_step()
    return sids


def _record_appends(eng: DuplexEngine) -> list[dict[str, torch.Tensor]]:
    appended: list[dict[str, torch.Tensor]] = []
    real = eng.stage0.append

    def recording(inputs, *args, **kwargs):
        if kwargs.get("unit_start"):   # a unit's rows (decoded tokens are appended too)
            appended.append({sid: rows.clone() for sid, rows in inputs.items()})
        return real(inputs, *args, **kwargs)

    eng.stage0.append = recording
    return appended


def test_a_frames_rows_sit_between_unit_and_audio(tmp_path):
    """Unit k of a video session appends [</unit>] <unit> <image> v1..v64 </image> a1..a10: the ids
    of models/vision.unit_input_ids embedded, v = the vision model on the frame alone (the
    reference preprocessing), a = what an audio-only twin with the same audio appended."""
    eng = engine(tmp_path, "layout", VISION, vision_models())
    video, twin = _open(eng, {"video": True}, {})
    frames = [jpeg(1), jpeg(2, 320, 480)]
    for f in frames:
        eng.push_frame(video, f)
    pcm = audio(5, 2)
    eng.push_audio(video, pcm)
    eng.push_audio(twin, pcm)
    appended = _record_appends(eng)
    eng.tick()
    eng.tick()
    assert len(appended) == 2
    tok = eng.models.tokenizer
    vision = eng.vision_stage.model
    for k, (rows_by_sid, frame) in enumerate(zip(appended, frames)):
        ids, vis, aud = unit_input_ids(tok, 10, frame=True, close_previous=k > 0)
        rows = rows_by_sid[video]
        assert rows.shape[0] == len(ids) == (78 if k else 77)
        with torch.no_grad():
            expected = eng.models.thinker.embed(torch.tensor(ids))
            expected[vis] = vision([preprocess_frame(decode_jpeg(frame), vision.cfg)])[0]
        expected[aud] = rows_by_sid[twin][-10:]
        assert torch.equal(rows, expected), k
        # the twin's unit is the same without the frame's 66 rows
        assert torch.equal(torch.cat([rows[:vis.start - 1], rows[vis.stop + 1:]]), rows_by_sid[twin])
    eng.shutdown()


def test_uint8_frames_normalise_to_the_reference_pixels():
    cfg = vision_models().vision.cfg
    for size in ((640, 480), (480, 640), (1280, 720), (57, 57)):
        data = jpeg(3, *size)
        frame = decode_frame(data, cfg)
        assert torch.equal(normalise(frame, cfg), preprocess_frame(decode_jpeg(data), cfg)), size


def _probe(tmp_path, with_video: bool) -> tuple[bytes, list[str], int]:
    eng = engine(tmp_path, f"by{with_video}", {**VISION, "engine": {
        "batch_invariant": True, "speak_policy": {"mode": "every_k_units", "k": 3, "turn_units": 3}}},
        vision_models())
    sessions = [{"instructions": "probe"}] + ([{"video": True, "instructions": "camera"}] if with_video else [])
    sids = _open(eng, *sessions)
    probe = sids[0]
    if with_video:
        for i in range(4):
            eng.push_frame(sids[1], jpeg(10 + i))
        eng.push_audio(sids[1], audio(9, 4))
    eng.push_audio(probe, audio(77, 4))
    pcm, text = bytearray(), []
    for _ in range(5):
        for e in eng.tick():
            if e.sid == probe and isinstance(e, AudioDelta):
                pcm += e.pcm16
            elif e.sid == probe and isinstance(e, TextDelta):
                text.append(e.text)
    frames = eng.vision_stage.frames_encoded
    eng.shutdown()
    return bytes(pcm), text, frames


def test_an_audio_session_beside_a_video_session_gives_its_bytes_alone(tmp_path):
    pcm, text, frames = _probe(tmp_path, False)
    assert len(pcm) > 0 and text and frames == 0
    got_pcm, got_text, got_frames = _probe(tmp_path, True)
    assert got_frames == 4
    assert got_text == text
    assert got_pcm == pcm


@pytest.mark.parametrize("batch_invariant", [True, False])
def test_batched_vision_over_two_sessions_equals_each_alone(tmp_path, batch_invariant):
    """One call over the tick's frames against one call per session. With engine.batch_invariant
    (the mode the tick runs the vision call in), same-size frames (a camera sends one size) are
    equal bit for bit; otherwise, and for frames of different sizes (padded to one length,
    masked), within 1e-5 of the largest value (models/vision.py's stated tolerance)."""
    eng = engine(tmp_path, f"batch{batch_invariant}", {**VISION, "engine": {"batch_invariant": batch_invariant}},
                 vision_models())
    a, b = _open(eng, {"video": True}, {"video": True})
    stage, cfg = eng.vision_stage, eng.vision_stage.cfg
    sess = {sid: eng.table.get_live(sid) for sid in (a, b)}
    for sizes, exact in ((((640, 480), (640, 480)), batch_invariant), (((640, 480), (300, 500)), False)):
        units = [Unit(sess[sid], np.zeros(1, np.float32), frame=decode_frame(jpeg(i, *size), cfg))
                 for i, (sid, size) in enumerate(zip((a, b), sizes))]
        with eng._numerics():
            together = stage._encode(units)
            alone = [stage._encode([u])[0] for u in units]
        assert not torch.equal(together[0][1:-1], together[1][1:-1])   # two frames, two outputs
        for rows, ref in zip(together, alone):
            assert rows.shape == (66, eng.models.thinker.config.hidden_size)
            if exact:
                assert torch.equal(rows, ref)
            else:
                assert float((rows - ref).abs().max() / ref.abs().max()) < 1e-5
    eng.shutdown()


def test_model_vision_reaches_the_engine_from_yaml(tmp_path):
    on = deploy_from_yaml(tmp_path, "on", VISION)
    assert on.model.vision is True
    models = build_models(on)
    assert models.vision is not None and models.vision.cfg.llm_hidden_size == models.thinker.config.hidden_size
    eng = DuplexEngine(on, models)
    assert eng.vision_stage is not None and eng.vision_stage.model is models.vision
    off = deploy_from_yaml(tmp_path, "off", {})
    assert off.model.vision is False
    assert build_models(off).vision is None
    plain = DuplexEngine(off, tiny_models())
    assert plain.vision_stage is None
    # audio-only sessions and the memory plan are the same with the switch on
    assert plain.plan == eng.plan
    audio_alone = plain.sizing.footprint(*plain.sizing.check_session({}))
    assert audio_alone == eng.sizing.footprint(*eng.sizing.check_session({}))
    eng.shutdown()
    sid = _open(plain, {})[0]
    with pytest.raises(VisionUnavailable, match="model.vision is false"):
        plain.push_frame(sid, jpeg(0))
    with pytest.raises(SessionConfigError, match="'video'.*no vision model"):
        plain.open_session({"video": True})
    plain.shutdown()


def test_a_video_session_reserves_more_and_needs_a_window_for_a_video_unit(tmp_path):
    eng = engine(tmp_path, "adm", {**VISION, "stage0": {"window": {"mode": "basic", "high_tokens": 512,
                                                                    "low_tokens": 256}}}, vision_models())
    cfg_a, voice = eng.sizing.check_session({})
    cfg_v, _ = eng.sizing.check_session({"video": True})
    fa, fv = eng.sizing.footprint(cfg_a, voice), eng.sizing.footprint(cfg_v, voice)
    extra = frame_activation_bytes(eng.vision_stage.cfg, eng.models.dtype)
    assert extra > 0
    assert fv.dynamic_private_bytes == fa.dynamic_private_bytes + extra
    assert fv.thinker_private_blocks == fa.thinker_private_blocks   # the window bounds both
    # 32 + 66 tokens of unit + 2 partial blocks of 15: a high mark of 127 cannot hold a video unit
    eng.open_session({"window": {"high_tokens": 100, "low_tokens": 50}})   # audio: fits
    with pytest.raises(AdmissionError, match="video unit") as err:
        eng.open_session({"video": True, "window": {"high_tokens": 100, "low_tokens": 50}})
    assert err.value.code == "context_length_exceeded"
    video = eng.open_session({"video": True, "window": {"high_tokens": 128, "low_tokens": 64}})
    audio_sid = eng.open_session({"window": {"high_tokens": 128, "low_tokens": 64}})
    room = eng.thinker_stage.user_text_room
    # a video unit leaves its user text 66 tokens less room (turns.text_room)
    assert room(eng.table.get_live(audio_sid)) - room(eng.table.get_live(video)) == 66
    eng.shutdown()


def test_the_window_compacts_a_video_session_and_it_goes_on(tmp_path):
    eng = engine(tmp_path, "win", {**VISION, "stage0": {"window": {"mode": "basic", "high_tokens": 256,
                                                                    "low_tokens": 128}}}, vision_models())
    sid = _open(eng, {"video": True})[0]
    prefix = eng.session_info(sid).thinker_anchor_tokens
    units = 6
    eng.push_audio(sid, audio(3, units))
    for i in range(units):
        eng.push_frame(sid, jpeg(i))
    for _ in range(units):
        out = collect(eng.tick())
        assert not out.get(sid, {}).get("errors")
        assert eng.session_info(sid).thinker_tokens <= prefix + 256
    assert eng.session_info(sid).units == units
    assert eng.stage0.compactions > 0
    eng.shutdown()


def test_bad_frames_are_refused_by_name_and_the_session_goes_on(tmp_path):
    eng = engine(tmp_path, "bad", VISION, vision_models())
    video, plain = _open(eng, {"video": True}, {})
    good = jpeg(4)
    cases = [
        (good[: len(good) // 2], InvalidImageError, "truncated"),
        (b"not an image at all", InvalidImageError, "not a decodable image"),
        (jpeg(4, 64, 64, "GIF"), InvalidImageError, "unsupported image format GIF"),
        (jpeg(4, 2000, 10), InvalidImageError, "aspect ratio"),
        (b"", InvalidImageError, "non-empty"),
    ]
    for data, exc, message in cases:
        with pytest.raises(exc, match=message):
            eng.push_frame(video, data)
    huge = io.BytesIO()
    Image.new("RGB", (5000, 4000)).save(huge, "PNG")
    with pytest.raises(InvalidImageError, match="too large"):
        eng.push_frame(video, huge.getvalue())
    with pytest.raises(VisionUnavailable, match="not opened for video"):
        eng.push_frame(plain, good)
    for _ in range(10):
        eng.push_frame(video, good)
    with pytest.raises(TooManyFrames, match="already holds 10 frames"):
        eng.push_frame(video, good)
    assert eng.vision_stage.frames_encoded == 0
    eng.push_audio(video, audio(1, 2))
    eng.push_audio(plain, audio(2, 2))
    out = collect(eng.tick() + eng.tick())
    assert not out[video]["errors"] and not out[plain]["errors"]
    assert eng.vision_stage.frames_encoded == 2 and len(eng.table.get_live(video).frames) == 8
    eng.shutdown()


@pytest.mark.parametrize("point", ["precheck", "batched"])
def test_a_failing_frame_ends_its_session_only(tmp_path, point):
    """runtime/isolation.py for the vision call: a session whose frame fails (its check, or the
    batched call with it in) ends alone; the other video session keeps its frame, the audio one its unit."""
    from duplexcache.runtime.isolation import FaultInjector

    eng = engine(tmp_path, f"iso{point}", VISION, vision_models())
    bad, good, plain = _open(eng, {"video": True}, {"video": True}, {})
    faults = FaultInjector()
    faults.arm("vision", bad, point)
    eng.install_faults(faults)
    for sid in (bad, good):
        eng.push_frame(sid, jpeg(7))
    for sid in (bad, good, plain):
        eng.push_audio(sid, audio(3, 1))
    out = collect(eng.tick())
    (err,) = out[bad]["errors"]
    assert err.fatal and err.code == "injected_fault"
    assert bad not in eng.session_ids() and {good, plain} <= set(eng.session_ids())
    assert eng.session_info(good).units == eng.session_info(plain).units == 1
    assert eng.vision_stage.frames_encoded == 1
    eng.shutdown()
