"""A request as one worker holds it: which dispatch attempt, where its stream stands,
and (prefill) where its KV goes."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Local:
    request_id: bytes
    attempt: int
    seq: int  # next stream sequence number this worker publishes
    mode: str  # prefill | run (to the end here)
    prompt_len: int
    priority: int = 0
    decode_node: str | None = None
    decode_address: str | None = None
    handing_off: bool = False
    strategy: str | None = None  # prefill: the handoff's, when chosen at dispatch
    stream_kv: bool = False  # prefill: the KV streams to the decode worker during the prefill
    kv_failed: str | None = None  # stream_kv: why the transfer failed before the first token was out
    receiving: bool = False  # decode: a place held for KV still arriving (the engine has no request yet)
    kv_peer: bytes | None = None  # decode: the KV connection it arrives on
