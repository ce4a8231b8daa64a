"""Placement, autoscaling arithmetic and the cluster config's wiring, without a Ray cluster."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from duplexcache.cluster.autoscale import SessionUtilisationPolicy, replicas_needed
from duplexcache.cluster.placement import (
    AFFINITY, AFFINITY_FULL, ALL_FULL, NEW_CONTEXT, NO_KEY, ReplicaLoad, context_key, place, with_sent,
)
from duplexcache.config import DeployConfig
from duplexcache.runtime.memory.admission import MemoryPlan, TickCostModel, headroom


def test_context_key_names_revision_voice_and_instructions():
    key = context_key("Be brief.", "alt", "rev1")
    assert key == context_key("Be brief.", "alt", "rev1") and key.startswith("ctx-")
    others = {context_key("Be brief.", "default", "rev1"), context_key("Be brief!", "alt", "rev1"),
              context_key("Be brief.", "alt", "rev2"), context_key("alt", "Be brief.", "rev1")}
    assert key not in others and len(others) == 4
    assert context_key("x", None, "r") == context_key("x", "", "r")


def test_a_session_goes_where_its_context_is_while_there_is_room():
    loads = [ReplicaLoad("a", 5, frozenset({"k1"})), ReplicaLoad("b", 9, frozenset({"k2"}))]
    assert place("k1", loads) == place("k1", loads[::-1])
    assert place("k1", loads).replica == "a" and place("k1", loads).reason == AFFINITY   # not the roomiest
    assert (place("k3", loads).replica, place("k3", loads).reason) == ("b", NEW_CONTEXT)
    assert (place(None, loads).replica, place(None, loads).reason) == ("b", NO_KEY)


def test_a_full_holder_sends_the_session_to_the_roomiest_other():
    loads = [ReplicaLoad("a", 0, frozenset({"k1"})), ReplicaLoad("b", 3), ReplicaLoad("c", 4)]
    assert (place("k1", loads).replica, place("k1", loads).reason) == ("c", AFFINITY_FULL)
    full = [ReplicaLoad("a", 0, frozenset({"k1"})), ReplicaLoad("b", 0)]
    assert place("k1", full).reason == ALL_FULL


def test_draining_replicas_take_no_one():
    loads = [ReplicaLoad("a", 9, frozenset({"k1"}), draining=True), ReplicaLoad("b", 1)]
    assert place("k1", loads).replica == "b"
    with pytest.raises(ValueError, match="draining"):
        place("k1", [ReplicaLoad("a", 9, draining=True)])


def test_recent_sends_count_before_the_replica_reports_them():
    """A burst of 4 sessions over 2 contexts on 2 idle replicas: one context per replica."""
    loads = [ReplicaLoad("a", 10), ReplicaLoad("b", 10)]
    sent: dict[str, list[str | None]] = {}
    for key in ("k1", "k2", "k1", "k2"):
        choice = place(key, with_sent(loads, sent))
        sent.setdefault(choice.replica, []).append(key)
    assert sent == {"a": ["k1", "k1"], "b": ["k2", "k2"]}


def _plan(sessions: int) -> MemoryPlan:
    return MemoryPlan(budget_bytes=1, fixed_bytes=0, thinker_blocks=1, thinker_block_bytes=1, talker_blocks=1,
                      talker_block_bytes=1, dynamic_bytes=0, planned_sessions=sessions)


def test_headroom_is_the_smaller_of_memory_and_measured_time():
    cost = TickCostModel(tick_seconds=1.0, headroom=0.8)
    assert headroom(_plan(10), cost, 3).sessions == 7 and headroom(_plan(10), cost, 3).limit == "memory"
    for units in (1, 2, 3, 5):          # 0.1 s fixed + 0.1 s per session: 7 fit in 0.8 s
        cost.observe(0.1 + 0.1 * units, units)
    room = headroom(_plan(10), cost, 3)
    assert (room.sessions, room.limit) == (4, "compute")
    assert headroom(_plan(5), cost, 3).limit == "memory"


def test_replicas_needed_follows_live_sessions():
    admissible = {"a": 10.0, "b": 10.0}
    assert replicas_needed({"a": 10.0, "b": 9.0}, admissible, 2, 0.75, 1, 8) == 3
    assert replicas_needed({"a": 1.0, "b": 0.0}, admissible, 4, 0.75, 1, 8) == 3     # one step down at a time
    assert replicas_needed({"a": 1.0, "b": 0.0}, admissible, 2, 0.75, 1, 8) == 1
    assert replicas_needed({"a": 5.0}, {"a": 0.0}, 2, 0.75, 1, 8) == 3             # full: grow
    assert replicas_needed({}, {}, 2, 0.75, 1, 8) == 2
    assert replicas_needed({"a": 100.0}, {"a": 10.0}, 2, 0.75, 1, 4) == 4            # capped
    ctx = SimpleNamespace(aggregated_metrics={"live_sessions": {"a": 8.0}, "admissible_sessions": {"a": 10.0}},
                          current_num_replicas=1, capacity_adjusted_min_replicas=1, capacity_adjusted_max_replicas=4)
    assert SessionUtilisationPolicy(0.5)(ctx) == (2, {})
    with pytest.raises(ValueError):
        SessionUtilisationPolicy(0.0)


def test_the_cluster_section_reaches_the_ray_deployment(tmp_path):
    pytest.importorskip("ray.serve", reason="the cluster extra is not installed")
    from duplexcache.cluster.app import ROUTING_STATS_PERIOD_S, SHUTDOWN_MARGIN_S, deployment_options

    path = tmp_path / "c.yaml"
    path.write_text("cluster:\n  replicas: 2\n  drain_timeout_s: 42\n")
    opts = deployment_options(DeployConfig.from_yaml(path, environ={}))
    assert opts["num_replicas"] == 2 and "autoscaling_config" not in opts
    assert opts["graceful_shutdown_timeout_s"] == 42 + SHUTDOWN_MARGIN_S
    router = opts["request_router_config"]
    # the report period (cluster.routing_stats_period_s's default until issue 44) and the sends it counts
    assert ROUTING_STATS_PERIOD_S == 1.0
    assert router.request_routing_stats_period_s == 1.0 and router.request_router_kwargs["sent_ttl_s"] == 6.0
    assert router.request_routing_stats_timeout_s == 5.0
    assert opts["ray_actor_options"]["num_gpus"] == 0
    path.write_text("cluster:\n  replicas: 2\n  max_replicas: 6\n  target_utilisation: 0.5\n"
                    "model:\n  device: cuda\n")
    opts = deployment_options(DeployConfig.from_yaml(path, environ={}))
    scaling = opts["autoscaling_config"]
    assert "num_replicas" not in opts and (scaling.min_replicas, scaling.max_replicas) == (2, 6)
    assert scaling.policy.policy_kwargs == {"target_utilisation": 0.5}
    assert opts["ray_actor_options"]["num_gpus"] == 1
