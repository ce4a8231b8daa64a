"""`duplexcache bench warm-start` (bench/warm_start.py) on CPU (tiny, small budget): the report's shape and counters."""
import json

import yaml

from duplexcache.cli import main as cli_main


def test_warm_start_report(tmp_path, capsys):
    cfg = tmp_path / "small.yaml"
    cfg.write_text(yaml.safe_dump({"engine": {"memory_budget": "128MiB", "activation_reserve": "16MiB"},
                                   "stage0": {"window": {"high_tokens": 400, "low_tokens": 200}}}))
    assert cli_main(["bench", "warm-start", "--config", str(cfg), "--sessions", "2", "--ticks", "1", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "warm_start.json").read_text())
    assert result == json.loads(capsys.readouterr().out)
    assert result["config"]["sessions"] == 2 and result["config"]["planned_sessions"] == 9   # 128 MiB less the fixed 64.4 MiB (arena without prompt copies)
    assert result["warmup"]["graphs"] == 0                  # CPU: nothing to capture
    assert result["graph_captures"] == {"warmup": 0, "tick": 0}
    assert [t["tick"] for t in result["per_tick"]] == [1] and len(result["first_audio_tick"]) == 2
