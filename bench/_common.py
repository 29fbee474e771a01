"""What every benchmark script shares: the import path, percentiles, machine facts,
per-process CPU, a baseline checkout, and writing results.

Imported as ``from _common import ...`` (a script's own directory is first on sys.path);
importing it puts the repository root on sys.path and imports ``tandem`` first (it
preloads the BLAS that mlx needs).
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import tandem  # noqa: E402,F401


def pct(xs, q: float) -> float:
    """The ``q`` quantile (nearest rank) of ``xs``; NaN when empty."""
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def machine() -> dict:
    return {"when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "cpus": os.cpu_count(),
            "load_avg_1m": os.getloadavg()[0], "python": platform.python_version()}


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process, all its threads (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def baseline_tree(ref: str) -> Path:
    """``tandem/`` as of git ``ref``, unpacked in a temp dir, to run that code side by side."""
    dest = Path(tempfile.mkdtemp(prefix="tandem-bench-baseline-"))
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", ref, "tandem"], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
    return dest


def write_results(out: str | Path, name: str, markdown: str, result: dict) -> None:
    """Print the table and write ``<out>/<name>.md`` and ``<name>.json``."""
    print(markdown)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.md").write_text(markdown)
    (out / f"{name}.json").write_text(json.dumps(result, indent=2))
