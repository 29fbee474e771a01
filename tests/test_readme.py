"""The README says where tandem is tested, and each claim points at something that
exists (issue #45 item 9: it claimed Apple silicon with nothing testing it)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _platform_rows() -> list[list[str]]:
    text = (ROOT / "README.md").read_text()
    section = text.split("## Where it runs", 1)[1].split("\n## ", 1)[0]
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in section.splitlines() if line.startswith("|")]
    assert rows[0] == ["platform", "tested by", "status"]
    return rows[2:]


def test_every_tested_platform_names_tests_that_exist_and_the_rest_say_untested():
    rows = _platform_rows()
    assert rows
    for platform, evidence, status in rows:
        paths = [p for p in re.findall(r"`([^`]+)`", evidence) if "/" in p or p.startswith(".")]
        if status == "tested":
            assert paths, f"{platform}: 'tested' without naming the tests"
            for path in paths:
                assert (ROOT / path).exists(), f"{platform}: {path} does not exist"
        else:
            assert status == "untested", f"{platform}: status must be tested or untested, not {status!r}"


def test_apple_silicon_is_not_claimed_as_tested():
    rows = {platform: status for platform, _, status in _platform_rows()}
    apple = [p for p in rows if "Apple" in p]
    assert apple and all(rows[p] == "untested" for p in apple)
    intro = (ROOT / "README.md").read_text().split("```", 1)[0]
    assert "Apple silicon" not in intro or "untested" in intro
