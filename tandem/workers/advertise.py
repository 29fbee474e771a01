"""The KV address a decode worker advertises: one a prefill worker on another host can
reach. A wildcard bind (``tcp://0.0.0.0:5600``, what the systemd unit uses) is not such
an address: a peer connecting to 0.0.0.0 reaches itself. So a wildcard bind advertises
``worker.kv_advertise`` when set, else the local address this host uses to reach the
broker (the interface a peer on the broker's network reaches too); failing both, the
worker refuses to start and says what to set.
"""

from __future__ import annotations

import ipaddress
import socket

WILDCARDS = ("0.0.0.0", "*", "::", "[::]")


class AdvertiseError(ValueError):
    """No routable address to advertise; the message says what to set."""


def _split(endpoint: str) -> tuple[str, str]:
    """``tcp://host:port``, ``host:port`` or ``host`` -> (host, port or ""); IPv6 hosts
    lose their brackets."""
    rest = endpoint.split("://", 1)[-1]
    if rest.startswith("["):
        host, _, tail = rest[1:].partition("]")
        return host, tail[1:] if tail.startswith(":") else ""
    if rest.count(":") == 1:
        host, port = rest.split(":")
        return host, port
    return rest, ""


def _endpoint(host: str, port: str) -> str:
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


def route_source(peer: str) -> str:
    """The local address the kernel picks to reach ``peer`` (``tcp://host:port``); no
    packet is sent (a UDP socket's connect only chooses the route)."""
    host, port = _split(peer)
    info = socket.getaddrinfo(host, int(port or 9), type=socket.SOCK_DGRAM)[0]
    with socket.socket(info[0], socket.SOCK_DGRAM) as s:
        s.connect(info[4])
        return s.getsockname()[0]


def advertised(bound: str, explicit: str, broker: str) -> str:
    """What to put in READY for a KV socket bound at ``bound``."""
    host, port = _split(bound)
    if explicit:
        ehost, eport = _split(explicit)
        if ehost in WILDCARDS:
            raise AdvertiseError(f"worker.kv_advertise={explicit!r} is a wildcard; give an address other hosts can reach")
        return _endpoint(ehost, eport or port)
    if host not in WILDCARDS:
        return bound
    why = ""
    try:
        source = route_source(broker)
        if not ipaddress.ip_address(source).is_unspecified:
            return _endpoint(source, port)
    except (OSError, ValueError) as exc:
        why = f" ({exc})"
    raise AdvertiseError(
        f"--kv-bind {bound} listens on every interface, and no address that reaches the broker at {broker} "
        f"was found to advertise{why}; set worker.kv_advertise (or TANDEM_WORKER_KV_ADVERTISE) to this host's "
        "address on the cluster network")
