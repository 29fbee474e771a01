"""The co-located CPU gate: no decode step starts while a prefill holds the cores."""

from __future__ import annotations

import threading
from types import SimpleNamespace

from tandem.workers.gate import CpuGate, install


def _decode_in_thread(gate: CpuGate):
    passed = threading.Event()

    def run():
        gate.before_decode_step()
        passed.set()
    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, passed


def test_decode_waits_until_every_prompt_of_the_prefill_has_its_prompt_done(tmp_path):
    path = str(tmp_path / "cpu.gate")
    prefill, decode = CpuGate(path), CpuGate(path)  # two open files: flock treats them as two holders
    prefill.prefill_started([b"a", b"b"])
    assert prefill.held
    t, passed = _decode_in_thread(decode)
    prefill.prompt_done(b"a")
    assert prefill.held  # b is still prefilling
    t.join(0.3)
    assert not passed.is_set()
    prefill.prompt_done(b"b")
    assert not prefill.held
    t.join(5)
    assert passed.is_set()
    assert decode.waits == 1
    prefill.close()
    decode.close()


def test_decode_goes_straight_through_without_a_prefill(tmp_path):
    path = str(tmp_path / "cpu.gate")
    prefill, decode = CpuGate(path), CpuGate(path)
    for _ in range(3):
        decode.before_decode_step()
    prefill.prefill_started([b"x"])
    prefill.prompt_done(b"x")
    decode.before_decode_step()
    assert decode.waits == 0
    # A first token for a prompt the gate never saw (an imported or resumed request) changes nothing.
    prefill.prompt_done(b"unknown")
    assert not prefill.held


def test_two_prefill_workers_prefill_at_once_and_decode_waits_for_both(tmp_path):
    path = str(tmp_path / "cpu.gate")
    p1, p2, decode = CpuGate(path), CpuGate(path), CpuGate(path)
    p1.prefill_started([b"a"])
    p2.prefill_started([b"b"])  # would hang here if prefill workers excluded each other
    assert p1.held and p2.held
    t, passed = _decode_in_thread(decode)
    p1.prompt_done(b"a")
    t.join(0.3)
    assert not passed.is_set()
    p2.prompt_done(b"b")
    t.join(5)
    assert passed.is_set()


def test_a_decode_step_waits_at_most_max_wait_then_runs_alongside(tmp_path):
    path = str(tmp_path / "cpu.gate")
    prefill, decode = CpuGate(path), CpuGate(path, max_wait_s=0.05)
    prefill.prefill_started([b"long"])  # a prefill that outlasts the bound
    t, passed = _decode_in_thread(decode)
    t.join(5)
    assert passed.is_set() and decode.waits == 1 and decode.overrides == 1
    assert prefill.held  # the prefill keeps its claim; only this step went ahead
    prefill.prompt_done(b"long")
    decode.before_decode_step()
    assert decode.overrides == 1


def test_more_prompts_joining_a_held_prefill_keep_it_held(tmp_path):
    gate = CpuGate(str(tmp_path / "g"))
    gate.prefill_started([b"a"])
    gate.prefill_started([b"b"])  # the next step's prompts, while a is still in flight
    gate.prompt_done(b"a")
    assert gate.held
    gate.prompt_done(b"b")
    assert not gate.held


def test_the_gate_stays_shut_between_prefill_batches_while_prompts_wait(tmp_path):
    """Hybrid's scheduler runs waiting prompts before its next decode step: the decode
    worker must not slip in between two prefill batches of one burst."""
    path = str(tmp_path / "cpu.gate")
    prefill, decode = CpuGate(path), CpuGate(path)
    waiting = [b"c"]
    prefill.prompts_waiting = lambda: bool(waiting)
    prefill.prefill_started([b"a", b"b"])
    prefill.prompt_done(b"a")
    prefill.prompt_done(b"b")  # batch over, but c waits for the next one
    assert prefill.held
    prefill.between_steps()  # a decision that started no prefill (c not admitted yet)
    assert prefill.held
    t, passed = _decode_in_thread(decode)
    waiting.clear()
    prefill.prefill_started([b"c"])
    t.join(0.3)
    assert not passed.is_set()
    prefill.prompt_done(b"c")
    assert not prefill.held
    t.join(5)
    assert passed.is_set()
    # Prompts that wait but never get prefilled do not hold decode beyond a decision
    # that finds none waiting.
    waiting.append(b"d")
    prefill.prefill_started([b"e"])
    prefill.prompt_done(b"e")
    assert prefill.held
    waiting.clear()
    prefill.between_steps()
    assert not prefill.held
    prefill.close()
    decode.close()


class _Engine:
    """Runs its schedule hooks around each plan, as Engine._tick does."""

    def __init__(self, plans):
        self.plans = list(plans)
        self.before, self.after = [], []

    def add_schedule_hooks(self, before=None, after=None):
        self.before += [before] if before else []
        self.after += [after] if after else []

    def tick(self):
        for h in self.before:
            h()
        plan = self.plans.pop(0)
        for h in self.after:
            h(plan)
        return plan


def _plan(kind, *rids):
    return SimpleNamespace(kind=kind, rows=[SimpleNamespace(seq=SimpleNamespace(request_id=r)) for r in rids])


def test_install_gates_prefill_plans_on_a_prefill_worker_and_every_step_on_a_decode_worker(tmp_path):
    calls = []
    gate = SimpleNamespace(prefill_started=lambda ids: calls.append(("prefill", ids)),
                           before_decode_step=lambda: calls.append(("decode",)),
                           between_steps=lambda: calls.append(("between",)))
    eng = _Engine([_plan("prefill", b"a", b"b"), _plan("decode", b"a"), None])
    assert install(gate, eng, "prefill")
    assert eng.tick().kind == "prefill"
    eng.tick()
    assert eng.tick() is None
    assert calls == [("prefill", [b"a", b"b"]), ("between",), ("between",)]

    calls.clear()
    eng = _Engine([_plan("decode", b"a"), None])
    assert install(gate, eng, "decode")
    eng.tick()
    eng.tick()
    assert calls == [("decode",), ("decode",)]

    assert not install(gate, SimpleNamespace(), "decode")  # the stub engine has no hooks
    assert not install(gate, _Engine([]), "hybrid")


def test_a_waiting_decode_step_sleeps_until_the_prefill_lets_go_and_is_then_woken(tmp_path):
    """The wait is a blocking flock on a helper thread: the waiting step is woken by the
    release itself (no polling), and the helper's descriptor is its own."""
    path = str(tmp_path / "cpu.gate")
    prefill, decode = CpuGate(path), CpuGate(path)
    prefill.prefill_started([b"a"])
    t, passed = _decode_in_thread(decode)
    t.join(0.2)
    assert not passed.is_set()
    helpers = [th for th in threading.enumerate() if th.name == "tandem-cpu-gate"]
    assert len(helpers) == 1  # one waiter, asleep in the kernel
    prefill.prompt_done(b"a")
    t.join(5)
    assert passed.is_set() and decode.waits == 1 and decode.overrides == 0
    helpers[0].join(5)
    assert not helpers[0].is_alive()
    decode.before_decode_step()  # free again: straight through, no helper
    assert decode.waits == 1
    assert not [th for th in threading.enumerate() if th.name == "tandem-cpu-gate"]
    prefill.close()
    decode.close()


def test_after_an_override_the_next_step_waits_on_the_same_helper(tmp_path):
    path = str(tmp_path / "cpu.gate")
    prefill, decode = CpuGate(path), CpuGate(path, max_wait_s=0.05)
    prefill.prefill_started([b"long"])
    decode.before_decode_step()  # waits 50 ms, then runs alongside
    decode.before_decode_step()  # still held: waits again, on the helper already waiting
    assert decode.overrides == 2 and decode.waits == 2
    assert len([th for th in threading.enumerate() if th.name == "tandem-cpu-gate"]) == 1
    decode.close()  # closing the gate while its helper waits leaves the helper's own descriptor alone
    prefill.prompt_done(b"long")
    for th in [th for th in threading.enumerate() if th.name == "tandem-cpu-gate"]:
        th.join(5)
        assert not th.is_alive()
    other = CpuGate(path)
    other.before_decode_step()  # the file is free: nothing was left locked
    assert other.waits == 0
    prefill.close()
    other.close()
