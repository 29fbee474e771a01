"""The one error type every wire decoder raises on bad input."""

from __future__ import annotations


class WireError(ValueError):
    """Bytes from the network that this process will not accept.

    Decoders raise only this (or a subclass) for anything a peer sends, so a caller
    needs one ``except WireError`` to drop a bad message or connection without
    crashing. ``reason`` is a short stable code for counters and logs.
    """

    def __init__(self, message: str, reason: str = "malformed"):
        super().__init__(message)
        self.reason = reason


class AuthError(WireError):
    """The cluster handshake or a sealed frame failed authentication: drop the connection."""

    def __init__(self, message: str, reason: str = "auth"):
        super().__init__(message, reason)
