"""memory.png: held memory vs sessions, one line per configuration (setup dashed, steady solid).

matplotlib is imported here, lazily, with the Agg backend, so the bench runs headless and the
rest of the package never needs it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

MIB = 2**20


def pyplot():
    """matplotlib.pyplot on the headless Agg backend (imported on first use)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, ax, path: Path, legend_size: int = 8) -> Path:
    """Grid, legend, tight layout, then ``path`` at 120 dpi; the figure is closed."""
    ax.legend(fontsize=legend_size)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    pyplot().close(fig)
    return path


def plot_memory(report: dict[str, Any], path: Path) -> Path:
    plt = pyplot()

    fig, ax = plt.subplots(figsize=(8, 5))
    markers = "osD^vx*"  # configurations with equal numbers overlap; markers keep them visible
    for i, c in enumerate(report["configs"]):
        ns = [p["sessions"] for p in c["points"]]
        steady = [p["steady_held_bytes"] / MIB for p in c["points"]]
        setup = [p["setup_held_bytes"] / MIB for p in c["points"]]
        (line,) = ax.plot(ns, steady, marker=markers[i % len(markers)], markersize=8 - i, label=f"{c['name']} (steady)")
        ax.plot(ns, setup, linestyle="--", color=line.get_color(), alpha=0.6)
    available = report["available_bytes"] / MIB
    ax.axhline(available, color="black", linewidth=0.8, linestyle=":", label="available budget")
    ax.set_xlabel("concurrent sessions")
    ax.set_ylabel("held memory (MiB)")
    ax.set_title(f"duplexcache bench — {report['preset']} on {report['device']} "
                 f"(dashed: setup, solid: steady)")
    return save_figure(fig, ax, path, legend_size=7)
