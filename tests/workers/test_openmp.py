"""MKL's OpenMP threads stop spinning after a parallel region on co-located workers."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tandem.workers import openmp

# A process runs matrix products, then idles 0.3 s: the CPU it uses while idle is its
# OpenMP threads spinning (KMP_BLOCKTIME, 200 ms by default).
_IDLE_CPU = r"""
import resource, sys, time
import tandem
import mlx.core as mx
from tandem.workers import openmp
a, w = mx.random.normal((1024, 576)), mx.random.normal((1536, 576))
mx.eval(w @ a.T)
if sys.argv[1] != "default":
    assert openmp.set_blocktime(int(sys.argv[1]))
def cpu():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime
for _ in range(10):
    mx.eval(w @ a.T)
c = cpu()
time.sleep(0.3)
print((cpu() - c) * 1000)
"""


def _idle_cpu_ms(blocktime: str) -> float:
    out = subprocess.run([sys.executable, "-c", _IDLE_CPU, blocktime], capture_output=True, text=True, timeout=120,
                         env={"PATH": "/usr/bin:/bin", "HOME": "/tmp"})
    assert out.returncode == 0, out.stderr[-2000:]
    return float(out.stdout.strip().splitlines()[-1])


def test_the_auto_blocktime_stops_the_spinning_after_the_runtime_started():
    if openmp._runtime() is None:
        pytest.skip("not Intel's OpenMP runtime (no MKL here)")
    stopped = _idle_cpu_ms(str(openmp.AUTO_BLOCKTIME_MS))
    assert stopped < 40, stopped  # no thread spins through the 300 ms
    # Spinning shows only when the spinning threads get a core: on a loaded machine a try
    # can see little of it, so up to three tries.
    spinning = 0.0
    for _ in range(3):
        spinning = max(spinning, _idle_cpu_ms("default"))
        if spinning > stopped + 50:
            break
    assert spinning > stopped + 50, (spinning, stopped)


def test_auto_is_zero_only_for_gated_prefill_and_decode_workers(monkeypatch):
    monkeypatch.delenv("KMP_BLOCKTIME", raising=False)
    assert openmp.blocktime_for("prefill", True, -1) == openmp.AUTO_BLOCKTIME_MS
    assert openmp.blocktime_for("decode", True, -1) == openmp.AUTO_BLOCKTIME_MS
    assert openmp.blocktime_for("decode", False, -1) is None
    assert openmp.blocktime_for("hybrid", True, -1) is None
    assert openmp.blocktime_for("hybrid", False, 5) == 5  # an explicit setting applies to any role
    monkeypatch.setenv("KMP_BLOCKTIME", "200")
    assert openmp.blocktime_for("prefill", True, -1) is None  # the operator's own choice stands
