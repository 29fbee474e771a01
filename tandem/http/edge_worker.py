"""gunicorn's asgi worker with one change: a connection's first request must complete its
headers within ``keepalive`` seconds, as every later request on the connection already must.

gunicorn 27's ASGI protocol arms its idle timer only between requests, so a client that
opened a connection and sent part of a request line (or bytes that are not HTTP and no
newline) held that connection, one of ``worker_connections``, for ever: the chaos run
(bench/chaos.py) found the edge still holding such connections after 200 s. Closing
them is what a later request's keep-alive timer does already.
"""

from __future__ import annotations

from gunicorn.asgi.protocol import ASGIProtocol
from gunicorn.workers import gasgi


class EdgeProtocol(ASGIProtocol):
    def connection_made(self, transport):
        super().connection_made(transport)
        # HTTP/1 only (h2c sniffing and TLS-negotiated HTTP/2 keep their own timers); the
        # connection loop cancels the timer once the request's headers are complete.
        if self._callback_parser is not None:
            self._arm_keepalive_timer()


class EdgeWorker(gasgi.ASGIWorker):
    def init_process(self):
        # The worker builds each connection's protocol through this module-level name.
        gasgi.ASGIProtocol = EdgeProtocol
        super().init_process()
