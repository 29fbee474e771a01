"""bench/chaos.py's token-level check: a streamed (token, logprob) sequence against the
undisturbed run's, for both OpenAI logprobs shapes; and the ports its stack restarts on."""

import importlib.util
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench"
sys.path.insert(0, str(BENCH))  # chaos.py imports its neighbours (_common, chaos_stack)
_spec = importlib.util.spec_from_file_location("chaos", BENCH / "chaos.py")
chaos = sys.modules["chaos"] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(chaos)

REF = [[(b"a", -0.1), (b"b", -0.2), (b"c", -0.3)]]


def test_a_complete_answer_must_equal_the_reference_token_by_token():
    assert chaos.token_diff(REF, REF, complete=True)[0] == []
    problems, lost, dup, _ = chaos.token_diff([[(b"a", -0.1), (b"c", -0.3), (b"b", -0.2)]], REF, complete=True)
    assert problems and (lost, dup) == (2, 2)  # reordered
    problems, lost, dup, _ = chaos.token_diff([[(b"a", -0.1), (b"b", -0.2), (b"b", -0.2), (b"c", -0.3)]], REF, complete=True)
    assert problems and (lost, dup) == (1, 2)  # repeated
    problems, lost, dup, _ = chaos.token_diff([[(b"a", -0.1), (b"c", -0.3)]], REF, complete=True)
    assert problems and (lost, dup) == (2, 1)  # lost


def test_an_answer_that_ended_early_may_be_a_prefix_only_if_incomplete():
    assert chaos.token_diff([REF[0][:2]], REF, complete=False)[0] == []
    assert chaos.token_diff([REF[0][:2]], REF, complete=True)[0] != []


def test_logprobs_must_match_within_rounding():
    near = [[(b"a", -0.1 + 1e-5), (b"b", -0.2), (b"c", -0.3)]]
    problems, _, _, worst = chaos.token_diff(near, REF, complete=True)
    assert problems == [] and 0 < worst < chaos.LOGPROB_TOLERANCE
    far = [[(b"a", -0.1), (b"b", -0.9), (b"c", -0.3)]]
    assert "logprob" in chaos.token_diff(far, REF, complete=True)[0][0]


def test_both_logprobs_shapes_read_as_token_bytes():
    chat = {"content": [{"token": "é", "logprob": -1.0, "bytes": [195, 169], "top_logprobs": []},
                        {"token": "bytes:\\xe2", "logprob": -2.0, "bytes": [226], "top_logprobs": []}]}
    assert chaos._logprob_tokens(chat) == [("é".encode(), -1.0), (b"\xe2", -2.0)]
    completions = {"tokens": ["é", "bytes:\\xe2\\x80"], "token_logprobs": [-1.0, -2.0], "top_logprobs": [{}, {}], "text_offset": [0, 1]}
    assert chaos._logprob_tokens(completions) == [("é".encode(), -1.0), (b"\xe2\x80", -2.0)]
    assert chaos._logprob_tokens(None) == []


def test_rss_growth_is_net_of_the_kv_store_and_skips_unknown_sizes():
    from types import SimpleNamespace

    # prefill-0: RSS grows exactly as its KV store fills (a cache, not a leak);
    # edge-worker: no KV store, grows 40 MB; samples whose store size is unknown are skipped.
    fill = [(float(t), "prefill-0", 700.0 + 5 * t, 5.0 * t) for t in range(0, 100, 5)]
    fill.insert(10, (52.0, "prefill-0", 9999.0, None))
    leak = [(float(t), "edge-worker", 100.0 + 0.4 * t, 0.0) for t in range(0, 100, 5)]
    net, raw, rows = chaos.Run.rss_growth(SimpleNamespace(rss={1: fill, 2: leak}), warmup_s=10, min_span_s=30)
    by = {r["name"]: r for r in rows}
    assert by["prefill-0"]["growth_mb"] == 0.0 and by["prefill-0"]["raw_growth_mb"] == 375.0  # t 15 -> 90 (medians of three)
    assert by["edge-worker"]["growth_mb"] == by["edge-worker"]["raw_growth_mb"] == 30.0
    assert (net, raw) == (30.0, 375.0)


def test_stack_ports_are_free_distinct_and_outside_the_ephemeral_range():
    """A restarting process's port must not be one the kernel hands to other processes that
    bind port 0 (a request to the killed edge's port was once reset by such a process)."""
    import socket

    import chaos_stack

    low = chaos_stack._ephemeral_low()
    ports = [chaos_stack.free_port() for _ in range(20)]
    assert len(set(ports)) == len(ports) and all(20_000 <= p < low for p in ports)
    with socket.socket() as s:  # what another process binding port 0 gets
        s.bind(("127.0.0.1", 0))
        assert s.getsockname()[1] >= low
    for p in ports:
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))  # still free: free_port holds nothing
