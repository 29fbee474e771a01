"""Linux's parent-death signal: a process asks to be sent a signal when its parent dies.

``prctl(PR_SET_PDEATHSIG)`` holds for the life of the process (it is cleared by fork in
the children it makes) and fires when the *thread* that forked it exits; every caller
here forks from the main thread, whose exit is the process's. A parent that died before
the call goes unnoticed, so a caller compares ``os.getppid()`` with the parent it expects.
"""

from __future__ import annotations

import ctypes
import sys

PR_SET_PDEATHSIG = 1


def parent_death_signal(sig: int) -> bool:
    """Ask for ``sig`` when the parent dies; False where the system has no such call."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        return ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, int(sig)) == 0
    except OSError:
        return False
