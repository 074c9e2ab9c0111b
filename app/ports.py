"""A free TCP port for a process that binds it later: an engine the agent
starts, and every server the tests and benchmarks start.

A port the kernel picks (a bind to port 0) comes from its ephemeral range,
the range it also draws every outgoing connection's local port from. Between
the pick and the process's own bind, any connection made on the machine may
take that port, and the process then fails with "Address already in use"
(a test's third gateway did, while the first two connected to etcd). A port
below that range is given to no connection: only a process binding it by
number can take it. So the port is drawn at random below the range, and
checked free by a bind; the kernel's pick is the fallback where the range
leaves no room below it.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_LOWEST = 10000  # below: ports well-known services are configured on
_TRIES = 64


def ephemeral_range(path: Path = _RANGE) -> tuple[int, int]:
    """The kernel's range of ports for outgoing connections (Linux's
    default where it cannot be read)."""
    try:
        low, high = (int(part) for part in path.read_text().split()[:2])
    except (OSError, ValueError):
        return 32768, 60999
    return low, high


def free_port(host: str = "127.0.0.1", path: Path = _RANGE) -> int:
    """A port of `host` free now, outside the ephemeral range where it can."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    low, _ = ephemeral_range(path)
    if low - _LOWEST >= 1000:
        for _ in range(_TRIES):
            port = random.randrange(_LOWEST, low)
            with socket.socket(family, socket.SOCK_STREAM) as sock:
                try:
                    sock.bind((host, port))
                except OSError:
                    continue  # taken: another draw
                return port
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])
