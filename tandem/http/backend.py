"""What the edge needs from the cluster: the wire client's shape, as a protocol.

The app takes a :class:`Backend` in its constructor so unit tests can hand it an
in-process fake; in production each gunicorn worker builds one
:class:`tandem.wire.client.AsyncClient` after the fork (a ZeroMQ context must not
cross a fork).
"""

from __future__ import annotations

from typing import AsyncIterator, Protocol

from tandem.kvtypes import SamplingParams
from tandem.wire.client import Busy, InvalidRequest, StreamError, StreamEvent, Unavailable

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
