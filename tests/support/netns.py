"""Separate network hosts on one machine: a network namespace per host, joined to the root namespace
by a veth pair, so a link can be cut and healed for real (`ip link set down/up`).

Each host gets a /30 of 10.213.0.0/16 that nothing in the root namespace uses: 10.213.N.1 on the
root side of its link, 10.213.N.2 inside. Those addresses exist only on the links made here. Every
name made here starts with `wsc` and carries the creating PID (in hex), so a later run removes what
a crashed run left behind without touching anything a live run, or anyone else, made.

While a link is down its connected route is gone, and packets for the host would take the default
route off the machine; an `unreachable` route per subnet (protocol 213, so it is known as ours)
makes them fail at once instead, as they would with no route at all.
"""

from __future__ import annotations

import fcntl
import ipaddress
import json
import os
import re
import shutil
import subprocess
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

PREFIX = "wsc"
POOL = ipaddress.ip_network("10.213.0.0/16")
_LOCK = Path("/tmp/walsidecar-netns.lock")  # serialises choosing subnets between concurrent runs
_NS_NAME = re.compile(rf"^{PREFIX}-([0-9a-f]+)-\d+-\d+$")
_LINK_NAME = re.compile(rf"^{PREFIX}([0-9a-f]+)g\d+[rs]\d+$")
_PROTO = "213"  # marks the unreachable routes made here
_groups = 0  # groups made by this process, to keep their names apart


class NetnsError(Exception):
    """An `ip` command failed; the message has its output."""


def ip(*args: str, check: bool = True) -> str:
    """Run `ip ARGS` and return its stdout."""
    out = subprocess.run(["ip", *args], capture_output=True, text=True, stdin=subprocess.DEVNULL, check=False)
    if check and out.returncode != 0:
        raise NetnsError(f"ip {' '.join(args)}: {out.stderr.strip() or f'exit status {out.returncode}'}")
    return out.stdout


def unavailable() -> str | None:
    """Why namespaces cannot be made here (not root, no iproute2), or None."""
    if shutil.which("ip") is None:
        return "the `ip` command (Debian package iproute2) is not installed"
    if os.geteuid() != 0:
        return "network namespaces need root"
    return None


def _alive(pid_hex: str) -> bool:
    try:
        os.kill(int(pid_hex, 16), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_leftovers() -> list[str]:
    """Delete namespaces and links of ours whose creating process is gone; returns their names."""
    removed = []
    for line in ip("netns", "list").splitlines():
        name = line.split()[0] if line.split() else ""
        m = _NS_NAME.match(name)
        if m and not _alive(m.group(1)):
            ip("netns", "delete", name, check=False)
            removed.append(name)
    for link in json.loads(ip("-j", "link", "show") or "[]"):
        name = link.get("ifname", "")
        m = _LINK_NAME.match(name)
        if m and not _alive(m.group(1)):
            ip("link", "delete", name, check=False)
            removed.append(name)
    ours = {str(ipaddress.ip_network(n, strict=False)) for n in _addresses()}
    for route in json.loads(ip("-j", "-4", "route", "show", "proto", _PROTO, "type", "unreachable") or "[]"):
        if route.get("dst") and route["dst"] not in ours:
            ip("route", "delete", "unreachable", route["dst"], "proto", _PROTO, check=False)
            removed.append(route["dst"])
    return removed


def _addresses() -> list[str]:
    """Every IPv4 address/prefix on a root-namespace interface (down ones included)."""
    return [f"{a['local']}/{a['prefixlen']}" for link in json.loads(ip("-j", "-4", "addr", "show") or "[]")
            for a in link.get("addr_info", [])]


def _used_networks() -> list[ipaddress.IPv4Network]:
    """Every IPv4 network the root namespace has an address in or a route to (the default route aside)."""
    used = [ipaddress.ip_network(a, strict=False) for a in _addresses()]
    for route in json.loads(ip("-j", "-4", "route", "show", "table", "all") or "[]"):
        dst = route.get("dst", "")
        if dst and dst != "default":
            try:
                net = ipaddress.ip_network(dst, strict=False)
            except ValueError:
                continue
            if net.prefixlen > 0 and net.version == 4:
                used.append(net)
    return used


def _free_subnets(count: int) -> list[ipaddress.IPv4Network]:
    used = _used_networks()
    free = []
    for third in range(1, 255):
        net = ipaddress.ip_network(f"10.213.{third}.0/30")
        if not any(net.overlaps(u) for u in used):
            free.append(net)
            if len(free) == count:
                return free
    raise NetnsError(f"no {count} free /30 subnets left in {POOL} (ip -4 route shows them in use)")


@dataclass(frozen=True)
class Host:
    """One namespace and its link to the root namespace."""

    index: int
    namespace: str
    root_if: str  # the veth end in the root namespace: cutting it cuts the link
    inner_if: str
    root_address: str
    address: str  # where this host listens, reachable from the root namespace only over its link

    def argv(self, argv: Sequence[str]) -> list[str]:
        """A command line that runs `argv` inside this host (ip netns exec execs it: same PID)."""
        return ["ip", "netns", "exec", self.namespace, *map(str, argv)]

    def cut(self) -> None:
        """Take the link down: packets in either direction stop at once."""
        ip("link", "set", self.root_if, "down")

    def heal(self) -> None:
        ip("link", "set", self.root_if, "up")

    @property
    def link_up(self) -> bool:
        return "UP" in json.loads(ip("-j", "link", "show", self.root_if))[0].get("flags", [])


class Hosts:
    """A group of hosts made together and deleted together (use as a context manager, or close())."""

    def __init__(self, count: int) -> None:
        global _groups
        _groups += 1
        self.hosts: list[Host] = []
        self._routes: list[ipaddress.IPv4Network] = []
        pid, group = f"{os.getpid():x}", _groups
        reason = unavailable()
        if reason:
            raise NetnsError(reason)
        remove_leftovers()
        try:
            with _locked():
                for i, net in enumerate(_free_subnets(count), start=1):
                    root_addr, addr = (str(a) for a in list(net.hosts())[:2])
                    host = Host(i, f"{PREFIX}-{pid}-{group}-{i}", f"{PREFIX}{pid}g{group}r{i}",
                                f"{PREFIX}{pid}g{group}s{i}", root_addr, addr)
                    self._create(host, net)
        except BaseException:
            self.close()
            raise

    def _create(self, h: Host, subnet: ipaddress.IPv4Network) -> None:
        prefixlen = subnet.prefixlen
        ip("route", "add", "unreachable", str(subnet), "metric", "4294967295", "proto", _PROTO)
        self._routes.append(subnet)
        ip("netns", "add", h.namespace)
        self.hosts.append(h)  # from here on close() deletes it
        ip("link", "add", h.root_if, "type", "veth", "peer", "name", h.inner_if, "netns", h.namespace)
        ip("addr", "add", f"{h.root_address}/{prefixlen}", "dev", h.root_if)
        ip("link", "set", h.root_if, "up")
        ip("-n", h.namespace, "addr", "add", f"{h.address}/{prefixlen}", "dev", h.inner_if)
        ip("-n", h.namespace, "link", "set", h.inner_if, "up")
        ip("-n", h.namespace, "link", "set", "lo", "up")

    def __getitem__(self, index: int) -> Host:
        """Host `index`, counted from 1."""
        return self.hosts[index - 1]

    def __iter__(self) -> Iterator[Host]:
        return iter(self.hosts)

    def close(self) -> None:
        """Delete every namespace (its end of the veth pair goes with it, taking the root end along)."""
        for h in self.hosts:
            ip("netns", "delete", h.namespace, check=False)
            ip("link", "delete", h.root_if, check=False)  # in case the namespace held no veth yet
        for subnet in self._routes:
            ip("route", "delete", "unreachable", str(subnet), "proto", _PROTO, check=False)
        self.hosts, self._routes = [], []

    def __enter__(self) -> Hosts:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@contextmanager
def _locked() -> Iterator[None]:
    with _LOCK.open("a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
