"""The vision path (models/vision.py) on the tiny preset, CPU: batching and padding invariance,
the resampler's output layout, checkpoint names, the Thinker-side frame layout, JPEG errors, and
the minicpmo45 shapes on the meta device only."""

from __future__ import annotations

import io
import math

import pytest
import torch

from duplexcache.context.tokenizer import ByteTokenizer
from duplexcache.models import vision as V
from duplexcache.models.checkpoint import CheckpointError, checkpoint_keys
from duplexcache.verify.common import FLOAT32_TOLERANCE, relative_error

TOL = FLOAT32_TOLERANCE


@pytest.fixture(scope="module")
def model() -> V.VisionModel:
    torch.manual_seed(0)
    return V.VisionModel(V.VisionConfig.tiny()).eval()


def _frame(rows: int, cols: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.rand(3, 14 * rows, 14 * cols, generator=gen) * 2 - 1


# --- batching and padding ---------------------------------------------------------------------


@torch.no_grad()
def test_batched_frames_of_different_sizes_equal_each_alone(model):
    frames = [_frame(3, 5, 1), _frame(8, 2, 2), _frame(4, 4, 3), _frame(1, 1, 4)]
    batched = model(frames)  # (4, 64, 64): padded to 16 patches
    for i, f in enumerate(frames):
        assert relative_error(batched[i], model([f])[0]) <= TOL, i


@torch.no_grad()
def test_padding_patches_do_not_change_a_frames_tokens(model):
    small, big = _frame(2, 3, 5), _frame(6, 5, 6)
    patches, position_ids, valid, grids = model.pack([small, big])
    assert valid[0].sum() == 6 and not valid[0, 6:].any()
    clean = model.resampler(model.vpm(patches, position_ids, valid), grids, valid)
    junk = patches.clone()
    junk[0, 6:] = 1e3 * torch.randn_like(junk[0, 6:])  # garbage where frame 0 has no patches
    position_ids[0, 6:] = 7
    dirty = model.resampler(model.vpm(junk, position_ids, valid), grids, valid)
    assert relative_error(dirty[0], clean[0]) <= TOL
    assert torch.equal(dirty[1], clean[1])


# --- resampler layout -------------------------------------------------------------------------


@torch.no_grad()
def test_each_frame_gives_query_num_tokens_in_frame_order(model):
    frames = [_frame(3, 5, 7), _frame(5, 3, 8)]
    out = model(frames)
    assert out.shape == (2, 64, model.cfg.llm_hidden_size)
    assert relative_error(out[1], model([frames[1]])[0]) <= TOL
    assert relative_error(out[0], model([frames[1]])[0]) > 1e-2  # not the other frame's


@torch.no_grad()
def test_token_j_is_query_j(model):
    """Row j of a frame's tokens is what query j read: permuting the queries permutes the rows."""
    frame = _frame(4, 4, 9)
    before = model([frame])[0]
    perm = torch.randperm(64, generator=torch.Generator().manual_seed(0))
    saved = model.resampler.query.detach().clone()
    try:
        model.resampler.query.copy_(saved[perm])
        after = model([frame])[0]
    finally:
        model.resampler.query.copy_(saved)
    assert relative_error(after, before[perm]) <= TOL
    assert relative_error(after, before) > 1e-2


def test_key_positions_are_column_then_row_sincos():
    rows, cols, dim = 2, 3, 8
    pos = V.sincos_2d(rows, cols, dim)  # (6, 8)
    omega = [1.0, 1.0 / 100]  # 10000^(-k/2), k < dim/4
    for r in range(rows):
        for c in range(cols):
            want = ([math.sin(c * w) for w in omega] + [math.cos(c * w) for w in omega]
                    + [math.sin(r * w) for w in omega] + [math.cos(r * w) for w in omega])
            assert torch.allclose(pos[r * cols + c], torch.tensor(want), atol=1e-7), (r, c)


@torch.no_grad()
def test_resampler_positions_follow_the_grid_not_the_count(model):
    """The same 16 patch rows read as a 2x8 and as an 8x2 grid give different tokens, each equal
    to the from-scratch reference at its own grid."""
    from duplexcache.verify.vision import reference_resampler

    hidden = torch.randn(1, 16, model.cfg.hidden_size, generator=torch.Generator().manual_seed(3))
    valid = torch.ones(1, 16, dtype=torch.bool)
    sd = model.resampler.state_dict()
    wide = model.resampler(hidden, [(2, 8)], valid)[0]
    tall = model.resampler(hidden, [(8, 2)], valid)[0]
    heads, eps = model.cfg.resampler_heads, model.cfg.resampler_eps
    assert relative_error(wide, reference_resampler(sd, hidden[0], (2, 8), heads, eps)) <= TOL
    assert relative_error(tall, reference_resampler(sd, hidden[0], (8, 2), heads, eps)) <= TOL
    assert relative_error(wide, tall) > 1e-3


# --- positions (NaViT bucketing) --------------------------------------------------------------


def _idefics2_buckets(n: int, table: int) -> torch.Tensor:
    """transformers' Idefics2VisionEmbeddings arithmetic: i * (1/n), clamped, bucketized."""
    boundaries = torch.arange(1 / table, 1.0, 1 / table)
    frac = torch.clamp(torch.arange(n, dtype=torch.float32) * (1.0 / torch.tensor(float(n))), max=1 - 1e-6)
    return torch.bucketize(frac, boundaries, right=True)


def test_bucketing_matches_idefics2_except_at_the_documented_sides():
    differs = tuple(n for n in range(1, 71) if not torch.equal(V.bucket_coords(n, 70), _idefics2_buckets(n, 70)))
    assert differs == V.IDEFICS2_BUCKETING_DIFFERS
    assert all(torch.equal(V.bucket_coords(n, 8), _idefics2_buckets(n, 8)) for n in range(1, 25))  # tiny


def test_position_ids_are_row_major_buckets():
    assert V.navit_position_ids(2, 2, 8).tolist() == [0, 4, 32, 36]
    assert V.navit_position_ids(8, 8, 8).tolist() == list(range(64))  # the full table, in order
    assert V.navit_position_ids(1, 10, 8).tolist() == [0, 0, 1, 2, 3, 4, 4, 5, 6, 7]  # past the table


# --- checkpoint names -------------------------------------------------------------------------


def test_checkpoint_round_trip_with_the_real_names(tmp_path):
    pytest.importorskip("transformers")
    from safetensors.torch import load_file

    from duplexcache.verify.vision import save_random_checkpoint

    cfg = V.VisionConfig.tiny()
    save_random_checkpoint(cfg, tmp_path, seed=1)
    keys = set(checkpoint_keys(tmp_path))
    assert {"vpm.embeddings.patch_embedding.weight", "vpm.embeddings.position_embedding.weight",
            "vpm.encoder.layers.1.self_attn.q_proj.weight", "vpm.encoder.layers.0.mlp.fc2.bias",
            "vpm.post_layernorm.weight", "resampler.query", "resampler.kv_proj.weight",
            "resampler.attn.in_proj_weight", "resampler.attn.out_proj.bias", "resampler.ln_post.bias",
            "resampler.proj"} <= keys
    loaded = V.VisionModel.from_pretrained(tmp_path)
    assert loaded.cfg == cfg
    saved = load_file(str(tmp_path / "model.safetensors"))
    ours = {f"vpm.{k}": v for k, v in loaded.vpm.state_dict().items()}
    ours.update({f"resampler.{k}": v for k, v in loaded.resampler.state_dict().items()})
    assert ours.keys() == saved.keys()
    assert all(torch.equal(ours[k], saved[k]) for k in saved)


def test_checkpoint_missing_a_layer_is_a_checkpoint_error(tmp_path):
    pytest.importorskip("transformers")
    from safetensors.torch import load_file, save_file

    from duplexcache.verify.vision import save_random_checkpoint

    save_random_checkpoint(V.VisionConfig.tiny(), tmp_path)
    state = load_file(str(tmp_path / "model.safetensors"))
    save_file({k: v for k, v in state.items() if ".layers.1." not in k}, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match="missing"):
        V.VisionModel.from_pretrained(tmp_path)
    # ...which is what a checkpoint of drop_vision_last_layer=true holds: its config says so
    cfg_path = tmp_path / "config.json"
    text = cfg_path.read_text().replace('"drop_vision_last_layer": false', '"drop_vision_last_layer": true')
    cfg_path.write_text(text)
    assert V.VisionModel.from_pretrained(tmp_path).cfg.num_hidden_layers == 1


# --- Thinker-side layout ----------------------------------------------------------------------


def test_frame_tokens_sit_between_unit_and_audio():
    tok = ByteTokenizer()
    ids, vision, audio = V.unit_input_ids(tok, audio_tokens=10, frame=True)
    assert len(ids) == 2 + 66 + 10
    assert ids[:3] == [151684, 151683, 151669]  # </unit> <unit> <image>
    assert vision == slice(3, 67) and set(ids[vision]) == {128244}  # 64 x <unk>
    assert ids[67] == 151670  # </image>
    assert audio == slice(68, 78) and set(ids[audio]) == {tok.token_id("<|audio|>")}
    plain, none, audio_only = V.unit_input_ids(tok, audio_tokens=10, frame=False, close_previous=False)
    assert none is None and plain == [151683] + [151698] * 10 and audio_only == slice(1, 11)


def test_frame_token_ids_with_slices():
    ids = V.frame_token_ids(ByteTokenizer(), query_num=64, num_slices=2)
    assert len(ids) == 3 * 66
    assert [ids[0], ids[65], ids[66], ids[131], ids[132], ids[197]] == [151669, 151670, 151679, 151680, 151679, 151680]


# --- preprocessing and JPEG -------------------------------------------------------------------


def _jpeg(width: int, height: int) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (width, height), (200, 30, 90)).save(buf, format="JPEG")
    return buf.getvalue()


def test_a_camera_frame_is_resized_to_the_reference_grid():
    real = V.VisionConfig.minicpmo45()
    assert real.frame_grid(640, 480) == (28, 37)  # 518 x 392 px: area ~448^2, multiples of 14
    assert real.frame_grid(1280, 720) == (24, 43)
    assert real.frame_grid(448, 448) == (32, 32)
    tiny = V.VisionConfig.tiny()
    pixels = V.preprocess_frame(V.decode_jpeg(_jpeg(640, 480)), tiny)
    assert pixels.shape == (3, 14 * 3, 14 * 5) and pixels.min() >= -1 and pixels.max() <= 1
    assert abs(float(pixels[0].mean()) - (200 / 255 - 0.5) / 0.5) < 0.05  # normalised red channel


@pytest.mark.parametrize("data, problem", [
    (b"", "empty image data"),
    (b"not an image at all", "not a decodable image"),
    ("a string", "expected image bytes"),
])
def test_bad_image_bytes_are_a_value_error_naming_the_field(data, problem):
    with pytest.raises(ValueError, match=f"video_frames\\[0\\]: {problem}"):
        V.decode_jpeg(data, "video_frames[0]")


def _noise_jpeg(width: int, height: int) -> bytes:
    import numpy as np
    from PIL import Image

    buf = io.BytesIO()
    rgb = np.random.default_rng(0).integers(0, 256, (height, width, 3), dtype=np.uint8)
    Image.fromarray(rgb).save(buf, format="JPEG")
    return buf.getvalue()


def test_truncated_jpeg_is_a_value_error():
    """Headers intact, scan data cut: Pillow opens it lazily, so only a forced decode catches it."""
    data = _noise_jpeg(256, 256)
    with pytest.raises(ValueError, match="frame: corrupt or truncated JPEG data"):
        V.decode_jpeg(data[: len(data) * 3 // 4], "frame")


def test_jpeg_cut_inside_its_header_is_a_value_error():
    with pytest.raises(ValueError, match="frame: corrupt or truncated image data"):
        V.decode_jpeg(_jpeg(64, 48)[:200], "frame")


def test_oversized_image_is_refused_before_decoding(monkeypatch):
    monkeypatch.setattr(V, "MAX_FRAME_PIXELS", 100)
    with pytest.raises(ValueError, match="frame: image too large"):
        V.decode_jpeg(_jpeg(64, 48), "frame")


@torch.no_grad()
def test_encode_jpegs_end_to_end(model):
    out = model.encode_jpegs([_jpeg(640, 480), _jpeg(300, 300)])
    assert out.shape == (2, 64, 64) and torch.isfinite(out).all()
    with pytest.raises(ValueError, match="frame 1: not a decodable image"):
        model.encode_jpegs([_jpeg(64, 48), b"junk"])


# --- minicpmo45 shapes (meta device: no weights are built) ------------------------------------


def test_minicpmo45_shapes_on_meta():
    cfg = V.VisionConfig.minicpmo45()
    with torch.device("meta"):
        m = V.VisionModel(cfg)
    vpm = sum(p.numel() for p in m.vpm.parameters())
    res = sum(p.numel() for p in m.resampler.parameters())
    assert m.vpm.embeddings.position_embedding.weight.shape == (4900, 1152)
    assert m.resampler.attn.in_proj_weight.shape == (3 * 4096, 4096) and m.resampler.proj.shape == (4096, 4096)
    assert len(m.vpm.encoder.layers) == 27 and cfg.resampler_heads == 32
    assert 4.1e8 < vpm < 4.2e8  # SigLIP so400m (27 layers, patch 14, 4900 positions)
    assert res == 64 * 4096 + 1152 * 4096 + 3 * 4096 * 4096 + 3 * 4096 + 4096 * 4096 + 4096 + 6 * 4096 + 4096 * 4096
