"""An emulated cluster on one Linux machine: one network namespace per node, veth links to a
bridge, every node's link shaped with ``tc`` in both directions (its NIC), byte counters read off
the kernel. Needs root (or CAP_NET_ADMIN) and iproute2; :func:`emulated_cluster` raises
:class:`NetemUnavailable` where namespaces cannot be made, so callers can fall back to loopback.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path


class NetemUnavailable(RuntimeError):
    pass


@dataclass(frozen=True)
class EmulatedNode:
    name: str  # the network namespace
    address: str  # its IP on the bridge
    host_veth: str  # the root-namespace end of its link (its counters are the node's traffic)

    def command(self, argv: list[str]) -> list[str]:
        """``argv`` run inside this node."""
        return ["ip", "netns", "exec", self.name, *argv]

    def bytes_sent(self) -> int:  # what left the node = what its host-side veth received
        return int(Path(f"/sys/class/net/{self.host_veth}/statistics/rx_bytes").read_text())

    def bytes_received(self) -> int:
        return int(Path(f"/sys/class/net/{self.host_veth}/statistics/tx_bytes").read_text())


def _ip(*args: str) -> None:
    done = subprocess.run(["ip", *args], capture_output=True, text=True)
    if done.returncode:
        raise NetemUnavailable(f"ip {' '.join(args)}: {done.stderr.strip()}")


def _shape(device: str, mbit: float, netns: str | None = None) -> None:
    prefix = ["ip", "netns", "exec", netns] if netns else []
    cmd = [*prefix, "tc", "qdisc", "replace", "dev", device, "root", "tbf", "rate", f"{mbit}mbit",
           "burst", "1mb", "latency", "100ms"]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        raise NetemUnavailable(f"{' '.join(cmd)}: {done.stderr.strip()}")


@contextlib.contextmanager
def emulated_cluster(nodes: int, link_mbit: float, prefix: str = "krl") -> Iterator[list[EmulatedNode]]:
    """``nodes`` namespaces on one bridge, each link shaped to ``link_mbit`` per direction; removed on exit."""
    if os.geteuid() != 0 or not shutil.which("ip") or not shutil.which("tc"):
        raise NetemUnavailable("network namespaces need root and iproute2 (ip, tc)")
    tag = f"{prefix}{os.getpid() % 10000}"
    bridge = f"{tag}br"
    made: list[EmulatedNode] = []
    try:
        _ip("link", "add", bridge, "type", "bridge")
        _ip("link", "set", bridge, "up")
        for i in range(nodes):
            node = EmulatedNode(f"{tag}n{i}", f"10.77.{i // 200}.{10 + i % 200}", f"{tag}v{i}")
            _ip("netns", "add", node.name)
            made.append(node)
            _ip("link", "add", node.host_veth, "type", "veth", "peer", "name", "eth0", "netns", node.name)
            _ip("link", "set", node.host_veth, "master", bridge, "up")
            _ip("-n", node.name, "addr", "add", f"{node.address}/16", "dev", "eth0")
            _ip("-n", node.name, "link", "set", "eth0", "up")
            _ip("-n", node.name, "link", "set", "lo", "up")
            _shape("eth0", link_mbit, node.name)  # node → bridge
            _shape(node.host_veth, link_mbit)  # bridge → node
        yield made
    finally:
        for node in made:
            subprocess.run(["ip", "link", "del", node.host_veth], capture_output=True)
            subprocess.run(["ip", "netns", "del", node.name], capture_output=True)
        subprocess.run(["ip", "link", "del", bridge], capture_output=True)
