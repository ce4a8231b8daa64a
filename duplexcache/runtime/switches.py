"""Which deploy switches are on: one line for ``duplexcache serve``'s start-up log and the demo.

The sharing switches all default off (the unshared baseline), so a run with none of them on
shares nothing; saying so at start-up keeps a user from comparing the wrong two runs.
"""

from __future__ import annotations

from duplexcache.config import DeployConfig

# dotted paths into DeployConfig, in the order README's configuration table lists them
SHARING_SWITCHES = (
    "stage0.shared_anchor_blocks",
    "context_cache.duplex_context_caching",
    "code2wav.cfm_prompt_att_sharing",
    "code2wav.cfm_arena_rows_from_graph_grid",
)
SPEED_SWITCHES = ("engine.cuda_graphs", "stage0.ragged_kernel")  # CUDA only


def switch_value(deploy: DeployConfig, dotted: str) -> bool:
    node = deploy
    for part in dotted.split("."):
        node = getattr(node, part)
    return bool(node)


def switches_on(deploy: DeployConfig) -> list[str]:
    """The sharing and speed switches that are on, as dotted config paths."""
    return [name for name in SHARING_SWITCHES + SPEED_SWITCHES if switch_value(deploy, name)]


def describe_switches(deploy: DeployConfig) -> str:
    """One line: the sharing switches on (or that none is), the speed switches on, window, policy."""
    sharing = [name for name in SHARING_SWITCHES if switch_value(deploy, name)]
    speed = [name for name in SPEED_SWITCHES if switch_value(deploy, name)]
    policy = deploy.engine.speak_policy
    parts = [
        "sharing switches on: " + (", ".join(sharing) if sharing else "none (the unshared baseline)"),
        "speed switches on: " + (", ".join(speed) if speed else "none")
        + ("" if deploy.model.device.startswith("cuda") or not speed else " (CUDA only: no effect on this device)"),
        f"window {deploy.stage0.window.mode}",
        f"speak_policy {policy.mode}" + (f" k={policy.k}" if policy.mode == "every_k_units" else ""),
    ]
    return "; ".join(parts)
