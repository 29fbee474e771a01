"""Prefill first across the processes of one host: the hybrid scheduler's priority for
co-located prefill and decode workers.

A hybrid worker's scheduler runs waiting prompts before the next decode step, so a
prompt's first token costs only its own prefill. A prefill worker and a decode worker on
the same cores have no such rule: each runs its math library on every core and both go
at about half speed, so a prompt's prefill takes up to twice as long (bench/disagg.py's
timeline: 69 decode steps ran inside the prefills of 16 prompts). With a gate file the
workers share, a prefill worker holds a shared ``flock`` from the step that starts a
prefill until every prompt in it has its first token and its KV handed off, and for as
long as more prompts wait for the next prefill step (several prefill workers may hold it
at once), and a decode worker takes the lock exclusively, and lets go at once, before
each of its steps: it waits while any prefill runs, for up to ``max_wait_s`` per step
(``worker.cpu_gate_max_wait_ms``), asleep in the kernel until the last prefill lets go.
A decode step already running finishes; no decode step starts during a prefill shorter
than that bound. The lock is the kernel's: a worker that dies releases it.

Off unless ``worker.cpu_gate`` names a file; only for workers that share cores.
"""

from __future__ import annotations

import fcntl
import os
import threading


class CpuGate:
    def __init__(self, path: str, max_wait_s: float = 10.0):
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        self.max_wait_s = max_wait_s
        self.overrides = 0  # decode steps that ran during a prefill after waiting max_wait_s
        self.held = False
        self._prefilling: set[bytes] = set()
        self._lock = threading.Lock()
        self.waits = 0  # decode steps that had to wait (for stats and tests)
        self._free: threading.Event | None = None  # set once a waiting decode step may go
        # Prefill side: whether prompts wait in the engine for the next prefill batch. The
        # gate stays shut between two batches, as hybrid's scheduler runs the waiting
        # prompts before its next decode step: released after each batch, it let the decode
        # worker's KV imports start alongside the next batch (timeline: a 1-prompt prefill
        # 0.63 s instead of 0.5 s).
        self.prompts_waiting = lambda: False

    # ---- prefill worker (engine thread) -----------------------------------------------------
    def prefill_started(self, request_ids) -> None:
        """A step that prefills these prompts is about to run: take the cores first."""
        with self._lock:
            self._prefilling.update(request_ids)
            if self.held:
                return
        fcntl.flock(self.fd, fcntl.LOCK_SH)  # waits only while a decode worker checks the gate
        with self._lock:
            self.held = True
            if not self._prefilling:  # finished while we waited
                self._release()

    def prompt_done(self, request_id: bytes) -> None:
        """A prompt no longer needs the cores ahead of decode: its first token is out and
        its KV handed off (or it was aborted or failed). Lets decode go once none is left
        and no prompt waits for the next prefill. Any thread.

        The handoff counts as part of the prefill so that a co-located decode worker finds
        the KV of every prompt of a burst in its queue when it gets the cores, and imports
        them in one step: let go at the first token, it started on the KV that had arrived
        and imported the rest in a second step, each step a forward pass and a rebuild of
        its batch's contiguous KV copy."""
        with self._lock:
            self._prefilling.discard(request_id)
            if self.held and not self._prefilling and not self.prompts_waiting():
                self._release()

    def between_steps(self) -> None:
        """A scheduling decision that started no prefill: let decode go if no prompt is
        prefilling or handing off and none waits (prompts that waited behind the last prefill
        batch are now in one)."""
        with self._lock:
            if self.held and not self._prefilling and not self.prompts_waiting():
                self._release()

    def _release(self) -> None:
        fcntl.flock(self.fd, fcntl.LOCK_UN)
        self.held = False

    # ---- decode worker (engine thread) --------------------------------------------------------
    def before_decode_step(self) -> None:
        """Wait while a co-located prefill runs, but at most ``max_wait_s`` per step: a long
        run of prefills (a very long prompt, a burst of them) must not starve decoding into
        the worker's stall timeout, the way hybrid's scheduler grants decode ticks to a
        parked long prompt.

        The wait is a blocking ``flock`` on a helper thread (flock has no timeout), so the
        kernel wakes the decode worker as the last prefill lets go, and nothing runs while
        it waits. It used to poll every millisecond: a thousand wake-ups a second of the
        decode worker, each able to preempt one of the prefill's two MKL threads in the
        middle of a product, for the whole of every prefill."""
        if self._free is None:
            try:
                fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                fcntl.flock(self.fd, fcntl.LOCK_UN)
                return
            except BlockingIOError:
                pass
            self._free = threading.Event()
            # Its own descriptor of the same open file (the same flock owner), so that
            # close() cannot hand its number to another file while it waits.
            threading.Thread(target=self._wait_free, args=(os.dup(self.fd), self._free), name="tandem-cpu-gate",
                             daemon=True).start()
        if self._free.is_set():
            self._free = None
            return
        self.waits += 1
        if self._free.wait(self.max_wait_s):
            self._free = None
        else:
            self.overrides += 1  # decode this step alongside the prefill; the helper keeps waiting

    @staticmethod
    def _wait_free(fd: int, free: threading.Event) -> None:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)  # sleeps in the kernel while any prefill holds it
            fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)
            free.set()

    def close(self) -> None:
        os.close(self.fd)


def install(gate: CpuGate, engine, role: str, prompts_waiting=None) -> bool:
    """Put the gate on ``engine``'s scheduling (its schedule hooks run on the engine thread
    before it queues each step). False when the engine has no hooks (the stub engine)."""
    add_hooks = getattr(engine, "add_schedule_hooks", None)
    if add_hooks is None or role == "hybrid":
        return False
    if role == "prefill":
        if prompts_waiting is not None:
            gate.prompts_waiting = prompts_waiting

        def after(plan):
            if plan is not None and plan.kind == "prefill":
                # Every row, sampled or a chunk: a chunked prompt keeps the cores until
                # its first token.
                gate.prefill_started([r.seq.request_id for r in plan.rows])
            else:
                gate.between_steps()
        add_hooks(after=after)
    else:
        add_hooks(before=gate.before_decode_step)
    return True
