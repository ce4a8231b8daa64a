"""The engine's memory budget in bytes: ``engine.memory_budget`` resolved against the device.

``engine.memory_budget: auto`` (the default) sizes the budget from what is free at start-up,
after the weights and the engine's fixed allocations (the Code2Wav arena, the voices and the
vocoder copy) are already on the device::

    budget = fixed + floor(AUTO_FREE_SHARE * free)        (CUDA: free from torch.cuda.mem_get_info)

like vLLM's ``--gpu-memory-utilization``, except that the share applies to the memory left
after the weights, so the same config fits an 80 GB and a 141 GB card. ``AUTO_FREE_SHARE`` is
0.9: the remaining 10 % (about 11 GB on an H200, 4 GB on an 80 GB card) is what the process
still allocates outside the budget after start-up -- the CUDA context's lazy growth,
cuBLAS/cuDNN workspaces, Triton's compiled kernels, NCCL if any, and the caching allocator's
fragmentation. Activations and graph pools live in ``activation_reserve``, inside the budget.

On a host device (CPU) ``auto`` means ``CPU_AUTO_BUDGET`` (512 MiB, what the tiny preset always
had), capped at ``AUTO_FREE_SHARE`` of the RAM available now: the pools are preallocated, so a
fraction of a shared machine's RAM would be far too much for a demo.

With ``engine.activation_from_warmup`` (the minicpmo45 configs) this is the first plan's budget
only: after the warm-up has measured the activation peak, an auto budget is re-planned as
``fixed + free - engine.memory_headroom`` (runtime/memory/replan.py ``replan_after_warmup``,
docs/engine.md "Memory: the order of start-up").

A fixed byte budget keeps the old contract: on CUDA it must fit what is free, else start-up fails
with :class:`BudgetExceedsDevice` naming both numbers.
"""

from __future__ import annotations

import logging
import os

import torch

from duplexcache.config import AUTO, BudgetError, EngineConfig, format_bytes

logger = logging.getLogger(__name__)

CPU_AUTO_BUDGET = 512 * 2**20
# Share of the free memory an auto budget's first plan takes (engine.memory_fraction until issue
# 44 retired it: no config ever set another value). The 10 % left covers what the process still
# allocates outside the budget before anything measured it: the CUDA context's growth, cuBLAS/cuDNN
# workspaces, Triton, NCCL, fragmentation. With engine.activation_from_warmup the re-plan replaces
# it by what the warm-up measured and engine.memory_headroom (runtime/memory/replan.py).
AUTO_FREE_SHARE = 0.9


class BudgetExceedsDevice(BudgetError):
    """A fixed ``engine.memory_budget`` larger than the device memory free for it."""


def device_free_bytes(device: torch.device) -> int | None:
    """Bytes free on ``device`` now: CUDA from the driver, None for host devices (CPU, meta).

    On CUDA the caching allocator first hands its unused blocks back to the driver. Building the
    weights leaves gigabytes of freed temporaries cached (13.4 GiB for minicpmo45 with random
    weights on an H100), which the driver counts as used: without the release the auto budget
    depended on whether anything had happened to empty the cache before it (``torch.cuda.graph``
    does, before every capture). Blocks of a graph's private pool are not released, rightly:
    only that graph can use them."""
    if device.type == "cuda":
        torch.cuda.empty_cache()
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    return None


def host_available_bytes(meminfo: str = "/proc/meminfo") -> int | None:
    """RAM available now for a new allocation without swapping: Linux's ``MemAvailable`` (free
    pages plus the page cache and slabs the kernel can reclaim). ``MemFree`` alone (what
    ``os.sysconf("SC_AVPHYS_PAGES")`` reports) is small on any machine that has read many files,
    such as a CI runner after ``pip install``, and would shrink the budget for no reason; it is
    the fallback only where ``/proc/meminfo`` has no ``MemAvailable``. None where the platform
    says neither."""
    try:
        with open(meminfo, encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    value, unit = line.split()[1:3]
                    if unit.lower() == "kb":
                        return int(value) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        return None


def resolve_memory_budget(engine: EngineConfig, fixed_bytes: int, free_bytes: int | None,
                          *, where: str = "the device") -> int:
    """The total budget in bytes (``activation_reserve`` included, weights excluded).

    ``free_bytes``: device memory free now, after the weights and the ``fixed_bytes`` already
    allocated (None: a host device). Raises :class:`BudgetExceedsDevice` for a fixed budget that
    does not fit, ValueError when the resolved budget cannot even hold the activation reserve.
    """
    if engine.memory_budget == AUTO:
        if free_bytes is None:
            ram = host_available_bytes()
            cap = CPU_AUTO_BUDGET if ram is None else int(AUTO_FREE_SHARE * ram)
            budget = min(CPU_AUTO_BUDGET, cap)
            how = (f"auto on a host device: {format_bytes(CPU_AUTO_BUDGET)} capped by {AUTO_FREE_SHARE} x "
                   f"{'unknown' if ram is None else f'{ram / 2**30:.1f} GiB'} RAM available")
        else:
            budget = fixed_bytes + int(AUTO_FREE_SHARE * free_bytes)
            how = (f"auto: fixed {fixed_bytes / 2**30:.2f} GiB + {AUTO_FREE_SHARE} x "
                   f"{free_bytes / 2**30:.2f} GiB free on {where}")
        if budget <= engine.activation_reserve + fixed_bytes:
            raise BudgetError(
                f"engine.memory_budget auto came to {budget} bytes ({how}), which does not exceed "
                f"the fixed allocations ({fixed_bytes}) + activation_reserve ({engine.activation_reserve}); "
                "free memory or lower engine.activation_reserve")
        logger.info("engine.memory_budget = %.2f GiB (%s)", budget / 2**30, how)
        return budget
    budget = int(engine.memory_budget)
    # The fixed allocations are already made (they are part of the budget), so what must still
    # be free is the rest of the budget.
    if free_bytes is not None and budget - fixed_bytes > free_bytes:
        raise BudgetExceedsDevice(
            f"engine.memory_budget {budget} bytes exceeds the {free_bytes + fixed_bytes} bytes available "
            f"on {where} after loading weights; lower it or use memory_budget: auto")
    return budget
