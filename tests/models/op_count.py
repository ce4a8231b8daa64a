"""Compute ops in a ``torch.profiler`` trace: the CPU proxy this project uses for CUDA launches.

A compute op is a leaf ``aten::`` op that is not a view or host-side bookkeeping (those launch no
kernel on CUDA); a ``_foreach_*`` op counts once with everything under it (on CUDA its fast path
is one kernel for the whole list; on CPU it loops). Counting on a CPU run says how the number of
kernels a step launches grows with its sessions, which is what a host-bound stage on a GPU pays
for; it says nothing about the kernels' own time.
"""
from __future__ import annotations

from typing import Any

VIEW_OPS = frozenset({
    "aten::empty", "aten::empty_strided", "aten::as_strided", "aten::view", "aten::slice",
    "aten::select", "aten::transpose", "aten::unsqueeze", "aten::expand", "aten::reshape",
    "aten::t", "aten::permute", "aten::_reshape_alias", "aten::alias", "aten::detach",
    "aten::lift_fresh", "aten::resolve_conj", "aten::resolve_neg", "aten::result_type",
    "aten::is_nonzero", "aten::item", "aten::_local_scalar_dense", "aten::unbind",
    "aten::split", "aten::split_with_sizes", "aten::chunk", "aten::narrow", "aten::view_as",
    "aten::_unsafe_view",
})


def _ancestors(event: Any):
    parent = event.cpu_parent
    while parent is not None:
        yield parent
        parent = parent.cpu_parent


def compute_ops(prof: Any, within: str | None = None) -> int:
    """Compute ops of ``prof`` (a finished ``torch.profiler.profile``); with ``within``, only those
    inside a ``record_function`` range of that name."""
    n = 0
    for e in prof.events():
        if not e.name.startswith("aten::") or e.name in VIEW_OPS:
            continue
        names = [p.name for p in _ancestors(e)]
        if any(name.startswith("aten::_foreach_") for name in names):
            continue   # counted with its foreach op
        if within is not None and within not in names:
            continue
        if e.name.startswith("aten::_foreach_") or not e.cpu_children:
            n += 1
    return n
