"""A prefill worker finishes exporting one prefill batch before it starts the next.

The engine queues step N+1 before it reads step N back (one step of pipelining), and a
prefill worker's step N ends with an export: the prompts' KV is copied out of the store
for the handoff, and their first tokens are emitted with it. By then step N+1's forward
has already replaced the store's arrays with its own pending writes, so the export
evaluates them, which is most of step N+1's prefill. Batch N's first tokens and
handoffs therefore waited for batch N+1's whole prefill (bench/disagg.py timeline:
first tokens of 4 prompts 2.3 s late, all 8 prompts of a burst published within 0.2 s
of each other, where the hybrid worker publishes each batch as it finishes).

So after a step that exports, the next scheduling decision sees no waiting prompts: the
engine reads step N back, exports and emits with nothing queued behind it, and the
decision after that admits the waiting prompts as usual. The cost is the overlap of
building step N+1's graph with step N's compute, a few milliseconds per prefill batch.
Hybrid workers and decode workers never export, so this is for prefill workers only.

The proper place for this is the engine (export from step N's arrays, or complete an
exporting step before launching the next); this works through its schedule hooks.
"""

from __future__ import annotations


class ExportOrder:
    def __init__(self, scheduler):
        self.scheduler = scheduler
        self.export_in_flight = False
        self._held: list | None = None
        self.deferrals = 0  # scheduling decisions that held waiting prompts back (tests, stats)

    def prompts_waiting(self) -> bool:
        """Whether prompts wait for a prefill step (any thread: each list is swapped whole)."""
        held = self._held
        return bool(held) or bool(self.scheduler.waiting)

    def before(self) -> None:
        if self.export_in_flight and self.scheduler.waiting:
            self._held, self.scheduler.waiting = self.scheduler.waiting, []
            self.deferrals += 1

    def after(self, plan) -> None:
        if self._held is not None:
            # The scheduler may have put preempted sequences back meanwhile; held prompts
            # keep their place ahead of nothing they did not precede: merge by sort key.
            merged = self._held + self.scheduler.waiting
            merged.sort(key=lambda s: s.sort_key)
            self.scheduler.waiting = merged
            self._held = None
        self.export_in_flight = plan is not None and any(
            r.samples and r.seq.export_after_prefill for r in plan.rows)


def install(engine) -> ExportOrder | None:
    """Put the ordering on ``engine``'s schedule hooks; None for an engine without them
    (the stub engine)."""
    add_hooks = getattr(engine, "add_schedule_hooks", None)
    scheduler = getattr(engine, "scheduler", None)
    if add_hooks is None or scheduler is None or not hasattr(scheduler, "waiting"):
        return None
    order = ExportOrder(scheduler)
    add_hooks(before=order.before, after=order.after)
    return order
