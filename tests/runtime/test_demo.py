"""`duplexcache demo` end to end: real server on loopback (or direct), WAVs and the table."""
from __future__ import annotations

import argparse
import wave

import pytest
import torch

from duplexcache.runtime import demo

torch.set_num_threads(1)


def _args(tmp_path, **kw) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    demo.add_arguments(parser)
    argv = ["--sessions", "3", "--seconds", "2", "--voices", "2", "--out", str(tmp_path / "out")]
    for key, value in kw.items():
        argv += [f"--{key}"] + ([] if value is True else [str(value)])
    return parser.parse_args(argv)


@pytest.mark.parametrize("direct", [False, True])
def test_demo_writes_wavs_and_prints_the_table(tmp_path, capsys, direct):
    args = _args(tmp_path, direct=True) if direct else _args(tmp_path)
    assert demo.run(args) == 0
    out = capsys.readouterr().out
    assert ("WebSocket server on loopback" in out) != direct
    for needle in ("3 sessions", "ticks", "audio out", "p50 latency", "thinker_kv", "code2wav", "context cache hits 1"):  # 3rd session reuses the 1st's context
        assert needle in out, needle
    wavs = sorted((tmp_path / "out").glob("*.wav"))
    assert [p.name for p in wavs] == ["session0_default.wav", "session1_alt.wav", "session2_default.wav"]
    for path in wavs:
        with wave.open(str(path)) as w:
            assert (w.getframerate(), w.getnchannels(), w.getsampwidth()) == (24000, 1, 2)
            # one turn of 2 units: 24000 samples + the final 24000 + 3840-sample vocoder tail
            assert w.getnframes() == 24000 + 27840


def test_demo_rejects_bad_counts(tmp_path):
    assert demo.run(_args(tmp_path, voices=5)) == 2
    assert demo.run(_args(tmp_path, sessions=0)) == 2
