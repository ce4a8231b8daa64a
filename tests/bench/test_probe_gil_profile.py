"""The GIL-profile summary (scripts/probes/gil_profile.py, the serve_profile probe's parser) over
hand-written py-spy raw lines."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[2] / "scripts" / "probes"))   # a probe, not a package module
from gil_profile import format_profile, parse_frame, summarize  # noqa: E402

LOOP = ('thread (7): MainThread;<module> (duplexcache/cli.py:79);run (duplexcache/server/cli.py:118);'
        'Runner.run (asyncio/runners.py:118)')
TICK = ('thread (9): asyncio_0;Thread._bootstrap (threading.py:1002);_worker (concurrent/futures/thread.py:83);'
        'DuplexEngine.tick (duplexcache/runtime/engine.py:262);DuplexEngine._tick (duplexcache/runtime/engine.py:283)')


def test_samples_are_split_by_role_and_the_loop_by_site():
    lines = [
        f"{LOOP};on_append (duplexcache/server/realtime_session.py:210);decode_audio (duplexcache/server/audio_io.py:40);"
        f"b64decode (base64.py:88) 30",
        f"{LOOP};on_append (duplexcache/server/realtime_session.py:210);loads (json/__init__.py:346) 10",
        f"{LOOP};read_frame (websockets/frames.py:140) 20",
        f"{TICK};run (duplexcache/runtime/stages/code2wav_stage.py:150);step (duplexcache/cfm/code2wav.py:80) 35",
        f"{TICK};encode (duplexcache/runtime/stages/thinker_stage.py:90) 5",
        "thread (7): MainThread 8",   # uvloop's C loop: no Python frame
        "thread (7): MainThread;<module> (duplexcache/cli.py:79);build_models (duplexcache/runtime/bundle.py:40) 2",
        "thread (11): asyncio_1;Thread._bootstrap (threading.py:1002);DuplexEngine.stats (duplexcache/runtime/engine.py:380) 0",
        "",
    ]
    prof = summarize(lines)
    assert prof.total == 110
    assert prof.by_role == {"event_loop": 68, "tick": 40, "startup": 2, "other": 0}
    assert prof.share("tick") == pytest.approx(40 / 110)
    assert prof.loop_by_site["(event loop, no Python frame)"] == 8
    # the deepest frame of our package names the site; a pure-library stack names its top folder
    assert prof.loop_by_site["duplexcache/server/audio_io.py:decode_audio"] == 30
    assert prof.loop_by_site["duplexcache/server/realtime_session.py:on_append"] == 10
    assert prof.loop_by_site["websockets"] == 20
    assert prof.loop_by_leaf["base64.py:b64decode"] == 30
    assert prof.tick_by_stage == {"duplexcache/runtime/stages/code2wav_stage.py:run": 35,
                                  "duplexcache/runtime/stages/thinker_stage.py:encode": 5}
    assert "tick 36.4%" in format_profile(prof)
    summary = prof.to_json(top=2)
    assert summary["share"] == {"tick": 0.3636, "event_loop": 0.6182, "startup": 0.0182, "other": 0.0}
    assert [s["where"] for s in summary["event_loop_sites"]] == ["duplexcache/server/audio_io.py:decode_audio",
                                                                 "websockets"]


def test_frames_and_bad_lines():
    assert parse_frame("decode (duplexcache/server/audio_io.py:40)") == ("decode", "duplexcache/server/audio_io.py")
    assert parse_frame("<module> (x.py)") == ("<module>", "x.py")
    with pytest.raises(ValueError, match="trailing count"):
        summarize(["run (x.py:1) many"])
