"""Ports for the servers the tests start: one picker for every test.

A port picked by binding to 0 comes from the kernel's ephemeral range
(/proc/sys/net/ipv4/ip_local_port_range, 32768-60999 by default), and so does the local port of
every outgoing connection (the tests' health polls, vLLM's own internal sockets). Between the
pick and the server's bind, a connection can take that port, and the server fails late: NIXL's
side channel binds only after the engine has loaded, minutes later on a busy machine. So ports
are picked below the ephemeral range, where nothing is handed out by the kernel, and never twice
by one test process.
"""

from __future__ import annotations

import random
import socket

_BELOW_EPHEMERAL = range(20000, 32000)
_handed_out: set[int] = set()


def free_port() -> int:
    """A port free on 127.0.0.1 now, outside the ephemeral range, not handed out before."""
    for _ in range(1000):
        port = random.choice(_BELOW_EPHEMERAL)
        if port in _handed_out:
            continue
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    raise RuntimeError(f"no free port in {_BELOW_EPHEMERAL.start}-{_BELOW_EPHEMERAL.stop - 1}")


def free_ports(count: int) -> list[int]:
    return [free_port() for _ in range(count)]
