"""Where each thread's time went, from py-spy's raw collapsed stacks (``--format raw``).

``bench/gpu_serving.py --py-spy S`` writes one file per worker and level; on the device the
files are large, so this prints the answer where it was recorded:

    python3 bench/stacks.py $OUT/gs-hybrid-c64-*.txt [--top 12]

Per thread with at least 2% of the samples: its share, then the frames it was in when
sampled (self) and the frames on its stack (inclusive), each as a share of that thread's
samples.
"""

from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path


def summarize(lines, top: int = 12) -> str:
    per_thread: dict[str, int] = collections.Counter()
    leaf: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    incl: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for line in lines:
        stack, _, count = line.rstrip("\n").rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        thread, *frames = stack.split(";")
        per_thread[thread] += n
        leaf[thread][frames[-1] if frames else "(no Python frame)"] += n
        for f in set(frames):
            incl[thread][f] += n
    total = sum(per_thread.values()) or 1
    out = []
    for thread, n in per_thread.most_common():
        if n / total < 0.02:
            continue
        out.append(f"{thread}: {n} samples ({100 * n / total:.0f}%)")
        out.append("  self:")
        out += [f"    {100 * c / n:5.1f}%  {f[:140]}" for f, c in leaf[thread].most_common(top)]
        out.append("  on the stack:")
        out += [f"    {100 * c / n:5.1f}%  {f[:140]}" for f, c in incl[thread].most_common(top)]
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="+", type=Path)
    ap.add_argument("--top", type=int, default=12)
    a = ap.parse_args(argv)
    for f in a.files:
        print(f"== {f}")
        with f.open() as fh:
            print(summarize(fh, a.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
