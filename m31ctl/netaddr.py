"""Addresses of the servers m31ctl starts: where this host reaches them, and whether a port is free."""

from __future__ import annotations

import ipaddress
import socket

# An all-interfaces bind is reached through loopback of the same family.
_ANY_TO_LOOPBACK = {"0.0.0.0": "127.0.0.1", "::": "::1"}


def _is_ipv6(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).version == 6
    except ValueError:
        return False


def local_url(bind: str, port: int) -> str:
    """Where this host reaches a server bound to `bind`; IPv6 literals are bracketed (RFC 3986)."""
    host = _ANY_TO_LOOPBACK.get(bind, bind)
    return f"http://[{host}]:{port}" if _is_ipv6(host) else f"http://{host}:{port}"


def port_free(bind: str, port: int) -> bool:
    """True when nothing listens on bind:port. The socket family follows the address, so an IPv6
    bind such as ::1 is tested on an IPv6 socket (an IPv4 socket cannot bind it at all)."""
    family = socket.AF_INET6 if _is_ipv6(bind) else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((bind, port))
        except OSError:
            return False
    return True
