"""Settings owned by the HTTP edge (section [edge])."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class EdgeSettings:
    bind: str = field(default="127.0.0.1:8000", metadata={"help": "host:port gunicorn listens on"})
    workers: int = field(default=1, metadata={"min": 1, "max": 256, "help": "gunicorn worker processes"})
    api_key_file: str | None = field(default=None, metadata={"help": "file with the API key clients must send as a Bearer token"})
    max_request_bytes: int = field(default=1 << 20, metadata={"min": 1024, "help": "largest accepted request body"})
