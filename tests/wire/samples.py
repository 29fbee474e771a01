"""One fully populated instance of every wire message, for round-trip and fuzz tests."""

from __future__ import annotations

from tandem.kvtypes import SamplingParams, TokenLogprob, Usage
from tandem.wire import messages as M

RID = bytes(range(16))
RID2 = bytes(range(16, 32))
STREAM = bytes(range(100, 117))  # a client's stream topic
SAMPLING = SamplingParams(
    temperature=0.7, top_p=0.9, top_k=40, min_p=0.05, seed=(1 << 64) - 1, max_tokens=128,
    stop_token_ids=[2, 3], logit_bias={5: -100.0, 7: 2.5}, logprobs=5, ignore_eos=True,
    presence_penalty=-0.5, frequency_penalty=1.25, repetition_penalty=1.1,
    grammar='{"grammars": [{"json_schema": {"type": "object"}}]}',
)


def all_messages() -> list:
    return [
        M.Submit(RID, [1, 2, 3], SAMPLING, priority=-3, model="smollm2"),
        M.Submit(RID, [0], SamplingParams()),
        M.Submit(RID, [4, 5], SamplingParams(), stream=STREAM),
        M.Accepted(RID, queue_depth=7),
        M.Refused(RID, "busy", "queue full (1024 waiting)", 2.5),
        M.Abort(RID),
        M.Subscribed(RID),
        M.StatsRequest(verbose=True),
        M.StatsReply({"workers": [{"id": "w1", "load": 0.5}], "queue": 3, "x": None}),
        M.Disconnect("worker-1", "drained"),
        M.Ready("decode-1", "decode", "smollm2", 64, "tcp://127.0.0.1:5600", 16, 4096),
        M.Ready("prefill-1", "prefill", "m", 8),
        M.Heartbeat("decode-1", 3, 1, 100, 4096, [0, (1 << 64) - 1, 12345], [RID], 123.5, True),
        M.Dispatch(RID, "prefill", [5, 6], SAMPLING, 2, "m", "decode-1", "tcp://127.0.0.1:5600", 1),
        M.Dispatch(RID, "hybrid", [5], SamplingParams()),
        M.Resume(RID, [1, 2], [3, 4, 5], 2, SAMPLING, 0, "m", 2),
        M.Done(RID, "stop", Usage(10, 5, 4)),
        M.Done(RID, None, None, "decode-1"),
        M.Failed(RID, "out of memory", True),
        M.KVHeader(RID, "m", 16, 30, 3, 64, "float16", [1, 2, 3, 4], 3, 3, SAMPLING, 1, 0, 1,
                   "lz4", "int8", "streamed", 1, 5, 2, False),
        M.KVChunk(RID, 0, 0, 2, 0, 1, True, [b"k0", b"v0", b"k1", b"v1"]),
        M.KVAck(RID, True),
        M.KVRefuse(RID, "at_capacity", "no free blocks", 0.1),
    ]


def token_messages() -> list:
    return [
        M.TokenMessage(RID, 0, [1, 2, 3]),
        M.TokenMessage(RID, 7, [9], [TokenLogprob(9, -0.25, [(9, -0.25), (4, -3.0)])], "stop", Usage(3, 8, 0)),
        M.TokenMessage(RID, 8, [], None, "error", None, "decode worker lost; no migration left"),
    ]


def token_batches() -> list:
    """TOKEN_BATCHes: one of every token message above (under attempts 0-2), two requests
    interleaved, and an empty one (the broker's stream announcement)."""
    singles = token_messages()
    return [
        M.TokenBatch([(i, m) for i, m in enumerate(singles)]),
        M.TokenBatch([(1, M.TokenMessage(RID, 3, [7])), (5, M.TokenMessage(RID2, 0, [8, 9])),
                      (1, M.TokenMessage(RID, 4, [], None, "length", Usage(3, 2, 0)))]),
        M.TokenBatch([]),
    ]
