"""Settings owned by the HTTP edge (section [edge])."""

from __future__ import annotations

import os
from dataclasses import dataclass, field


@dataclass
class EdgeSettings:
    bind: str = field(default="127.0.0.1:8000", metadata={"help": "host:port gunicorn listens on"})
    workers: int = field(default=0, metadata={"min": 0, "max": 256, "help": "gunicorn worker processes; 0 = one per 4 CPU cores, 1 to 4 (each streams its share of the clients on an event loop of its own: on a GPU host one loop held back 64 clients' streams)"})
    api_key_file: str | None = field(default=None, metadata={"help": "file with the API key clients must send as a Bearer token"})
    max_request_bytes: int = field(default=1 << 20, metadata={"min": 1024, "help": "largest accepted request body"})
    model_name: str | None = field(default=None, metadata={"help": "model id clients send and /v1/models lists; default: the model directory's name"})
    default_max_tokens: int = field(default=512, metadata={"min": 1, "help": "completion tokens when a request sets no max_tokens (capped by the context left)"})
    max_n: int = field(default=8, metadata={"min": 1, "max": 128, "help": "largest n (choices per request) accepted"})
    max_stop: int = field(default=8, metadata={"min": 0, "max": 64, "help": "most stop strings one request may set"})
    keepalive_s: float = field(default=2.0, metadata={"min": 0.05, "help": "idle seconds before an SSE keep-alive comment; how soon a vanished client is noticed"})
    request_timeout_s: float = field(default=600.0, metadata={"min": 1.0, "help": "longest a request may wait between two events from the cluster before it fails"})
    broker_timeout_s: float = field(default=10.0, metadata={"min": 0.1, "help": "how long the wire client waits for the broker to answer"})
    graceful_timeout_s: int = field(default=30, metadata={"min": 0, "help": "seconds a stopping worker lets open streams finish"})
    worker_connections: int = field(default=1000, metadata={"min": 1, "help": "open connections per gunicorn worker"})
    reasoning: str = field(default="auto", metadata={"help": "thinking markers whose text is returned as reasoning_content: "
                           "'auto' (<think> and </think> when both are tokens of the model's vocabulary), 'off', "
                           "or 'START,END'"})
    cors_origins: str = field(default="", metadata={"help": "browser origins allowed to call the API (CORS), comma-separated, "
                              "or '*' for any; empty: no CORS headers (browsers refuse cross-origin calls)"})
    expose_stats: bool = field(default=True, metadata={"help": "serve the broker's redacted stats at /v1/stats"})
    console: bool = field(default=True, metadata={"help": "serve the web console (chat playground, live cluster view) at /"})

    def worker_count(self) -> int:
        """``workers``, with 0 resolved for this machine: one per 4 CPU cores, 1 to 4."""
        if self.workers:
            return self.workers
        return max(1, min(4, (os.cpu_count() or 1) // 4))
