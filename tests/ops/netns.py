"""A small cluster of network namespaces joined through a bridge, for multi-host tests.

Each "host" is a namespace with its own loopback and one veth leg into a switch
namespace that holds a bridge. Addresses live only inside these namespaces; nothing
is routed to or from the machine's real network.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import uuid

SUBNET = "10.231.{}.{}"


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


def namespaces_available() -> str | None:
    """None if namespaces can be made here, else the reason they cannot."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    try:
        probe = f"tdm-probe-{uuid.uuid4().hex[:6]}"
        proc = _ip("netns", "add", probe, check=False)
        if proc.returncode != 0:
            return f"`ip netns add` failed: {proc.stderr.strip()}"
        _ip("netns", "del", probe, check=False)
    except FileNotFoundError:
        return "iproute2 (`ip`) is not installed"
    return None


class Cluster:
    def __init__(self, hosts: list[str], subnet_id: int = 77):
        self.tag = uuid.uuid4().hex[:4]
        self.switch = f"tdm-{self.tag}-sw"
        self.hosts = {name: f"tdm-{self.tag}-{name}" for name in hosts}
        self.address = {name: SUBNET.format(subnet_id, 10 + i) for i, name in enumerate(hosts)}
        self._made: list[str] = []

    def __enter__(self) -> "Cluster":
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _build(self) -> None:
        _ip("netns", "add", self.switch)
        self._made.append(self.switch)
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")
        for i, (name, ns) in enumerate(self.hosts.items()):
            _ip("netns", "add", ns)
            self._made.append(ns)
            _ip("-n", ns, "link", "set", "lo", "up")
            leg = f"s{i}-{self.tag}"
            # Create the pair inside the host namespace, then move the switch end.
            _ip("-n", ns, "link", "add", "eth0", "type", "veth", "peer", "name", leg)
            _ip("-n", ns, "link", "set", leg, "netns", self.switch)
            _ip("-n", self.switch, "link", "set", leg, "master", "br0")
            _ip("-n", self.switch, "link", "set", leg, "up")
            _ip("-n", ns, "addr", "add", f"{self.address[name]}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")

    def cut(self, name: str) -> None:
        """Unplug a host's cable: its processes live on but reach nobody."""
        _ip("-n", self.hosts[name], "link", "set", "eth0", "down")

    def plug(self, name: str) -> None:
        """Put back the cable :meth:`cut` pulled."""
        _ip("-n", self.hosts[name], "link", "set", "eth0", "up")

    def cut_route(self, a: str, b: str) -> None:
        """Drop every packet between hosts ``a`` and ``b`` (a blackhole route on each side),
        while each keeps its other links: a failed path between two hosts. Connections
        between them are not reset; they stall until restored or timed out."""
        _ip("-n", self.hosts[a], "route", "replace", "blackhole", f"{self.address[b]}/32")
        _ip("-n", self.hosts[b], "route", "replace", "blackhole", f"{self.address[a]}/32")

    def restore_route(self, a: str, b: str) -> None:
        _ip("-n", self.hosts[a], "route", "del", "blackhole", f"{self.address[b]}/32", check=False)
        _ip("-n", self.hosts[b], "route", "del", "blackhole", f"{self.address[a]}/32", check=False)

    def enter(self, name: str) -> None:
        """Move the calling thread (and the threads and processes it starts from now on)
        into host ``name``'s network namespace; ``ip netns exec`` still reaches the others."""
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        fd = os.open(f"/var/run/netns/{self.hosts[name]}", os.O_RDONLY)
        try:
            if libc.setns(fd, 0x40000000) != 0:  # CLONE_NEWNET
                raise OSError(ctypes.get_errno(), f"setns into {self.hosts[name]} failed")
        finally:
            os.close(fd)

    def popen(self, name: str, argv: list[str], **kwargs) -> subprocess.Popen:
        return subprocess.Popen(["ip", "netns", "exec", self.hosts[name], *argv], **kwargs)

    def run(self, name: str, argv: list[str], **kwargs) -> subprocess.CompletedProcess:
        return subprocess.run(["ip", "netns", "exec", self.hosts[name], *argv], **kwargs)

    def close(self) -> None:
        for ns in reversed(self._made):
            pids = _ip("netns", "pids", ns, check=False).stdout.split()
            for pid in pids:
                if pid == str(os.getpid()):
                    continue  # a process that entered a host itself (enter())
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    pass
            _ip("netns", "del", ns, check=False)
        self._made.clear()
