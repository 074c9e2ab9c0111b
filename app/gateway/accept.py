"""The gateway's event loop: uvloop, taking every waiting connection at once.

libuv (since 1.45, in uvloop since 0.18) accepts one connection per turn of
the loop and leaves the rest to the next turns. On a busy gateway a turn
takes 10-100 ms, so a burst of new connections waited in the kernel's queue
for seconds: 256 clients connecting together to a gateway at full load
waited up to 1.5 s for their first answer (bench/router_overhead.py's p99
at 256 connections, 0.5-1.2 s, while the gateway's own log timed each of
those requests at 90 ms at most, and its loop never ran more than 100 ms
late). nginx, Envoy and Rust's tokio take what is waiting in one go.

Here, whenever libuv hands over a connection, the rest of the listening
socket's queue is taken in the same turn (up to BATCH), each through
`connect_accepted_socket` with the server's own protocol factory and TLS
context. docs/design/hot-path.md, "Accepting connections", says why.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import ssl as ssl_module
from collections.abc import Callable
from typing import Any

import uvloop

logger = logging.getLogger(__name__)

# Connections taken per turn on top of libuv's one: the kernel's queue is
# 2,048 long (uvicorn's backlog); 128 a turn drains it in 16.
BATCH = 128


class _Drain:
    """Wraps a server's protocol factory: each connection libuv accepts
    schedules one sweep of the listening socket's queue."""

    def __init__(self, loop: asyncio.AbstractEventLoop, sock: socket.socket,
                 factory: Callable[[], asyncio.BaseProtocol],
                 ssl: ssl_module.SSLContext | None, handshake: float | None) -> None:
        self._loop, self._sock, self._factory = loop, sock, factory
        self._ssl, self._handshake = ssl, handshake
        self._scheduled = False
        self._warned = float("-inf")
        self._opening: set[asyncio.Task[None]] = set()
        self.taken = 0  # connections taken here, not by libuv (tests read it)

    def factory(self) -> asyncio.BaseProtocol:
        if not self._scheduled:
            self._scheduled = True
            self._loop.call_soon(self.sweep)
        return self._factory()

    def sweep(self) -> int:
        """Takes what waits in the queue, up to BATCH; returns how many."""
        self._scheduled = False
        taken = 0
        while taken < BATCH and self._sock.fileno() != -1:
            try:
                conn, _ = self._sock.accept()
            except (BlockingIOError, InterruptedError, ConnectionAbortedError):
                break
            except OSError as exc:  # out of descriptors, most likely: once a minute
                now = self._loop.time()
                if now - self._warned >= 60.0:
                    self._warned = now
                    logger.warning("accepting a connection failed: %s", exc)
                break
            conn.setblocking(False)
            taken += 1
            task = self._loop.create_task(self._serve(conn))
            self._opening.add(task)  # held until open: the loop keeps only a weak reference
            task.add_done_callback(self._opening.discard)
        self.taken += taken
        return taken

    async def _serve(self, conn: socket.socket) -> None:
        try:
            await self._loop.connect_accepted_socket(
                self._factory, conn, ssl=self._ssl,
                ssl_handshake_timeout=self._handshake if self._ssl is not None else None)
        except (OSError, ssl_module.SSLError, TimeoutError) as exc:
            # A client gone, or a failed TLS handshake: as libuv's own
            # accept path, nothing to answer.
            logger.debug("an accepted connection ended before it opened: %s", exc)
            conn.close()


def bound(host: str | None, port: int, reuse_port: bool = False) -> socket.socket:
    """A socket bound to host:port, not yet listening, as asyncio binds one
    (SO_REUSEADDR; an IPv6 one takes IPv4 too). `reuse_port`: shared by the
    workers of `llmgw serve --workers` (SO_REUSEPORT); OSError when the port
    is taken by a process that did not set it."""
    family, kind, proto, _, addr = socket.getaddrinfo(
        host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        sock.bind(addr)
    except OSError:
        sock.close()
        raise
    return sock


class Loop(uvloop.Loop):
    """uvloop whose TCP servers take every waiting connection in a turn
    (uvicorn: `loop="app.gateway.accept:Loop"`)."""

    def __init__(self) -> None:
        super().__init__()
        self.drains: list[_Drain] = []  # one per server (tests read them)

    async def create_server(  # type: ignore[override]  # uvicorn's call, not every overload
            self, protocol_factory: Callable[[], asyncio.BaseProtocol],
            host: str | None = None, port: int | None = None, *,
            sock: socket.socket | None = None, backlog: int = 100,
            ssl: ssl_module.SSLContext | None = None, ssl_handshake_timeout: float | None = None,
            **kwargs: Any) -> asyncio.AbstractServer:
        if sock is None:
            sock = bound(host, port or 0)
        drain = _Drain(self, sock, protocol_factory, ssl, ssl_handshake_timeout)
        self.drains.append(drain)
        return await super().create_server(
            drain.factory, sock=sock, backlog=backlog, ssl=ssl,
            ssl_handshake_timeout=ssl_handshake_timeout, **kwargs)
