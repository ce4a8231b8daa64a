"""The Code2Wav stage's PCM conversion: batched on the device, the bytes of the host formula."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from duplexcache.runtime.stages.code2wav_stage import pcm16_batch, pcm16_bytes


def _host_reference(pcm: torch.Tensor) -> bytes:
    """The conversion as the reference client does it: float32 on the host, clip, scale, round."""
    x = np.clip(pcm.detach().float().cpu().numpy().reshape(-1), -1.0, 1.0) * np.float32(32767.0)
    return np.round(x).astype("<i2").tobytes()   # numpy rounds half to even, as torch does


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA"))])
def test_batch_gives_each_chunk_the_bytes_of_the_host_formula(device):
    g = torch.Generator().manual_seed(0)
    chunks = [torch.randn(n, generator=g) * 0.7 for n in (24000, 5, 0, 31)]
    chunks[1][:] = torch.tensor([1.5, -1.5, 0.5 / 32767, 1.5 / 32767, -2.5 / 32767])   # clipping, ties
    got = pcm16_batch([c.to(device) for c in chunks])
    assert got == [_host_reference(c) for c in chunks]
    assert [len(b) for b in got] == [2 * c.numel() for c in chunks]
    assert pcm16_bytes(chunks[0].to(device)) == got[0] and pcm16_batch([]) == []
    assert np.frombuffer(got[1], "<i2").tolist() == [32767, -32767, 0, 2, -2]
