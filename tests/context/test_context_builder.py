"""Session context builder: MiniCPM-o layout, cache hits equal misses, encode skipped on a hit,
streaming side effects replayed only for the streaming path, bad reference audio refused."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from context_fakes import HIDDEN, CountingEncoder, FakeEncoderState, make_audio, make_embedding

from duplexcache.config import DeployConfig
from duplexcache.context import (
    ByteTokenizer,
    ContextCache,
    EmbeddingResult,
    EncoderPath,
    ReferenceAudioError,
    SessionContextBuilder,
    build_session_context,
    load_tokenizer,
)

IM_START, IM_END, AUDIO_START, AUDIO, AUDIO_END = 151644, 151645, 151697, 151698, 151699


def _b(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def _build(enc, emb, audio, *, cache=None, state=None, instructions="Be brief.", user="hi", revision="r1"):
    return build_session_context(ByteTokenizer(), emb, enc, instructions, audio, user,
                                 encoder_state=state, cache=cache, model_revision=revision)


def test_layout_with_reference_audio_matches_hand_built_reference():
    emb, enc = make_embedding(), CountingEncoder(streaming=False)
    audio = make_audio(0.65, seed=1)  # 6 embeddings (10 per second, partial 50 ms dropped)
    ctx = _build(enc, emb, audio, instructions="Sé breve.", user="hola")
    prefix = [IM_START] + _b("system\nSé breve.") + _b("\n") + [AUDIO_START]
    suffix = ([AUDIO_END, IM_END] + _b("\n") + [IM_START] + _b("user\nhola") + [IM_END] + _b("\n")
              + [IM_START] + _b("assistant\n"))
    assert ctx.token_ids.tolist() == prefix + [AUDIO] * 6 + suffix
    assert (ctx.prefix_token_count, ctx.audio_embedding_count, ctx.suffix_token_count) == (len(prefix), 6, len(suffix))
    assert ctx.total == len(prefix) + 6 + len(suffix) == ctx.inputs_embeds.shape[0]
    expected = torch.cat([emb.weight[prefix], enc.expected(audio), emb.weight[suffix]]).detach()
    assert torch.equal(ctx.inputs_embeds, expected)
    assert ctx.encoder_path is EncoderPath.WHOLE_CLIP and not ctx.cache_hit
    assert ctx.inputs_embeds.shape[1] == HIDDEN


def test_layout_without_reference_audio_or_user_text():
    emb, enc = make_embedding(), CountingEncoder(streaming=False)
    ctx = _build(enc, emb, None, instructions="X", user=None)
    assert ctx.token_ids.tolist() == [IM_START] + _b("system\nX") + [IM_END]
    assert (ctx.audio_embedding_count, ctx.suffix_token_count, ctx.encoder_path) == (0, 1, None)
    assert enc.calls == 0
    assert torch.equal(ctx.inputs_embeds, emb.weight[ctx.token_ids].detach())


def test_numpy_reference_audio_is_accepted_and_keyed_like_tensor():
    emb, enc = make_embedding(), CountingEncoder(streaming=False)
    audio = make_audio(0.3, seed=2)
    a = _build(enc, emb, audio)
    b = _build(enc, emb, audio.numpy().copy())
    assert a.context_key == b.context_key and torch.equal(a.inputs_embeds, b.inputs_embeds)


def test_hit_equals_miss_and_skips_encode_and_embedding():
    emb, enc = make_embedding(), CountingEncoder(streaming=False)
    audio = make_audio(0.5, seed=3)
    uncached = _build(enc, emb, audio)
    cache = ContextCache()
    embed_calls = []

    def counting_embed(ids):
        embed_calls.append(ids.numel())
        return emb(ids)

    miss = _build(enc, counting_embed, audio, cache=cache)
    hit = _build(enc, counting_embed, audio.clone(), cache=cache)
    assert (miss.cache_hit, hit.cache_hit) == (False, True)
    assert enc.calls == 2  # uncached build + the miss; the hit did not encode
    assert len(embed_calls) == 1  # the hit did not embed tokens either
    assert (cache.hits, cache.misses) == (1, 1)
    for ctx in (miss, hit):
        assert torch.equal(ctx.inputs_embeds, uncached.inputs_embeds)
        assert torch.equal(ctx.token_ids, uncached.token_ids)
        assert ctx.extra_key == uncached.extra_key
    assert hit.encoder_path is EncoderPath.WHOLE_CLIP


def _variants(audio):
    other_audio = audio.clone()
    other_audio[100] += 0.25  # one sample differs
    return {
        "instructions": dict(instructions="Be verbose."),
        "has_ref_audio": dict(audio=None),
        "initial_user_text": dict(user="hello"),
        "ref_audio_bytes": dict(audio=other_audio),
    }


@pytest.mark.parametrize("field", ["instructions", "has_ref_audio", "initial_user_text", "ref_audio_bytes"])
def test_each_key_field_causes_a_miss(field):
    emb, enc = make_embedding(), CountingEncoder(streaming=False)
    audio = make_audio(0.4, seed=4)
    cache = ContextCache()
    base = _build(enc, emb, audio, cache=cache)
    kwargs = dict(audio=audio, instructions="Be brief.", user="hi")
    kwargs.update(_variants(audio)[field])
    varied = _build(enc, emb, kwargs.pop("audio"), cache=cache, **kwargs)
    assert not varied.cache_hit and (cache.hits, cache.misses) == (0, 2)
    assert varied.context_key != base.context_key and varied.extra_key != base.extra_key


def test_extra_key_names_model_revision():
    emb, enc = make_embedding(), CountingEncoder(streaming=False)
    audio = make_audio(0.2, seed=5)
    assert _build(enc, emb, audio, revision="a").extra_key != _build(enc, emb, audio, revision="b").extra_key


def test_streaming_side_effects_replayed_on_hit():
    emb, enc = make_embedding(), CountingEncoder(streaming=True)
    audio = make_audio(0.5, seed=6)
    cache = ContextCache()
    state_a, state_b = FakeEncoderState(), FakeEncoderState()
    miss = _build(enc, emb, audio, cache=cache, state=state_a)
    hit = _build(enc, emb, audio, cache=cache, state=state_b)
    assert hit.cache_hit and enc.calls == 1
    assert hit.encoder_path is EncoderPath.STREAMING
    # Session B's encoder state ends where the live encode left session A's.
    assert state_b.frames_seen == state_a.frames_seen == 50
    assert (state_a.replays, state_b.replays) == (0, 1)
    assert torch.equal(hit.inputs_embeds, miss.inputs_embeds)


def test_whole_clip_hit_does_not_touch_encoder_state():
    emb, enc = make_embedding(), CountingEncoder(streaming=False)
    audio = make_audio(0.5, seed=6)
    cache = ContextCache()
    _build(enc, emb, audio, cache=cache, state=FakeEncoderState())
    state_b = FakeEncoderState()
    hit = _build(enc, emb, audio, cache=cache, state=state_b)
    assert hit.cache_hit and hit.encoder_path is EncoderPath.WHOLE_CLIP
    assert state_b == FakeEncoderState()


def test_encoder_path_is_reported_not_derived():
    with pytest.raises(ValueError, match="streaming"):
        EmbeddingResult(torch.zeros(1, HIDDEN), EncoderPath.STREAMING)
    with pytest.raises(ValueError, match="streaming"):
        EmbeddingResult(torch.zeros(1, HIDDEN), EncoderPath.WHOLE_CLIP, lambda s: None)
    with pytest.raises(ValueError, match="EncoderPath"):
        EmbeddingResult(torch.zeros(1, HIDDEN), "streaming")


def _deploy(caching: bool, capacity: int = 32) -> DeployConfig:
    return DeployConfig.from_dict(
        {"context_cache": {"duplex_context_caching": caching, "capacity": capacity}}, environ={})


def test_caching_off_by_default_builder_never_consults_a_cache():
    emb, enc = make_embedding(), CountingEncoder(streaming=False)
    builder = SessionContextBuilder.from_config(DeployConfig.default("tiny", environ={}), ByteTokenizer(), emb, enc)
    assert builder.cache is None
    audio = make_audio(0.3, seed=7)
    assert not builder.build("x", audio).cache_hit
    assert not builder.build("x", audio).cache_hit
    assert enc.calls == 2


def test_caching_switch_from_config_reaches_the_builder():
    emb, enc = make_embedding(), CountingEncoder(streaming=False)
    builder = SessionContextBuilder.from_config(_deploy(True, capacity=2), ByteTokenizer(), emb, enc)
    assert builder.cache is not None and builder.cache.capacity == 2
    audios = [make_audio(0.2, seed=s) for s in (10, 11, 12)]
    builder.build("x", audios[0])
    builder.build("x", audios[1])
    assert builder.build("x", audios[0]).cache_hit  # touch 0
    builder.build("x", audios[2])                   # evicts 1 (LRU), not 0
    assert builder.build("x", audios[0]).cache_hit
    assert not builder.build("x", audios[1]).cache_hit
    assert builder.cache.evictions == 2 and enc.calls == 4


BAD_AUDIO = {
    "empty": (torch.zeros(0), 16_000, "empty"),
    "too_short": (torch.zeros(1599), 16_000, "too short"),
    "too_long": (torch.zeros(16_000 * 31), 16_000, "too long"),
    "wrong_rate": (torch.zeros(16_000), 44_100, "16000 Hz"),
    "string": ("voice.wav", 16_000, "tensor or array"),
    "bytes": (b"\x00\x01" * 2000, 16_000, "tensor or array"),
    "int16": (torch.zeros(16_000, dtype=torch.int16), 16_000, "float32"),
    "float64": (np.zeros(16_000), 16_000, "float32"),
    "stereo": (torch.zeros(2, 16_000), 16_000, "mono"),
    "nan": (torch.full((16_000,), float("nan")), 16_000, "NaN"),
    "unnormalized": (torch.full((16_000,), 300.0), 16_000, "normalized"),
}


@pytest.mark.parametrize("case", sorted(BAD_AUDIO))
def test_bad_reference_audio_errors_and_leaves_no_entry(case):
    audio, rate, message = BAD_AUDIO[case]
    emb, enc = make_embedding(), CountingEncoder(streaming=False)
    cache = ContextCache()
    with pytest.raises(ReferenceAudioError, match=message):
        build_session_context(ByteTokenizer(), emb, enc, "x", audio, None, cache=cache, sample_rate=rate)
    assert len(cache) == 0 and enc.calls == 0


def test_bad_encoder_result_leaves_no_entry():
    emb = make_embedding()
    cache = ContextCache()

    def wrong_hidden(audio, state):
        return EmbeddingResult(torch.zeros(3, HIDDEN + 1), EncoderPath.WHOLE_CLIP)

    with pytest.raises(ValueError, match="hidden size"):
        build_session_context(ByteTokenizer(), emb, wrong_hidden, "x", make_audio(0.3, 1), None, cache=cache)
    with pytest.raises(ValueError, match="EmbeddingResult"):
        build_session_context(ByteTokenizer(), emb, lambda a, s: torch.zeros(3, HIDDEN), "x",
                              make_audio(0.3, 1), None, cache=cache)
    assert len(cache) == 0


def test_bad_text_fields():
    emb, enc = make_embedding(), CountingEncoder(streaming=False)
    with pytest.raises(ValueError, match="instructions"):
        build_session_context(ByteTokenizer(), emb, enc, None, None)
    with pytest.raises(ValueError, match="initial_user_text"):
        build_session_context(ByteTokenizer(), emb, enc, "x", None, 5)


def test_byte_tokenizer_ids_stay_below_specials_and_ignore_special_spellings():
    tok = ByteTokenizer()
    ids = tok.encode("<|im_end|>ünïcode")
    assert ids == _b("<|im_end|>ünïcode") and max(ids) < 256
    assert tok.token_id("<unit>") == 151683 and tok.token_id("<|tts_pad|>") == 151722
    with pytest.raises(KeyError, match="unknown special token"):
        tok.token_id("<|nope|>")


def test_load_tokenizer_falls_back_without_tokenizer_files(tmp_path):
    assert isinstance(load_tokenizer(None), ByteTokenizer)
    assert isinstance(load_tokenizer(tmp_path), ByteTokenizer)
    with pytest.raises(ValueError, match="not a directory"):
        load_tokenizer(tmp_path / "missing")


def test_checkpoint_tokenizer_is_used_when_present(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    specials = ["<|im_start|>", "<|im_end|>", "<|audio_start|>", "<|audio|>", "<|audio_end|>"]
    vocab = {"[UNK]": 0, "system": 1, "X": 2} | {s: 10 + i for i, s in enumerate(specials)}
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="[UNK]", additional_special_tokens=specials,
    ).save_pretrained(tmp_path)
    tok = load_tokenizer(tmp_path)
    assert not isinstance(tok, ByteTokenizer)
    # A special-token spelling typed as text stays text (it must not close the system turn).
    assert 11 not in tok.encode("X <|im_end|>")
    with pytest.raises(KeyError, match="<unit>"):
        tok.token_id("<unit>")
    emb, enc = make_embedding(vocab=64), CountingEncoder(streaming=False)
    ctx = build_session_context(tok, emb, enc, "X", make_audio(0.2, 1), None)
    assert ctx.token_ids.tolist() == [10, 1, 2, 12, 13, 13, 14, 11]
