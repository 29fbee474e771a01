"""Settings owned by worker processes (section [worker])."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class WorkerSettings:
    role: str = field(default="hybrid", metadata={"choices": ("prefill", "decode", "hybrid"), "help": "what this worker does"})
    kv_bind: str = field(default="tcp://127.0.0.1:0", metadata={"help": "address a decode worker accepts KV handoffs on (port 0 = any free port)"})
    kv_advertise: str = field(default="", metadata={"help": "the KV address prefill workers on other hosts connect to (host or tcp://host:port) when kv_bind listens on every interface (0.0.0.0); empty = the address this host reaches the broker from"})
    drain_grace_s: float = field(default=30.0, metadata={"min": 0, "help": "seconds SIGTERM waits for in-flight requests"})
    name: str = field(default="", metadata={"help": "this worker's node id (default: role-host-pid)"})
    capacity: int = field(default=0, metadata={"min": 0, "help": "requests the broker may give this worker at once; 0 = engine parallel + queue depth"})
    transfer_timeout_s: float = field(default=10.0, metadata={"min": 0.05, "help": "a KV handoff not acknowledged this long after its last part, or (decode side) a partial transfer that heard nothing for this long, is abandoned and its KV released, on both sides (a transfer streamed while its prompt is prefilled is kept alive meanwhile)"})
    stall_timeout_s: float = field(default=30.0, metadata={"min": 0.1, "help": "stop heartbeating (so the broker moves our requests) if the engine makes no progress for this long while it has work"})
    cpu_gate: str = field(default="", metadata={"help": "a lock file shared by a prefill and a decode worker on the same cores: no decode step starts while a prefill runs (the hybrid scheduler's prefill-first); empty = off"})
    cpu_gate_max_wait_ms: int = field(default=10_000, metadata={"min": 1, "help": "cpu_gate: longest a decode step waits for prefills; then it runs alongside them (keep it under stall_timeout_s)"})
    omp_blocktime_ms: int = field(default=-1, metadata={"min": -1, "help": "how long MKL's OpenMP threads spin after a parallel region (KMP_BLOCKTIME); -1 = auto: 5 for a prefill or decode worker with cpu_gate (an idle thread spinning 200 ms held a core the other worker was just given), the runtime's own otherwise or when KMP_BLOCKTIME is set"})
    io_nice: int = field(default=-1, metadata={"min": -1, "max": 19, "help": "nice value of the worker's IO thread and ZeroMQ's threads (not a prefill worker's token stream: its engine thread publishes first tokens); -1 = auto: 19 for a prefill or decode worker with cpu_gate (KV sealing and copying run in the prefill's one-core gaps instead of preempting MKL), unchanged otherwise"})
    prefill_batch: int = field(default=0, metadata={"min": 0, "help": "prefill role: prompts prefilled together in one step (its first tokens wait for the whole step); 0 = engine.max_batch_prefill, as a hybrid worker batches"})
