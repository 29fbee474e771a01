"""A 2-minute chaos run (bench/chaos.py): the whole stack on loopback, mixed load, a seeded
fault schedule; nothing lost, repeated, hung or leaked."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_two_minute_chaos_run_loses_nothing():
    log = Path("/tmp/tandem-chaos-test.log")  # outside pytest's rotating tmp dirs, to read after a failure
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "chaos.py"), "--minutes", "2", "--seed", "3",
                           "--log", str(log)], capture_output=True, text=True, timeout=900, cwd=ROOT)
    lines = proc.stdout.strip().splitlines()
    assert lines, f"no output; stderr: {proc.stderr[-3000:]}"
    result = json.loads(lines[-1])
    summary = {k: result[k] for k in ("requests", "completed_exact", "failed_clean", "unclean", "mismatched",
                                      "lost_tokens", "duplicated_tokens", "hung", "leaked_blocks", "faults")}
    detail = f"{summary}\nexamples: {result['examples']}\nlog tail:\n{log.read_text()[-3000:]}"
    assert result["lost_tokens"] == 0, detail
    assert result["duplicated_tokens"] == 0, detail
    assert result["hung"] == 0, detail
    assert result["leaked_blocks"] == 0, detail
    assert result["unclean"] == 0 and result["mismatched"] == 0, detail
    assert result["reference_failures"] == [], detail
    # The run did something: requests completed exactly under faults, and the stack
    # answered exactly after them.
    assert result["faults"] >= 10 and result["completed_exact"] > 0, detail
    assert result["after_chaos_exact"] == result["after_chaos_requests"], detail
    assert proc.returncode == 0, detail
