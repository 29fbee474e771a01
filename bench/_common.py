"""What every benchmark script shares: the import path, percentiles, machine facts,
per-process CPU, a baseline checkout, writing results, a grouped-bar SVG chart, and
patches of the engine's methods that a probe puts back.

Imported as ``from _common import ...`` (a script's own directory is first on sys.path);
importing it puts the repository root on sys.path and imports ``tandem`` first (it
preloads the BLAS that mlx needs).
"""

from __future__ import annotations

import json
import math
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from xml.sax.saxutils import escape

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


def bar_chart_svg(title: str, groups: list[str], series: list[tuple[str, str, list[float | None]]],
                  annotations: list[str] | None = None, y_label: str | None = None,
                  width: int = 640, height: int = 320) -> str:
    """Grouped bars as a dependency-free SVG: one group per entry of ``groups``, one bar per
    series (``(label, color, values)``, a value per group) in each, and ``annotations[i]``
    written over group i's tallest bar. A value of None or NaN draws no bar (that series did
    not run at that group); ``y_label`` is written up the left edge when given.
    """
    assert all(len(values) == len(groups) for _, _, values in series), "one value per group in every series"
    assert annotations is None or len(annotations) == len(groups), "one annotation per group"
    W, H, left, bottom, top = width, height, 60, 40, 30
    shown = lambda v: v is not None and math.isfinite(v)  # noqa: E731
    tallest = [max((vs[i] for _, _, vs in series if shown(vs[i])), default=None) for i in range(len(groups))]
    peak = max((t for t in tallest if t is not None), default=0.0) * 1.15 or 1.0
    # Tick labels need decimals once the step between them drops below a few units (seconds, ratios).
    digits = 0 if peak / 5 >= 5 else 1 if peak / 5 >= 0.5 else 2
    slot = (W - left - 20) / max(1, len(groups))
    bar = slot * 0.7 / max(1, len(series))
    y = lambda v: H - bottom - (H - bottom - top) * v / peak  # noqa: E731
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" font-family="sans-serif" font-size="12">',
           f'<text x="{W / 2}" y="18" text-anchor="middle">{escape(title)}</text>',
           f'<line x1="{left}" y1="{H - bottom}" x2="{W - 10}" y2="{H - bottom}" stroke="black"/>']
    if y_label:
        mid = (H - bottom + top) / 2
        out.append(f'<text x="14" y="{mid:.1f}" text-anchor="middle" transform="rotate(-90 14 {mid:.1f})">{escape(y_label)}</text>')
    for i in range(5):
        v = peak * i / 5
        out.append(f'<text x="{left - 6}" y="{y(v) + 4:.1f}" text-anchor="end">{v:.{digits}f}</text>')
        out.append(f'<line x1="{left}" y1="{y(v):.1f}" x2="{W - 10}" y2="{y(v):.1f}" stroke="#ddd"/>')
    for i, group in enumerate(groups):
        x0 = left + i * slot + slot * 0.15
        for j, (_, color, values) in enumerate(series):
            v = values[i]
            if shown(v):
                out.append(f'<rect x="{x0 + j * bar:.1f}" y="{y(v):.1f}" width="{bar:.1f}" height="{H - bottom - y(v):.1f}" fill="{color}"/>')
        mid = x0 + bar * len(series) / 2
        out.append(f'<text x="{mid:.1f}" y="{H - bottom + 16}" text-anchor="middle">{escape(group)}</text>')
        if annotations and annotations[i] and tallest[i] is not None:
            out.append(f'<text x="{mid:.1f}" y="{y(tallest[i]) - 4:.1f}" text-anchor="middle">{escape(annotations[i])}</text>')
    for j, (label, color, _) in enumerate(series):
        out.append(f'<rect x="{left + 10}" y="{30 + 18 * j}" width="12" height="12" fill="{color}"/><text x="{left + 28}" y="{40 + 18 * j}">{escape(label)}</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


class Patches:
    """Attributes a probe replaces (an engine's bound methods, ``mx.async_eval``) and puts
    back. An attribute that was not the object's own (a method the class showed) is deleted
    again rather than set, so the class's method shows once more."""

    def __init__(self):
        self._saved: list[tuple[object, str, bool, object]] = []

    def patch(self, obj, name: str, new):
        """Set ``obj.name`` to ``new``; return what it was."""
        old = getattr(obj, name)
        own = vars(obj)
        self._saved.append((obj, name, name in own, own.get(name)))
        setattr(obj, name, new)
        return old

    def wrap(self, obj, name: str, wrapper):
        """``obj.name = wrapper(obj.name)``; return the original."""
        return self.patch(obj, name, wrapper(getattr(obj, name)))

    def undo(self) -> None:
        """Put everything back, the last patch first (so two of one attribute unwind)."""
        while self._saved:
            obj, name, was_own, old = self._saved.pop()
            if was_own:
                setattr(obj, name, old)
            else:
                delattr(obj, name)


async def http_body_chunks(reader, headers: dict):
    """An HTTP response's body from an asyncio stream, piece by piece: chunked transfer
    decoding (a connection that closes inside the body raises, rather than reading as a
    complete one), else ``content-length`` bytes, else everything to EOF."""
    if headers.get("transfer-encoding", "").lower() == "chunked":
        while True:
            line = await reader.readline()
            if not line:
                raise ConnectionResetError("connection closed inside a chunked body")
            size = int(line.split(b";")[0].strip() or b"0", 16)
            if size == 0:
                return
            data = await reader.readexactly(size)
            await reader.readexactly(2)
            yield data
    else:
        n = int(headers.get("content-length", "-1"))
        yield await (reader.readexactly(n) if n >= 0 else reader.read())


async def sse_data(reader, headers: dict):
    """The ``data:`` payloads of a server-sent-events body (:func:`http_body_chunks`), one
    per line as each event completes, ``b"[DONE]"`` included."""
    buf = b""
    async for data in http_body_chunks(reader, headers):
        buf += data
        while b"\n\n" in buf:
            event, buf = buf.split(b"\n\n", 1)
            for line in event.split(b"\n"):
                if line.startswith(b"data: "):
                    yield line[6:]
