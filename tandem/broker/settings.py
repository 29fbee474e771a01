"""Settings owned by the broker (section [broker])."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class BrokerSettings:
    frontend: str = field(default="tcp://127.0.0.1:5555", metadata={"help": "ROUTER address clients and the edge connect to"})
    backend: str = field(default="tcp://127.0.0.1:5556", metadata={"help": "ROUTER address workers connect to"})
    stream_in: str = field(default="tcp://127.0.0.1:5557", metadata={"help": "XSUB address workers publish tokens to"})
    stream_out: str = field(default="tcp://127.0.0.1:5558", metadata={"help": "XPUB address clients subscribe to"})
    stats: str = field(default="tcp://127.0.0.1:5559", metadata={"help": "stats socket address"})
    strategy: str = field(default="least_loaded", metadata={"choices": ("round_robin", "least_loaded", "memory_aware", "prompt_length_aware", "prefix_aware"), "help": "worker selection strategy"})
    max_queue: int = field(default=256, metadata={"min": 0, "help": "requests queued in the broker before BUSY"})
    heartbeat_interval_ms: int = field(default=1000, metadata={"min": 10, "help": "heartbeat period"})
    heartbeat_liveness: int = field(default=3, metadata={"min": 1, "help": "missed heartbeats before a worker is declared dead"})
