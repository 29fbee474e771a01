"""gunicorn's asgi worker with three changes, each about what a client sees.

A connection's first request must complete its headers within ``keepalive`` seconds, as
every later request on the connection already must. gunicorn 27's ASGI protocol arms its
idle timer only between requests, so a client that opened a connection and sent part of a
request line (or bytes that are not HTTP and no newline) held that connection, one of
``worker_connections``, for ever: the chaos run (bench/chaos.py) found the edge still
holding such connections after 200 s. Closing them is what a later request's keep-alive
timer does already.

A worker stops accepting the moment it is told to stop (SIGTERM), not at its next
once-a-second heartbeat; open requests still finish within ``graceful_timeout``. And a
worker dies with its arbiter (parent-death SIGKILL) instead of noticing the orphaning at
that heartbeat and draining. The listening socket is one socket shared by the arbiter and
its workers, and the kernel completes handshakes on it while any of them holds it: in the
up to one second (more on a loaded host) that a stopping or orphaned worker kept it open,
connections were accepted that no process would answer, and when the supervisor (or
systemd) killed the leftover process group, or the worker closed the socket, each was
reset: a client saw ECONNRESET instead of a refused connection it could retry at once
(found by bench/chaos.py after an edge SIGKILL). Now the socket closes with the last
process that serves it, so a connection is either answered or refused.
"""

from __future__ import annotations

import os
import signal

from gunicorn.asgi.protocol import ASGIProtocol
from gunicorn.workers import gasgi

from tandem._parent_death import parent_death_signal


class EdgeProtocol(ASGIProtocol):
    def connection_made(self, transport):
        super().connection_made(transport)
        # HTTP/1 only (h2c sniffing and TLS-negotiated HTTP/2 keep their own timers); the
        # connection loop cancels the timer once the request's headers are complete.
        if self._callback_parser is not None:
            self._arm_keepalive_timer()


class EdgeWorker(gasgi.ASGIWorker):
    def init_process(self):
        # The arbiter forks workers from its main thread, so this fires when the arbiter
        # dies; one that died before this call is caught by the parent check.
        parent_death_signal(signal.SIGKILL)
        if os.getppid() != self.ppid:
            os._exit(1)
        # The worker builds each connection's protocol through this module-level name.
        gasgi.ASGIProtocol = EdgeProtocol
        super().init_process()

    def handle_exit_signal(self):
        super().handle_exit_signal()
        # gunicorn closes the servers only when its heartbeat loop next looks (up to 1 s).
        for server in self.servers:
            server.close()
