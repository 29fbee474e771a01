"""bench/native_sampler.py: the stack sampler finds where a thread spends its time."""

import importlib.util
import os
import shutil
import sys
import threading
import time
import zlib
from pathlib import Path

import pytest

_path = Path(__file__).resolve().parents[1] / "bench" / "native_sampler.py"
_spec = importlib.util.spec_from_file_location("native_sampler", _path)
native_sampler = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(native_sampler)

needs_cc = pytest.mark.skipif(not sys.platform.startswith("linux") or not (shutil.which("cc") or shutil.which("gcc")),
                              reason="the sampler is built with the machine's C compiler (Linux)")


@needs_cc
def test_a_thread_in_zlib_is_seen_in_zlib_and_one_asleep_is_not(tmp_path):
    sampler = native_sampler.Sampler(native_sampler.build(tmp_path))
    stop = threading.Event()
    ids = {}

    def compress():
        ids["busy"] = threading.get_native_id()
        data = os.urandom(1 << 16)
        while not stop.is_set():
            zlib.compress(data, 9)

    def sleep():
        ids["idle"] = threading.get_native_id()
        stop.wait()

    threads = [threading.Thread(target=f, daemon=True) for f in (compress, sleep)]
    for t in threads:
        t.start()
    while len(ids) < 2:
        time.sleep(0.001)
    try:
        shares = {}
        for name in ("busy", "idle"):
            sampler.start(ids[name], interval_us=500)
            time.sleep(0.4)
            stacks = sampler.stop()
            assert len(stacks) > 100, name
            shares[name] = sum(any("zlib" in f or "libz" in f for f in s) for s in stacks) / len(stacks)
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert shares["busy"] > 0.8
    assert shares["idle"] < 0.05


@needs_cc
def test_a_closed_gate_keeps_no_samples_and_start_opens_it(tmp_path):
    sampler = native_sampler.Sampler(native_sampler.build(tmp_path))
    me = threading.get_native_id()
    data = os.urandom(1 << 16)
    counts = []
    for open_ in (False, True):
        sampler.start(me, interval_us=500)
        sampler.gate(open_)
        t_end = time.perf_counter() + 0.3
        while time.perf_counter() < t_end:
            zlib.compress(data, 6)
        counts.append(len(sampler.stop()))
    assert counts[0] == 0
    assert counts[1] > 100
    sampler.start(me, interval_us=500)  # a new start opens a gate left closed
    sampler.gate(False)
    sampler.stop()
    sampler.start(me, interval_us=500)
    t_end = time.perf_counter() + 0.2
    while time.perf_counter() < t_end:
        zlib.compress(data, 6)
    assert len(sampler.stop()) > 50


@needs_cc
def test_a_second_start_while_sampling_is_refused(tmp_path):
    sampler = native_sampler.Sampler(native_sampler.build(tmp_path))
    sampler.start(threading.get_native_id(), interval_us=1000)
    try:
        with pytest.raises(OSError, match="cannot sample thread"):
            sampler.start(threading.get_native_id())
    finally:
        sampler.stop()


def test_children_split_the_outermost_parent_frame():
    stacks = [("lib:leaf", "lib:encode", "lib:eval_impl", "py:main"),
              ("lib:eval_impl", "py:main"),
              ("lib:other", "lib:eval_impl", "lib:eval_impl", "py:main"),
              ("lib:elsewhere", "py:main")]
    split = native_sampler.children(stacks, "eval_impl")
    assert split == {"lib:encode": 1, "<self>": 1, "lib:eval_impl": 1}
    r = native_sampler.report(stacks, log=lambda *_: None, parents=("eval_impl",))
    assert r["samples"] == 4
    assert r["self"][0]["frame"] in {"lib:leaf", "lib:eval_impl", "lib:other", "lib:elsewhere"}
    assert {row["frame"]: row["share"] for row in r["inclusive"]}["py:main"] == 1.0


def test_shorten_drops_argument_lists_only():
    assert native_sampler._shorten("ns::f<int>(std::vector<int> const&) const") == "ns::f<int> const"
    assert native_sampler._shorten("plain") == "plain"
