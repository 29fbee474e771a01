"""Settings owned by the broker (section [broker])."""

from __future__ import annotations

from dataclasses import dataclass, field

STRATEGIES = ("round_robin", "least_loaded", "memory_aware", "prompt_length_aware", "prefix_aware")


@dataclass
class BrokerSettings:
    frontend: str = field(default="tcp://127.0.0.1:5555", metadata={"help": "ROUTER address clients and the edge connect to"})
    backend: str = field(default="tcp://127.0.0.1:5556", metadata={"help": "ROUTER address workers connect to"})
    stream_in: str = field(default="tcp://127.0.0.1:5557", metadata={"help": "XSUB address workers publish tokens to"})
    stream_out: str = field(default="tcp://127.0.0.1:5558", metadata={"help": "XPUB address clients subscribe to"})
    stats: str = field(default="tcp://127.0.0.1:5559", metadata={"help": "stats socket address"})
    strategy: str = field(default="least_loaded", metadata={"choices": STRATEGIES, "help": "worker selection strategy"})
    max_queue: int = field(default=256, metadata={"min": 0, "help": "requests queued in the broker before BUSY"})
    heartbeat_interval_ms: int = field(default=1000, metadata={"min": 10, "help": "heartbeat period"})
    heartbeat_liveness: int = field(default=3, metadata={"min": 1, "help": "missed heartbeats before a worker is declared dead"})
    queue_timeout_s: float = field(default=30.0, metadata={"min": 0.01, "help": "seconds a request may wait in the broker queue for a worker before BUSY"})
    subscribe_timeout_s: float = field(default=5.0, metadata={"min": 0.01, "help": "seconds to wait for a client's stream subscription before refusing the request"})
    retry_after_s: float = field(default=1.0, metadata={"min": 0.0, "help": "Retry-After the broker suggests with BUSY"})
    failover_wait_s: float = field(default=30.0, metadata={"min": 0.0, "help": "seconds a request whose worker failed waits for a worker that can continue it (say, the one its supervisor restarts) before its stream ends with an error (never less than queue_timeout_s); new requests are still refused at once when no worker is up"})
    max_migrations: int = field(default=2, metadata={"min": 0, "help": "times one request may move to another worker after its worker failed"})
    prefix_load_guard: float = field(default=2.0, metadata={"min": 1.0, "help": "prefix_aware never picks a worker whose load exceeds guard x (lowest load + 1)"})
    long_prompt_tokens: int = field(default=512, metadata={"min": 1, "help": "prompt_length_aware: prompts at least this long count as long"})
    decode_allowlist: list[str] = field(default_factory=list, metadata={"help": "decode worker names or KV addresses the broker may choose; empty = any"})
    reprobe_interval_ms: int = field(default=250, metadata={"min": 1, "help": "at most one re-probe of unreachable workers per this many ms"})
    reprobe_timeout_ms: int = field(default=500, metadata={"min": 1, "help": "how long a re-probe waits for an answer"})
    log_stats_interval_s: float = field(default=10.0, metadata={"min": 0.0, "help": "log the cluster's prompt and generation throughput, requests and KV use every this many seconds while there is work; 0 = never"})
    stats_verbose: bool = field(default=False, metadata={"help": "show worker addresses in stats instead of redacted node ids"})
    max_prompt_tokens: int = field(default=131_072, metadata={"min": 1, "max": 131_072, "help": "longest prompt the broker admits (the protocol's own bound is 131072)"})
