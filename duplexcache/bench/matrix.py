"""The A/B configuration matrix of ``duplexcache bench``: all off, each switch alone, all on.

Every configuration is a full :class:`DeployConfig` built from one base config, so each switch
goes through the same validation and wiring as serving does. The four switches are the
deploy keys the spec names; ``SWITCHES`` maps each to its place in the YAML.

The graph grid: ``cfm_arena_rows_from_graph_grid`` is an error without a grid (a switch that
would change nothing), and the grid also decides how a Code2Wav batch is split into replay
groups. So when the base config has no grid, the bench sets one in EVERY configuration,
including all_off; only the arena-rows switch then differs between configurations, and the
equality check compares runs that batch Stage 2 identically.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from duplexcache.config import DeployConfig

logger = logging.getLogger(__name__)

# switch name -> (section, key) in the deploy YAML
SWITCHES: dict[str, tuple[str, str]] = {
    "duplex_context_caching": ("context_cache", "duplex_context_caching"),
    "shared_anchor_blocks": ("stage0", "shared_anchor_blocks"),
    "cfm_prompt_att_sharing": ("code2wav", "cfm_prompt_att_sharing"),
    "cfm_arena_rows_from_graph_grid": ("code2wav", "cfm_arena_rows_from_graph_grid"),
}
BASELINE = "all_off"
ALL_ON = "all_on"


@dataclass(frozen=True)
class BenchConfig:
    """One column of the A/B: a name, the switches it turns on, and the deploy config."""

    name: str
    switches_on: tuple[str, ...]
    deploy: DeployConfig


def default_graph_grid(max_num_seqs: int) -> tuple[int, ...]:
    """Powers of two below ``max_num_seqs`` (e.g. 16 -> (1, 2, 4, 8)), so the arena switch acts."""
    if max_num_seqs < 2:
        raise ValueError(f"max_num_seqs {max_num_seqs} leaves no graph tier below it; "
                         "cfm_arena_rows_from_graph_grid could not save anything")
    tiers, t = [], 1
    while t < max_num_seqs:
        tiers.append(t)
        t *= 2
    return tuple(tiers)


def with_switches(base: DeployConfig, on: tuple[str, ...]) -> DeployConfig:
    """``base`` with exactly the switches in ``on`` true and the other three false."""
    unknown = sorted(set(on) - set(SWITCHES))
    if unknown:
        raise ValueError(f"unknown switch {unknown[0]!r} (known: {', '.join(SWITCHES)})")
    data = base.to_dict()
    for name, (section, key) in SWITCHES.items():
        data[section][key] = name in on
    # environ={}: environment overrides were already applied to ``base``.
    return DeployConfig.from_dict(data, environ={})


def config_matrix(base: DeployConfig) -> list[BenchConfig]:
    """all_off, one configuration per switch (in ``SWITCHES`` order), all_on."""
    if base.code2wav.graph_grid is None:
        data = base.to_dict()
        data["code2wav"]["graph_grid"] = list(default_graph_grid(base.code2wav.max_num_seqs))
        base = DeployConfig.from_dict(data, environ={})
        logger.info("no graph grid configured; the bench uses %s in every configuration",
                    base.code2wav.graph_grid)
    out = [BenchConfig(BASELINE, (), with_switches(base, ()))]
    for name in SWITCHES:
        out.append(BenchConfig(name, (name,), with_switches(base, (name,))))
    out.append(BenchConfig(ALL_ON, tuple(SWITCHES), with_switches(base, tuple(SWITCHES))))
    return out
