"""2-minute chaos runs (bench/chaos.py): the whole stack on loopback, and across hosts
(every process in a network namespace of its own, cuts that drop packets between hosts:
broker links, prefill -> decode KV paths, whole cables); mixed load, a seeded fault
schedule; nothing lost, repeated, hung or leaked, checked on text and on tokens."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.ops.netns import namespaces_available

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("variant", ["loopback", "netns"])
def test_two_minute_chaos_run_loses_nothing(variant):
    argv = ["--minutes", "2", "--seed", "3"]
    if variant == "netns":
        if reason := namespaces_available():
            pytest.skip(f"multi-host chaos run skipped: {reason}")
        argv = ["--netns", "--minutes", "2", "--seed", "4"]
    log = Path(f"/tmp/tandem-chaos-test-{variant}.log")  # outside pytest's rotating tmp dirs, to read after a failure
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "chaos.py"), *argv, "--log", str(log)],
                          capture_output=True, text=True, timeout=900, cwd=ROOT)
    lines = proc.stdout.strip().splitlines()
    assert lines, f"no output; stderr: {proc.stderr[-3000:]}"
    result = json.loads(lines[-1])
    summary = {k: result[k] for k in ("requests", "completed_exact", "failed_clean", "unclean", "mismatched",
                                      "lost_tokens", "duplicated_tokens", "hung", "leaked_blocks", "faults",
                                      "fault_kinds", "tokens_checked")}
    detail = f"{summary}\nexamples: {result['examples']}\nlog tail:\n{log.read_text()[-3000:]}"
    assert result["network"] == variant, detail
    assert result["lost_tokens"] == 0, detail
    assert result["duplicated_tokens"] == 0, detail
    assert result["hung"] == 0, detail
    assert result["leaked_blocks"] == 0, detail
    assert result["unclean"] == 0 and result["mismatched"] == 0, detail
    assert result["reference_failures"] == [], detail
    # The run did something: requests completed exactly under faults, links were cut,
    # tokens (not only text) were compared, and the stack answered exactly after them.
    assert result["faults"] >= 10 and result["completed_exact"] > 0, detail
    assert result["fault_kinds"].get("cut_link", 0) + result["fault_kinds"].get("cut_kv", 0) >= 1, detail
    assert result["tokens_checked"] > 0, detail
    assert result["after_chaos_exact"] == result["after_chaos_requests"], detail
    assert proc.returncode == 0, detail
