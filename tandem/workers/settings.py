"""Settings owned by worker processes (section [worker])."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class WorkerSettings:
    role: str = field(default="hybrid", metadata={"choices": ("prefill", "decode", "hybrid"), "help": "what this worker does"})
    kv_bind: str = field(default="tcp://127.0.0.1:0", metadata={"help": "address a decode worker accepts KV handoffs on"})
    drain_grace_s: float = field(default=30.0, metadata={"min": 0, "help": "seconds SIGTERM waits for in-flight requests"})
