"""`HOST:PORT`, the one address form of every option and link; IPv6 hosts go in brackets."""

from __future__ import annotations

import ipaddress
import os
from dataclasses import dataclass


@dataclass(frozen=True)
class Address:
    host: str  # without brackets, as sockets take it
    port: int

    @classmethod
    def parse(cls, text: str, *, port_zero: bool = False) -> Address:
        """`text` as an address; ValueError saying what is wrong and the expected form otherwise.

        Port 0 (any free port) is accepted only where something listens (`port_zero`).
        """
        value = text.strip()
        if value.startswith("["):
            host, bracket, rest = value[1:].partition("]")
            if not bracket:
                raise _refused(text, "the IPv6 address has no closing ]")
            if not _is_ipv6(host):
                raise _refused(text, f"{host!r} in brackets is not an IPv6 address")
            sep, port = rest[:1], rest[1:]
            if rest and sep != ":":
                raise _refused(text, f"{rest!r} after the ] is not :PORT")
        elif value.count(":") > 1:
            raise _refused(text, "an IPv6 address goes in brackets")
        else:
            host, sep, port = value.rpartition(":")
        if not sep or not port:
            raise _refused(text, "no port")
        if not host:
            raise _refused(text, "no host")
        if not port.isdigit():
            raise _refused(text, f"port {port!r} is not a number")
        lowest = 0 if port_zero else 1
        if not lowest <= int(port) <= 65535:
            raise _refused(text, f"port {int(port)} is outside {lowest}-65535")
        return cls(host, int(port))

    def __str__(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


def parse_address(text: str) -> tuple[str, int]:
    """Host and port of an address to connect to."""
    a = Address.parse(text)
    return a.host, a.port


def parse_listen(text: str) -> tuple[str, int]:
    """Host and port of an address to listen on; port 0 picks a free one."""
    a = Address.parse(text, port_zero=True)
    return a.host, a.port


def cannot_listen(host: str, port: int, what: str, e: OSError) -> OSError:
    """A bind failure as the operator reads it: the address, what it is for, and the errno's text."""
    reason = os.strerror(e.errno) if e.errno else str(e)
    shown = f"[{host}]" if _is_ipv6(host) else host
    return OSError(f"cannot listen on {shown}:{port} for {what}: {reason}; stop what uses it or choose another port")


def _is_ipv6(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).version == 6
    except ValueError:
        return False


def _refused(text: str, reason: str) -> ValueError:
    return ValueError(f"{text!r} is not an address: {reason} (expected HOST:PORT, e.g. 127.0.0.1:7601 or [::1]:7601)")
