"""Capturing a solve as something replayable: the backend protocol, its CUDA-graph
implementation (one memory pool shared by every capture of a backend) and the counters of how
solves ran. Shared by the Code2Wav arena (cfm/arena.py), the vocoder graphs
(cfm/vocoder_graphs.py) and the audio encoder's graphs (models/audio_encoder_graphs.py).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from duplexcache.kv.decode_graphs import warmup_stream


@dataclass
class ArenaStats:
    """How solves ran; each owner (the Code2Wav arena, the vocoder graphs) counts its own."""

    captures: int = 0     # graphs captured (one per distinct key)
    replays: int = 0      # solves run by replaying a captured graph
    eager_runs: int = 0   # solves run op by op (CPU, or graphs off)


class GraphBackend(Protocol):
    """Turns a solve into something replayable. `capture(fn)` runs/records `fn` (which reads and
    writes only static buffers) and returns a callable that repeats it."""

    def capture(self, fn: Callable[[], None]) -> Callable[[], None]: ...


class CudaGraphBackend:
    """torch.cuda.CUDAGraph capture into one shared memory pool."""

    def __init__(self) -> None:
        self.pool = None   # set by the first capture, shared by every later one

    def capture(self, fn: Callable[[], None]) -> Callable[[], None]:
        # Warm-up on a side stream first: lazy cuBLAS/cuDNN initialisation and the allocator's
        # first allocations must not happen inside the capture.
        stream = warmup_stream()
        stream.wait_stream(torch.cuda.current_stream())
        # No autograd: a graph never runs backward, and with it on the static outputs would keep
        # the captured run's activations alive through their grad_fn.
        with torch.no_grad(), torch.cuda.stream(stream):
            fn()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.no_grad(), torch.cuda.graph(graph, pool=self.pool):
            fn()
        if self.pool is None:
            self.pool = graph.pool()
        return graph.replay
