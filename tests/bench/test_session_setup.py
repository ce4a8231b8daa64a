"""Session setup benchmark (duplexcache/bench/session_setup.py): a reduced tiny run on CPU.

What is checked against independent numbers, not against the bench's own output:
* encoder calls: cache off -> one per session; cache on -> the first session only;
* private / shared bytes and pool use: closed forms over the context length and block size;
* the logits the equality check compares: a dense Thinker forward over an independently
  built context (ids by hand, the same random weights);
* the checks themselves fail when they should (perturbed logits, a session left open).
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from duplexcache.bench import session_setup as ss
from duplexcache.cli import main as cli_main
from duplexcache.context.tokenizer import SPECIAL_TOKEN_IDS
from duplexcache.models.presets import build_random_models
from duplexcache.models.thinker import num_parameters

SESSIONS, REPEATS, TEXT_TOKENS, REF_SECONDS = 3, 2, 40, 1.0
BS = 16


@pytest.fixture(scope="module")
def bench() -> ss.SessionSetupBench:
    cfg = ss.SetupBenchConfig("tiny", "cpu", SESSIONS, REPEATS, TEXT_TOKENS, REF_SECONDS, seed=0)
    m = build_random_models(cfg.preset, cfg.device, cfg.dtype, cfg.seed, parts=("thinker", "audio_encoder"))
    thinker, encoder = m.thinker, m.audio_encoder
    return ss.SessionSetupBench(cfg, thinker, encoder)


@pytest.fixture(scope="module")
def report(bench) -> dict:
    return bench.run()


def _combo(report: dict, cache: bool, shared: bool) -> dict:
    return next(c for c in report["combinations"]
                if c["context_cache"] is cache and c["shared_anchor_blocks"] is shared)


def test_context_shape(report):
    c = report["meta"]["context"]
    assert c["text_tokens"] == TEXT_TOKENS
    assert c["audio_embeddings"] == int(REF_SECONDS * 10)
    assert c["total_tokens"] == 50 and c["full_blocks"] == 3 and c["tail_tokens"] == 2


def test_table_has_every_combination(report):
    table = ss.format_markdown(report)
    rows = [line for line in table.splitlines() if line.startswith("| o")]
    assert [r.split("|")[1:3] for r in rows] == [[" off ", " off "], [" off ", " on "], [" on ", " off "],
                                                 [" on ", " on "]]
    assert "session 1 setup ms" in table and "all equal" in table
    for combo in report["combinations"]:
        assert combo["first"]["num_samples"] == REPEATS
        assert combo["later"]["num_samples"] == REPEATS * (SESSIONS - 1)
        for side in ("first", "later"):
            t = combo[side]["total_ms"]
            assert 0 < t["min"] <= t["median"] <= t["max"]


@pytest.mark.parametrize("shared", [False, True])
def test_cache_on_later_sessions_never_encode(report, shared):
    later = REPEATS * (SESSIONS - 1)
    off, on = _combo(report, False, shared), _combo(report, True, shared)
    assert off["first"]["encoder_calls_per_session"] == 1 and on["first"]["encoder_calls_per_session"] == 1
    assert off["encoder_calls_later_total"] == later
    assert on["encoder_calls_later_total"] == 0
    assert on["later"]["embed_calls_per_session"] == 0 and off["later"]["embed_calls_per_session"] == 1
    assert on["later"]["context_cache_hits"] == later and off["later"]["context_cache_hits"] == 0
    assert on["context_cache_bytes"] > 0 and off["context_cache_bytes"] == 0


@pytest.mark.parametrize("cache", [False, True])
def test_shared_on_later_sessions_hold_fewer_private_bytes(report, cache):
    per_block = report["meta"]["kv_bytes_per_block"]
    total = report["meta"]["context"]["total_tokens"]
    full, blocks = total // BS, math.ceil(total / BS)
    off, on = _combo(report, cache, False), _combo(report, cache, True)
    # Off: every block private. On: only the copy-on-write tail; full blocks + template shared.
    assert off["later"]["private_bytes"] == blocks * per_block and off["later"]["shared_bytes"] == 0
    assert on["later"]["private_bytes"] == 1 * per_block
    assert on["later"]["shared_bytes"] == (full + 1) * per_block
    assert on["later"]["private_bytes"] < off["later"]["private_bytes"]
    # Distinct blocks with every session open: N copies vs one shared copy + a template + N tails.
    assert off["pool_used_bytes_after_all"] == SESSIONS * blocks * per_block
    assert on["pool_used_bytes_after_all"] == (full + 1 + SESSIONS) * per_block


def test_equality_check_passes(report):
    eq = report["equality"]
    assert eq["all_equal"] and eq["finite"]
    assert all(v["sessions_checked"] == SESSIONS and v["max_abs_diff"] == 0.0
               for v in eq["per_combination"].values())


def test_compared_logits_match_dense_reference(bench):
    """The logits the bench compares are the model's: a dense forward over a context built by hand."""
    result = bench.run_repeat(ss.Combination(True, True), 2, check_logits=True)
    th, enc = bench.models.thinker, bench.models.encoder
    sp = SPECIAL_TOKEN_IDS
    prefix = [sp["<|im_start|>"]] + list(f"system\n{bench.instructions}\n".encode()) + [sp["<|audio_start|>"]]
    suffix = [sp["<|audio_end|>"], sp["<|im_end|>"]]
    with torch.no_grad():
        embeds = torch.cat([
            th.embed(torch.tensor(prefix)), enc.embed_audio(ss.make_audio(REF_SECONDS, bench.cfg.seed + 1)),
            th.embed(torch.tensor(suffix + [sp["<unit>"]])),
            enc.embed_audio(ss.make_audio(1.0, bench.cfg.seed + 2)),
        ])
        ref = th.forward_dense(embeds[None], torch.arange(embeds.shape[0])[None])[0, -1]
    assert embeds.shape[0] == bench.context_len + 11
    for logits in result.logits.values():
        torch.testing.assert_close(logits, ref, rtol=1e-4, atol=1e-4)
    assert not torch.equal(ref, torch.zeros_like(ref))


def test_equality_report_detects_a_difference(bench):
    results = {c: [bench.run_repeat(c, 2, check_logits=True)] for c in ss.COMBINATIONS}
    assert ss.equality_report(results)["all_equal"]
    bad = ss.Combination(True, True)
    logits = results[bad][0].logits["s001"]
    logits[7] = torch.nextafter(logits[7], torch.tensor(math.inf))  # one ulp on one logit
    eq = ss.equality_report(results)
    assert not eq["all_equal"] and not eq["per_combination"][bad.name]["all_equal"]
    assert eq["per_combination"][ss.BASELINE.name]["all_equal"]


def test_pool_not_free_after_close_is_an_error(bench, monkeypatch):
    monkeypatch.setattr(ss.Stage0Runner, "close_session", lambda self, sid: None)
    with pytest.raises(ss.SetupBenchError, match="not all free"):
        bench.run_repeat(ss.Combination(False, True), 2)


def test_instructions_give_exact_text_token_count():
    for n in (12, 13, 96, 200):
        ctx = ss.build_session_context(
            ss.ByteTokenizer(), lambda ids: torch.zeros(len(ids), 1),
            lambda a, s: ss.EmbeddingResult(torch.zeros(5, 1), ss.EncoderPath.WHOLE_CLIP),
            ss.make_instructions(n), torch.zeros(1600))
        assert ctx.total - ctx.audio_embedding_count == n
    with pytest.raises(ValueError, match="instructions_tokens must be >= 12"):
        ss.make_instructions(11)


@pytest.mark.parametrize("kwargs, match", [
    ({"preset": "huge"}, "unknown preset"),
    ({"sessions": 1}, "sessions must be >= 2"),
    ({"repeats": 0}, "repeats must be >= 1"),
    ({"ref_seconds": 40.0}, "ref_seconds"),
    ({"device": "tpu"}, "device must be"),
])
def test_bad_settings(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ss.SetupBenchConfig(**kwargs)


def test_minicpmo45_shapes_on_meta():
    """The big preset's widths line up and its size is what the GPU run will hold (no weights)."""
    m = build_random_models("minicpmo45", "meta", torch.bfloat16, parts=("thinker", "audio_encoder"))
    thinker, encoder = m.thinker, m.audio_encoder
    assert encoder.cfg.out_dim == thinker.config.hidden_size == 4096
    params = list(thinker.parameters()) + list(encoder.parameters())
    assert all(p.device.type == "meta" and p.dtype == torch.bfloat16 for p in params)
    n = sum(p.numel() for p in thinker.parameters())
    assert n == num_parameters(thinker.config)
    assert 16e9 < 2 * n < 17e9  # ~16.4 GB of bf16 weights
    cache_block = thinker.config.kv_bytes_per_token(torch.bfloat16) * BS
    assert cache_block == 144 * 1024 * BS  # SPEC: 144 KiB per token


def test_cli_writes_json_and_markdown(tmp_path):
    rc = cli_main(["bench", "setup", "--sessions", "2", "--repeats", "1", "--instructions-tokens", "20", "--ref-seconds", "0.5",
                  "--out", str(tmp_path)])
    assert rc == 0
    data = json.loads((tmp_path / "session_setup.json").read_text())
    assert data["equality"]["all_equal"] and len(data["combinations"]) == 4
    assert "--sessions 2" in data["meta"]["command"]
    assert (tmp_path / "session_setup.md").read_text().count("\n| o") == 4
