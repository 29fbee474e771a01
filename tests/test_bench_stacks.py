"""bench/stacks.py: per-thread shares from py-spy's raw collapsed stacks."""

import importlib.util
from pathlib import Path

_spec = importlib.util.spec_from_file_location("stacks", Path(__file__).resolve().parents[1] / "bench" / "stacks.py")
stacks = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(stacks)


def test_threads_are_summarized_by_self_and_inclusive_share():
    lines = [
        "thread (1): engine;run (e.py:1);step (e.py:9);decode (k.py:3) 60\n",
        "thread (1): engine;run (e.py:1);step (e.py:9);sample (s.py:2) 20\n",
        "thread (1): engine;run (e.py:1);idle (e.py:4) 20\n",
        "thread (2): io;poll (z.py:7) 1\n",  # under 2% of all samples: left out
        "garbage line\n",
    ]
    text = stacks.summarize(lines, top=3)
    assert "thread (1): engine: 100 samples (99%)" in text
    assert "thread (2)" not in text
    self_part, stack_part = text.split("on the stack:")
    assert " 60.0%  decode (k.py:3)" in self_part and " 20.0%  sample (s.py:2)" in self_part
    assert "100.0%  run (e.py:1)" in stack_part and " 80.0%  step (e.py:9)" in stack_part
