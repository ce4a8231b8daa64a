"""What every benchmark of ``duplexcache bench`` shares: the hardware line of a report, the
writing of its results files, device synchronisation, and the ``python -m`` aliases.

Imports no config and no web library (the GPU kernel benches and the serve client use it);
torch is imported where a function needs it.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any


def hardware_info(device: str) -> dict[str, Any]:
    """The machine as a dict (``report.json``'s ``hardware``): platform, python, torch, CPU,
    and the GPU's name, memory and CUDA version when ``device`` is a CUDA device."""
    import torch

    info: dict[str, Any] = {"platform": platform.platform(), "python": platform.python_version(),
                            "torch": torch.__version__, "cpu": platform.processor() or platform.machine()}
    if str(device).startswith("cuda") and torch.cuda.is_available():
        props = torch.cuda.get_device_properties(torch.device(device))
        info.update(gpu=props.name, gpu_memory_bytes=props.total_memory, cuda=torch.version.cuda)
    return info


def hardware_line(device: Any = None, *extras: str) -> str:
    """The machine in one line, for a report's ``hardware`` field, then ``extras`` (versions or
    settings a benchmark depends on).

    ``device`` a CUDA device: its name, SMs, memory, torch and CUDA versions. A CPU device: the
    processor, cores and torch threads. None (a client that holds no GPU itself, e.g. ``bench
    serve``): the machine's GPUs as ``nvidia-smi`` lists them, else the CPU.
    """
    if device is None:
        gpus = _nvidia_smi_gpus()
        line = f"{gpus}; client {platform.node()}" if gpus else f"CPU {_cpu()}; {platform.platform()}"
    else:
        import torch

        device = torch.device(device)
        if device.type == "cuda":
            props = torch.cuda.get_device_properties(device)
            line = (f"{props.name}, {props.multi_processor_count} SMs, {props.total_memory / 2**30:.0f} GiB; "
                    f"torch {torch.__version__}, CUDA {torch.version.cuda}")
        else:
            line = f"CPU {_cpu()}, {torch.get_num_threads()} threads; torch {torch.__version__}"
    return ", ".join((line, *extras))


def _cpu() -> str:
    return f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores"


def _nvidia_smi_gpus() -> str | None:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=10, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return "; ".join(line.strip() for line in out.splitlines()) or None


def write_results(out: Path, results: dict[str, Any], markdown: str | None = None, stem: str = "results") -> Path:
    """``out/<stem>.json`` (indented JSON) and, given ``markdown``, ``out/<stem>.md``; creates
    ``out``. Rewriting after every step of a sweep leaves the finished steps if a run is killed.
    Returns the JSON file's path."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{stem}.json"
    path.write_text(json.dumps(results, indent=2) + "\n")
    if markdown is not None:
        (out / f"{stem}.md").write_text(markdown)
    return path


def sync(device: Any) -> None:
    """Wait for the device's queued work (CUDA), so a wall clock around a call measures it."""
    import torch

    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def default_device(preset: str, device: str | None) -> str:
    """``--device`` when given, else cuda for minicpmo45 (8B parameters) and cpu for tiny."""
    return device or ("cuda" if preset == "minicpmo45" else "cpu")


def usage_error(command: str, message: object) -> int:
    """A bad setting found after parsing: said on stderr as argparse would, exit status 2."""
    print(f"duplexcache bench {command}: error: {message}", file=sys.stderr)
    return 2


def alias_main(command: str) -> int:
    """``python -m duplexcache.bench.<module> ARGS`` is ``duplexcache bench <command> ARGS``."""
    from duplexcache.cli import main

    return main(["bench", command, *sys.argv[1:]])


def int_list(option: str, largest: int | None = None, most: int | None = None):
    """An argparse ``type``: a comma list of positive ints (``"1,8,16"`` -> ``(1, 8, 16)``, in
    the order given), each at most ``largest`` and at most ``most`` of them when set."""
    import argparse

    def parse(text: str) -> tuple[int, ...]:
        try:
            values = tuple(int(v) for v in text.split(",") if v.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(f"{option} wants comma-separated ints, got {text!r}") from None
        if not values or min(values) < 1 or (largest is not None and max(values) > largest) \
                or (most is not None and len(values) > most):
            bounds = f"1..{largest}" if largest is not None else "positive"
            count = f"at most {most} " if most is not None else ""
            raise argparse.ArgumentTypeError(f"{option} wants {count}{bounds} ints, got {text!r}")
        return values
    return parse


def argv_after(subcommand: str) -> list[str]:
    """What followed ``subcommand`` on the command line (for a report's command line), or every
    argument when it is not there (a direct call)."""
    return sys.argv[sys.argv.index(subcommand) + 1:] if subcommand in sys.argv else sys.argv[1:]
