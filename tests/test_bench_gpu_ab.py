"""bench/gpu_ab.py's config parsing and its table (the device runs are not testable here)."""

import importlib.util
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location("gpu_ab", Path(__file__).resolve().parents[1] / "bench" / "gpu_ab.py")
gpu_ab = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gpu_ab)


def test_config_parsing():
    assert gpu_ab.parse_config("") == {}
    assert gpu_ab.parse_config("A=1  B=x=y") == {"A": "1", "B": "x=y"}
    with pytest.raises(ValueError, match="'A'"):
        gpu_ab.parse_config("A")
    with pytest.raises(ValueError, match="'=1'"):
        gpu_ab.parse_config("=1")


def test_engine_rows_and_table_keep_configs_in_turn():
    result = {"runs": [{"section": "engine", "batch": 1, "decode_tps": 300.4, "gap_ms_p50_p90_max": [3, 4, 9.5]},
                       {"section": "engine", "what": "warm-up (compiles)"},
                       {"section": "stock", "batch": 1, "decode_tps": 99.0}]}
    result["runs"].append({"section": "engine", "batch": 4, "graph_step": {"replays": 1234, "failed": None}})
    row, graphed = gpu_ab.engine_rows(result)
    assert row["gap_max_ms"] == 9.5 and row["graph_replays"] is None and graphed["graph_replays"] == 1234
    assert "| 1,234 |" in gpu_ab.table([{**graphed, "round": 1, "config": 0}], ["g"])
    rows = [{**row, "round": 1, "config": 0}, {**row, "decode_tps": 280.0, "round": 1, "config": 1}]
    lines = gpu_ab.table(rows, ["defaults", "X=0"]).splitlines()
    assert lines[2].startswith("| 1 | 1 | defaults | 300 |") and "| 9.5 |" in lines[2]
    assert lines[3].startswith("| 1 | 1 | X=0 | 280 |")
    assert "| - |" in lines[2]  # a column the process did not report
