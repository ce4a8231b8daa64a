"""Issue 43: the card waterfall on /metrics (a gauge per part) and the serve switch that sets
the CUDA allocator's expandable segments before CUDA starts."""
from __future__ import annotations

from duplexcache.config import DeployConfig
from duplexcache.runtime.memory.waterfall import Part, Waterfall
from duplexcache.server.cli import ALLOC_CONF, EXPANDABLE, configure_cuda_allocator
from duplexcache.server.metrics import ServerMetrics


def test_waterfall_parts_are_a_gauge_with_a_part_label():
    wf = Waterfall("cuda:0", 100, "test", (Part("weights", 60, "weights"), Part("free_unplanned", 40, "free")),
                   admitted=3, floor_bytes=10, weight_bytes=60)
    m = ServerMetrics()
    m.set_waterfall(wf)
    text = m.render()[0].decode()
    assert 'duplexcache_device_bytes{part="weights"} 60.0' in text
    assert 'duplexcache_device_bytes{part="free_unplanned"} 40.0' in text
    assert "duplexcache_device_total_bytes 100.0" in text
    assert "duplexcache_admitted_over_floor_limited 0.75" in text   # 3 / ((100 - 60) / 10)


def _cuda_deploy(on: bool) -> DeployConfig:
    return DeployConfig.from_dict({"model": {"device": "cuda"}, "engine": {"cuda_expandable_segments": on}},
                                  environ={})


def test_expandable_segments_switch_sets_the_allocator_conf():
    env: dict[str, str] = {}
    assert configure_cuda_allocator(_cuda_deploy(True), env) == EXPANDABLE
    assert env[ALLOC_CONF] == EXPANDABLE
    env = {}
    assert configure_cuda_allocator(_cuda_deploy(False), env) is None and ALLOC_CONF not in env
    env = {ALLOC_CONF: "max_split_size_mb:128"}   # the operator's setting wins
    assert configure_cuda_allocator(_cuda_deploy(True), env) == "max_split_size_mb:128"
    env = {}   # a CPU deploy leaves CUDA alone
    configure_cuda_allocator(DeployConfig.from_dict({"engine": {"cuda_expandable_segments": True}}, environ={}), env)
    assert ALLOC_CONF not in env
