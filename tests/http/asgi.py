"""A minimal ASGI client for unit tests: exact control over when the client disconnects.

falcon.testing's sync client disconnects as soon as a request starts, which cuts SSE
streams short; this one stays connected until told otherwise.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field


@dataclass
class Response:
    status: int = 0
    headers: dict[str, str] = field(default_factory=dict)
    chunks: list[bytes] = field(default_factory=list)

    @property
    def body(self) -> bytes:
        return b"".join(self.chunks)

    def json(self):
        return json.loads(self.body)

    def events(self) -> list[str]:
        """SSE data payloads in order (comments dropped)."""
        out = []
        for block in self.body.decode().split("\n\n"):
            data = [line[len("data: "):] for line in block.split("\n") if line.startswith("data: ")]
            if data:
                out.append("\n".join(data))
        return out

    def chunks_json(self) -> list[dict]:
        return [json.loads(e) for e in self.events() if e != "[DONE]"]


async def call(app, method: str, path: str, body=None, headers: dict | None = None,
               disconnect_after: int | None = None, raw: bytes | None = None) -> Response:
    """Run one request. ``disconnect_after``: drop the connection once that many body
    chunks have been received."""
    if raw is None:
        raw = b"" if body is None else json.dumps(body).encode()
    hdrs = [(b"host", b"test"), (b"content-length", str(len(raw)).encode())]
    if body is not None:
        hdrs.append((b"content-type", b"application/json"))
    for k, v in (headers or {}).items():
        hdrs.append((k.lower().encode(), v.encode()))
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method,
             "path": path, "raw_path": path.encode(), "query_string": b"", "headers": hdrs,
             "scheme": "http", "server": ("127.0.0.1", 8000), "client": ("127.0.0.1", 5000)}
    resp = Response()
    gone = asyncio.Event()
    sent_body = False

    async def receive():
        nonlocal sent_body
        if not sent_body:
            sent_body = True
            return {"type": "http.request", "body": raw, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message):
        if message["type"] == "http.response.start":
            resp.status = message["status"]
            resp.headers = {k.decode().lower(): v.decode() for k, v in message.get("headers", [])}
        elif message["type"] == "http.response.body":
            if gone.is_set():
                return  # ASGI: after a disconnect, send() is a no-op
            if message.get("body"):
                resp.chunks.append(message["body"])
            if disconnect_after is not None and len(resp.chunks) >= disconnect_after:
                gone.set()

    await app(scope, receive, send)
    gone.set()
    return resp
