import logging

import pytest

from duplexcache.cfm.graph_grid import GraphGridError, ReplayGroup, arena_rows, replay_groups
from duplexcache.config import DeployConfig
from duplexcache.config_values import parse_graph_grid


def test_parse():
    assert parse_graph_grid("1,4,8,16") == (1, 4, 8, 16)
    assert parse_graph_grid(" 16, 1,4 ,4") == (1, 4, 16)
    assert parse_graph_grid([8, 1, 8]) == (1, 8) and parse_graph_grid(None) is None
    # The environment variable is read by the deploy config, through the same parser.
    env = {"DUPLEXCACHE_CFM_GRAPH_GRID": "8, 2"}
    assert DeployConfig.default("tiny", environ=env).code2wav.graph_grid == (2, 8)


@pytest.mark.parametrize("text,bad", [("1,x,8", "'x'"), ("1,,8", "''"), ("4,0", "tier 0"), ("-2", "tier -2"),
                                      ("1.5", "'1.5'"), (" ", "empty")])
def test_parse_errors_name_the_value(text, bad):
    with pytest.raises(ValueError, match=bad) as err:
        parse_graph_grid(text)
    assert "DUPLEXCACHE_CFM_GRAPH_GRID" in str(err.value)


def test_arena_rows(caplog):
    assert arena_rows(32, (1, 4, 8, 16), False) == 32
    assert arena_rows(32, (1, 4, 8, 16), True) == 16
    with caplog.at_level(logging.WARNING):
        assert arena_rows(8, (1, 4, 8, 16), True) == 8
    assert "saves nothing" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        arena_rows(32, (1, 4, 8, 16), True)
    assert "saves nothing" not in caplog.text


def test_switch_without_grid_is_an_error():
    with pytest.raises(GraphGridError, match="would change nothing"):
        arena_rows(32, (), True)
    assert arena_rows(32, (), False) == 32


@pytest.mark.parametrize("batch,grid,rows,expected", [
    (21, (1, 4, 8, 16), 16, [(0, 16, 16), (16, 5, 8)]),
    (16, (1, 4, 8, 16), 16, [(0, 16, 16)]),
    (3, (1, 4, 8, 16), 16, [(0, 3, 4)]),
    (1, (1, 4, 8, 16), 16, [(0, 1, 1)]),
    (40, (1, 4, 8, 16), 16, [(0, 16, 16), (16, 16, 16), (32, 8, 8)]),
    (10, (1, 4, 8, 16), 8, [(0, 8, 8), (8, 2, 4)]),     # tiers above the arena are skipped
    (5, (), 4, [(0, 4, 4), (4, 1, 1)]),                  # eager: tier = rows
    (0, (1, 4), 4, []),
])
def test_replay_groups(batch, grid, rows, expected):
    assert replay_groups(batch, grid, rows) == [ReplayGroup(*g) for g in expected]


def test_replay_groups_no_tier_fits():
    with pytest.raises(GraphGridError, match="no graph tier"):
        replay_groups(3, (8, 16), 4)
