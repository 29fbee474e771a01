"""Process helpers for tests that check nothing is left running."""

from __future__ import annotations


def is_live(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie (a zombie has already exited)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False
