#!/usr/bin/env python3
"""The least a proxy written in Python on uvloop does per chunk: what one
socket read brings, written to the other socket, both ways, nothing parsed.
A floor for bench/streams.py (its `relay` target): no HTTP, no key, no
feature, one upstream connection per client connection.

    python bench/tcp_relay.py PORT http://HOST:PORT
"""

from __future__ import annotations

import asyncio
import sys
from typing import cast
from urllib.parse import urlsplit

import uvloop


class _Side(asyncio.Protocol):
    """One of a pair of connections; what it reads goes to the other."""

    def __init__(self, upstream: tuple[str, int] | None, peer: _Side | None = None) -> None:
        self._upstream = upstream  # set on the client's side: where to connect
        self.peer = peer
        self.transport: asyncio.Transport | None = None
        self._early: list[bytes] = []  # what the client sent before the upstream answered

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's are no subclass
        if self._upstream is not None:
            asyncio.get_running_loop().create_task(self._connect(*self._upstream))

    async def _connect(self, host: str, port: int) -> None:
        loop = asyncio.get_running_loop()
        try:
            _, other = await loop.create_connection(lambda: _Side(None, self), host, port)
        except OSError:
            if self.transport is not None:
                self.transport.close()
            return
        self.peer = other
        for data in self._early:
            other.write(data)
        self._early.clear()

    def write(self, data: bytes) -> None:
        if self.transport is not None:
            self.transport.write(data)

    def data_received(self, data: bytes) -> None:
        if self.peer is None:
            self._early.append(data)
        else:
            self.peer.write(data)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.peer is not None and self.peer.transport is not None:
            self.peer.transport.close()


async def main(port: int, upstream: str) -> None:
    u = urlsplit(upstream)
    where = (u.hostname or "127.0.0.1", u.port or 80)
    server = await asyncio.get_running_loop().create_server(
        lambda: _Side(where), "127.0.0.1", port, backlog=4096)
    await server.serve_forever()


if __name__ == "__main__":
    uvloop.run(main(int(sys.argv[1]), sys.argv[2]))
