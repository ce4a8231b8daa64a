"""memory.png: held memory vs sessions, one line per configuration (setup dashed, steady solid).

matplotlib is imported here, lazily, with the Agg backend, so the bench runs headless and the
rest of the package never needs it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from duplexcache.runtime.memory.waterfall import GIB, GROUPS, Waterfall

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


def plot_waterfall(wf: Waterfall | dict, path) -> object:
    """waterfall.png of a card waterfall (runtime/memory/waterfall.py): one bar per part, each
    starting where the previous ended, the device total as a line."""
    data = wf.to_json() if isinstance(wf, Waterfall) else wf
    plt = pyplot()
    parts = data["parts"]
    colours = dict(zip(GROUPS, ("#4c72b0", "#dd8452", "#8172b3", "#c44e52", "#55a868", "#937860", "#8c8c8c",
                                "#cccccc")))
    fig, ax = plt.subplots(figsize=(10, 5))
    bottom = 0.0
    for i, p in enumerate(parts):
        height = p["bytes"] / GIB
        ax.bar(i, height, bottom=bottom, color=colours.get(p["group"], "#333333"))
        bottom += height
    ax.axhline(data["total_bytes"] / GIB, color="black", linewidth=0.8, linestyle=":", label="device total")
    ax.set_xticks(range(len(parts)))
    ax.set_xticklabels([p["name"] for p in parts], rotation=60, ha="right", fontsize=7)
    ax.set_ylabel("GiB (cumulative)")
    ratio = data.get("admitted_over_floor_limited")
    ax.set_title(f"card waterfall on {data['device']}: {data['total_bytes'] / GIB:.2f} GiB; admitted "
                 f"{data['admitted']}" + (f", admitted / floor-limited {ratio:.3f}" if ratio is not None else ""))
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
