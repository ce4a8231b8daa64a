"""Issue 43: the card waterfall on /metrics (a gauge per part) and serve setting the CUDA
allocator's expandable segments before CUDA starts."""
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


def test_serve_sets_expandable_segments_unless_the_environment_sets_the_allocator_conf():
    cuda = DeployConfig.from_dict({"model": {"device": "cuda:1"}}, environ={})
    env: dict[str, str] = {}
    assert configure_cuda_allocator(cuda, env) == EXPANDABLE
    assert env[ALLOC_CONF] == EXPANDABLE == "expandable_segments:True"
    for operators in ("max_split_size_mb:128", "expandable_segments:False"):   # the operator's setting wins
        env = {ALLOC_CONF: operators}
        assert configure_cuda_allocator(cuda, env) == operators and env == {ALLOC_CONF: operators}
    env = {}   # a CPU deploy leaves CUDA alone
    assert configure_cuda_allocator(DeployConfig.from_dict({}, environ={}), env) is None and ALLOC_CONF not in env
