"""tandem's malloc settings keep a serving thread's large temporaries in the process."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

import tandem

# Arrays of a host prefill's sizes (1.4-7.5 MB), made, written and freed round after
# round on a thread other than the main one, as the engine thread does; the page faults
# of rounds 3-6 are what the settings remove (with glibc's defaults: ~8,500 here).
SNIPPET = textwrap.dedent("""
    import resource, threading
    import tandem  # noqa: F401
    import numpy as np

    def work(out):
        sizes = [1_400_000, 2_400_000, 3_800_000, 7_500_000]
        for r in range(6):
            if r == 2:
                f0 = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
            arrs = [np.ones(n // 4, np.float32) for n in sizes]
            del arrs
        out.append(resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - f0)

    out = []
    t = threading.Thread(target=work, args=(out,))
    t.start()
    t.join()
    print(out[0])
""")


@pytest.mark.skipif(not tandem.MALLOC_TUNED, reason="no glibc mallopt here")
def test_a_threads_large_temporaries_are_reused_without_page_faults():
    pages = 4 * sum([1_400_000, 2_400_000, 3_800_000, 7_500_000]) // 4096  # touched in rounds 3-6
    faults = int(subprocess.run([sys.executable, "-c", SNIPPET], capture_output=True, text=True,
                                check=True).stdout)
    assert faults < pages // 100, f"{faults} minor faults for {pages} pages written"
