"""What the edge needs from the cluster: the wire client's shape, as a protocol.

The app takes a :class:`Backend` in its constructor so unit tests can hand it an
in-process fake; in production each gunicorn worker builds one
:class:`tandem.wire.client.AsyncClient` after the fork (a ZeroMQ context must not
cross a fork).
"""

from __future__ import annotations

from typing import AsyncIterator, Protocol

from tandem.kvtypes import SamplingParams

try:
    from tandem.wire.client import Busy, InvalidRequest, StreamError, StreamEvent, Unavailable
except ImportError:  # pragma: no cover - only while the wire client is being written
    from dataclasses import dataclass

    class Busy(Exception):  # type: ignore[no-redef]
        def __init__(self, reason: str = "busy", retry_after_s: float = 1.0):
            super().__init__(reason)
            self.reason = reason
            self.retry_after_s = retry_after_s

    class Unavailable(Exception):  # type: ignore[no-redef]
        pass

    class StreamError(Exception):  # type: ignore[no-redef]
        pass

    class InvalidRequest(ValueError):  # type: ignore[no-redef]
        pass

    @dataclass
    class StreamEvent:  # type: ignore[no-redef]
        tokens: list
        logprobs: list | None = None
        finish_reason: str | None = None
        usage: object | None = None
        error: str | None = None


__all__ = ["Backend", "Busy", "InvalidRequest", "StreamError", "StreamEvent", "Unavailable", "make_backend"]


class Backend(Protocol):
    async def start(self) -> None: ...

    async def close(self) -> None: ...

    def generate(
        self,
        prompt_tokens: list[int],
        sampling: SamplingParams,
        *,
        priority: int = 0,
        request_id: bytes | None = None,
    ) -> AsyncIterator[StreamEvent]:
        """Stream one request's events. Raises Busy/Unavailable/InvalidRequest before
        the first event, StreamError after it."""
        ...

    async def abort(self, request_id: bytes) -> None: ...

    async def stats(self) -> dict: ...

    async def ready(self) -> dict: ...


def make_backend(config) -> Backend:
    """The production backend: a wire client to the configured broker."""
    from tandem.wire.client import AsyncClient
    from tandem.wire.secret import load_cluster_secret

    return AsyncClient(
        config.broker.frontend,
        config.broker.stream_out,
        secret=load_cluster_secret(config.security.cluster_secret_file),
        timeout_s=config.edge.broker_timeout_s,
    )
