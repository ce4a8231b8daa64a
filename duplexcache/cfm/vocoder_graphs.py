"""CUDA graphs of the vocoder forward (deploy key `engine.cuda_graphs`).

Why: the HiFT generator is ~1400 small kernels per call (convolutions, Snake activations, the
source STFT and the iSTFT), so eagerly its time is the host issuing them. On an H200 at 40
sessions a tick's vocoder calls were 2766 launches for 33 ms of kernels in a 185 ms span. A graph
issues them as one launch.

What is captured: `HiFTGenerator.forward_drawn`, a pure function of the mel, the source cache
and the NSF noise. The noise is drawn eagerly before each replay (each row draws from its own
`torch.Generator`, which a graph cannot hold) and copied into the graph's static input, so a row
gets the noise it gets eagerly. The iSTFT is `models.vocoder.istft`, whose only difference from
torch.istft is the missing host-side window check: nothing in the forward synchronises.

Keys: (tier, mel frames with the cache, source-cache samples). The shapes are fixed at
construction (the engine's chunks: first, continuing and final; runtime/stages/code2wav_stage.py) and
their static buffers are allocated then, at the largest tier, so the engine's memory plan counts
them as fixed bytes; the tiers come from the graph grid as the Euler arena's do (`replay_groups`).
A call of another shape runs eagerly (counted). A graph is captured by `warm` (the engine's
warm-up) or, failing that, at its first use. Padded rows hold what an earlier call left there
(finite values; every op of the vocoder is per row) and their outputs are never read.

Bits: a replay computes the ops of an eager call over `tier` rows. Against the eager vocoder a
row differs only by rounding, as batches of different sizes do: cuDNN may choose other
convolution algorithms per batch size and inside a capture (on CPU, where a fake backend runs the
same ops, a tier that covers the group gives the eager bits). Two graphed engines must give the
same bits (what the sharing on/off checks compare). On the H200 two captures gave different PCM;
captures now allow only deterministic cuDNN algorithms, which has not been run on a GPU yet, so
the switch is off by default (docs/stage2.md).
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from duplexcache.cfm.graph_capture import ArenaStats, GraphBackend
from duplexcache.cfm.graph_grid import replay_groups, replay_tiers
from duplexcache.models.vocoder import SAMPLES_PER_FRAME, HiFTGenerator, NSFNoise

logger = logging.getLogger(__name__)

VocoderShape = tuple[int, int]          # (mel frames with the cache, source-cache samples)
VocoderKey = tuple[int, int, int]       # (tier, mel frames, source-cache samples)


@dataclass
class _StaticBuffers:
    """One shape's graph inputs and outputs, `rows` rows (tiers use the leading rows)."""

    mel: torch.Tensor                    # (rows, mels, frames)
    source_cache: torch.Tensor | None    # (rows, 1, n); None for first chunks (n = 0)
    phases: torch.Tensor                 # (rows, harmonics + 1)
    additive: torch.Tensor               # (rows, samples, harmonics + 1)
    speech: torch.Tensor                 # (rows, samples) the forward's PCM
    source: torch.Tensor                 # (rows, 1, samples) its NSF source

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.mel, self.source_cache, self.phases, self.additive, self.speech, self.source)
                if t is not None]


class VocoderGraphs:
    """Replays of `hift.forward_drawn` for a fixed set of shapes; owns their static buffers."""

    def __init__(self, hift: HiFTGenerator, shapes: Sequence[VocoderShape], rows: int,
                 grid: tuple[int, ...], backend: GraphBackend) -> None:
        if rows < 1:
            raise ValueError(f"rows must be >= 1, got {rows}")
        self.hift, self.rows, self.grid, self.backend = hift, rows, grid, backend
        param = next(hift.parameters())
        cfg = hift.cfg
        self._buffers: dict[VocoderShape, _StaticBuffers] = {}
        for frames, cached in dict.fromkeys(shapes):
            if frames < 1 or cached < 0:
                raise ValueError(f"bad vocoder graph shape (mel frames {frames}, source cache {cached})")
            samples = frames * SAMPLES_PER_FRAME
            z = dict(device=param.device, dtype=param.dtype)
            self._buffers[(frames, cached)] = _StaticBuffers(
                mel=torch.zeros(rows, cfg.in_channels, frames, **z),
                source_cache=torch.zeros(rows, 1, cached, **z) if cached else None,
                phases=torch.zeros(rows, cfg.nb_harmonics + 1, **z),
                additive=torch.zeros(rows, samples, cfg.nb_harmonics + 1, **z),
                speech=torch.zeros(rows, samples, **z),
                source=torch.zeros(rows, 1, samples, **z))
        self._graphs: dict[VocoderKey, Callable[[], None]] = {}
        self.stats = ArenaStats()

    @property
    def shapes(self) -> list[VocoderShape]:
        return list(self._buffers)

    @property
    def graph_keys(self) -> list[VocoderKey]:
        return list(self._graphs)

    def nbytes(self) -> int:
        """Bytes of the static buffers (the graph pool's scratch is not included)."""
        return sum(t.numel() * t.element_size() for b in self._buffers.values() for t in b.tensors())

    def tiers(self, max_batch: int) -> tuple[int, ...]:
        """The tiers `run` can pick for batches of 1..max_batch rows."""
        return replay_tiers(self.grid, self.rows, max_batch)

    @torch.inference_mode()
    def run(self, mel: torch.Tensor, source_cache: torch.Tensor | None, noise: NSFNoise) -> tuple[torch.Tensor, torch.Tensor]:
        """`hift.forward_drawn(mel, source_cache, noise)`: replays for a graphed shape (in groups
        of the grid's tiers), eagerly otherwise. Returns new tensors (not views of the buffers)."""
        cached = 0 if source_cache is None else source_cache.shape[2]
        buf = self._buffers.get((mel.shape[2], cached))
        if buf is None:
            self.stats.eager_runs += 1
            return self.hift.forward_drawn(mel, source_cache, noise)
        speech, source = [], []
        for g in replay_groups(mel.shape[0], self.grid, self.rows):
            rows = slice(g.start, g.start + g.rows)
            buf.mel[:g.rows].copy_(mel[rows])
            if buf.source_cache is not None:
                buf.source_cache[:g.rows].copy_(source_cache[rows])
            buf.phases[:g.rows].copy_(noise.phases[rows])
            buf.additive[:g.rows].copy_(noise.additive[rows])
            self._replay((g.tier, mel.shape[2], cached), buf)
            speech.append(buf.speech[:g.rows].clone())
            source.append(buf.source[:g.rows].clone())
        if len(speech) == 1:
            return speech[0], source[0]
        return torch.cat(speech), torch.cat(source)

    def warm(self, tier: int, shape: VocoderShape) -> bool:
        """Capture the graph of (tier, shape) over the buffers' current rows. Returns False when
        it is captured already or the shape is not graphed."""
        buf = self._buffers.get(shape)
        if buf is None or (tier, *shape) in self._graphs:
            return False
        if not 1 <= tier <= self.rows:
            raise ValueError(f"tier {tier} outside 1..{self.rows}")
        with torch.inference_mode():
            self._replay((tier, *shape), buf)
        return True

    def _replay(self, key: VocoderKey, buf: _StaticBuffers) -> None:
        replay = self._graphs.get(key)
        if replay is None:
            tier = key[0]
            logger.info("capturing vocoder graph tier=%d mel_frames=%d source_cache=%d", *key)

            def forward() -> None:
                cache = None if buf.source_cache is None else buf.source_cache[:tier]
                speech, source = self.hift.forward_drawn(
                    buf.mel[:tier], cache, NSFNoise(buf.phases[:tier], buf.additive[:tier]))
                buf.speech[:tier].copy_(speech)
                buf.source[:tier].copy_(source)

            # Deterministic cuDNN algorithms only: the algorithm a capture picks is baked into the
            # replays, and two graphed engines (sharing on / off) must give the same bits. On the
            # H200 two captures without this gave different PCM (tests/cfm/test_vocoder_graphs.py).
            with torch.backends.cudnn.flags(enabled=torch.backends.cudnn.enabled, benchmark=False,
                                            deterministic=True, allow_tf32=torch.backends.cudnn.allow_tf32):
                replay = self.backend.capture(forward)
            self._graphs[key] = replay
            self.stats.captures += 1
        replay()
        self.stats.replays += 1
