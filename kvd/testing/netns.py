"""Several hosts on one machine: network namespaces on a bridge, for cluster tests.

    with Network(3) as net:
        net.hosts[0].address          # "10.<subnet>.0.11", inside namespace net.hosts[0].namespace
        net.hosts[0].wrap(["cmd"])    # ["ip", "netns", "exec", ns, "cmd"]
        net.cut(0) / net.heal(0)      # take host 0's link down / up

Each host is a namespace with its loopback up and one end of a veth pair
(`eth0`, 10.<subnet>.0.<11+i>/24); the other ends hang on a bridge in the
caller's namespace, which has .1 on the same subnet, so a server the test
runs outside (etcd) is reachable from every host and the test reaches the
hosts' listeners. Bytes between hosts cross real veth devices. Needs root
(CI runs as root); everything is removed on exit, and left-overs of a run
that was killed (its network named as this one, or holding its subnet) are
removed before a new one starts.
"""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass

PREFIX = "kvdt"


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


def _ip_quiet(*args: str) -> None:
    subprocess.run(["ip", *args], capture_output=True)


@dataclass(frozen=True)
class Host:
    namespace: str
    address: str
    host_veth: str

    def wrap(self, command: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.namespace, *command]


def _clear_stale(gateway: str, keep: str) -> None:
    """Remove another test network that holds `gateway` (one a killed run left behind: its bridge
    would route this network's subnet away from this one's bridge)."""
    listing = subprocess.run(["ip", "-o", "-4", "addr", "show"], capture_output=True, text=True).stdout
    for line in listing.splitlines():
        fields = line.split()
        device, address = fields[1], fields[3].split("/")[0]
        if address == gateway and device.startswith(PREFIX) and device != keep:
            tag = device.removesuffix("br")
            namespaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
            for name in (entry.split()[0] for entry in namespaces.splitlines() if entry.startswith(tag + "n")):
                _ip_quiet("netns", "del", name)
            _ip_quiet("link", "del", device)


class Network:
    def __init__(self, hosts: int, subnet: int | None = None) -> None:
        """`subnet`: the second octet (default: one from this process's id, so two test runs side by
        side use two subnets)."""
        self.tag = f"{PREFIX}{os.getpid() % 10000}"
        subnet = 64 + os.getpid() % 128 if subnet is None else subnet
        self.bridge = f"{self.tag}br"
        self.gateway = f"10.{subnet}.0.1"
        self.hosts = [Host(f"{self.tag}n{i}", f"10.{subnet}.0.{11 + i}", f"{self.tag}v{i}") for i in range(hosts)]

    def __enter__(self) -> Network:
        self.close()
        _clear_stale(self.gateway, self.bridge)
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("addr", "add", f"{self.gateway}/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        for host in self.hosts:
            _ip("netns", "add", host.namespace)
            _ip("link", "add", host.host_veth, "type", "veth", "peer", "name", "eth0", "netns", host.namespace)
            _ip("link", "set", host.host_veth, "master", self.bridge)
            _ip("link", "set", host.host_veth, "up")
            _ip("-n", host.namespace, "addr", "add", f"{host.address}/24", "dev", "eth0")
            _ip("-n", host.namespace, "link", "set", "eth0", "up")
            _ip("-n", host.namespace, "link", "set", "lo", "up")
        return self

    def cut(self, index: int) -> None:
        """Take the host's link down (inside its namespace): nothing in or out."""
        _ip("-n", self.hosts[index].namespace, "link", "set", "eth0", "down")

    def heal(self, index: int) -> None:
        _ip("-n", self.hosts[index].namespace, "link", "set", "eth0", "up")

    def close(self) -> None:
        for host in self.hosts:
            _ip_quiet("link", "del", host.host_veth)
            _ip_quiet("netns", "del", host.namespace)
        _ip_quiet("link", "del", self.bridge)

    def __exit__(self, *exc) -> None:
        self.close()
