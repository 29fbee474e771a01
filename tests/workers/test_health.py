"""The stall watch in a worker's heartbeats (tandem.workers.health), against a hand-driven
broker over real sockets."""

from __future__ import annotations

import logging
import os
import time

from tandem.kvtypes import SamplingParams
from tandem.wire import messages as M
from tests.stub_engine import StubEngine, reference_tokens

from .test_worker import FakeBroker, env  # noqa: F401  (env is the fixture)


def test_first_request_after_a_long_idle_spell_is_not_a_stall(env, caplog):  # noqa: F811
    broker, start = env
    # Each step takes 0.2 s, well inside the 0.5 s stall timeout; heartbeats every 50 ms
    # fall inside the first step. Idle for longer than the timeout first: an idle engine
    # takes no steps, and that silence must not count against the next request.
    w = start(StubEngine(step_s=0.2), stall_timeout_s=0.5)
    broker.recv(want=M.Ready)
    broker.wait_stream()
    time.sleep(0.8)
    rid = os.urandom(16)
    with caplog.at_level(logging.ERROR, logger="tandem.worker"):
        broker.send(M.Dispatch(rid, "hybrid", [5, 6], SamplingParams(max_tokens=3), attempt=1))
        got = broker.tokens(timeout=5.0)
    assert sum((m.tokens for _, m in got), []) == reference_tokens([5, 6], 3)
    assert not any("no progress" in r.getMessage() for r in caplog.records)
    assert not w.stalled
