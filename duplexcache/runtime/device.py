"""Whether a configured torch device can hold an engine on this machine, said before any model is
built (the CLI entry points ask; the answer is one line for the user, not torch's traceback)."""

from __future__ import annotations


def device_problem(device: str) -> str | None:
    """Why the engine cannot be built on ``device`` here, or None. A CUDA device needs a torch built
    with CUDA and that GPU visible; otherwise the first CUDA call fails deep in model building
    with torch's own traceback (``Torch not compiled with CUDA enabled``)."""
    import torch

    dev = torch.device(device)
    if dev.type != "cuda":
        return None
    if not torch.cuda.is_available():
        return (f"device {device!r} asked for, but this torch ({torch.__version__}) sees no CUDA device; run on a "
                "GPU machine, or pass --device cpu (the tiny preset is made for CPU; minicpmo45 on a CPU runs "
                "far below real time)")
    if dev.index is not None and dev.index >= torch.cuda.device_count():
        return f"device {device!r} asked for, but only {torch.cuda.device_count()} CUDA device(s) are visible"
    return None
