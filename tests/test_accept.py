"""The gateway's loop takes a burst of waiting connections in a turn or two
(app/gateway/accept.py), where libuv takes one a turn: at full load, a
turn is 10-100 ms, and a burst of 256 new clients waited seconds. Real
sockets on loopback, a loop kept busy by a callback each turn; TLS too."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import ssl
import time
from collections.abc import Callable

import pytest
import trustme
import uvloop

from app.gateway.accept import BATCH, Loop


class Counting(asyncio.Protocol):
    def __init__(self, made: list[int], turns: Callable[[], int], n: int,
                 all_made: asyncio.Event) -> None:
        self.made, self.turns, self.n, self.all_made = made, turns, n, all_made

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.made.append(self.turns())
        if len(self.made) == self.n:
            self.all_made.set()


async def burst(n: int, tls: tuple[ssl.SSLContext, ssl.SSLContext] | None = None) -> list[int]:
    """The turn at which each of `n` connections, all waiting in the queue
    before the loop looks, was made; the loop busy 1 ms a turn."""
    loop = asyncio.get_running_loop()
    made: list[int] = []
    turns = 0
    all_made = asyncio.Event()

    def busy() -> None:
        nonlocal turns
        turns += 1
        time.sleep(0.001)  # a turn's work on a loaded gateway, scaled down
        if len(made) < n:
            loop.call_soon(busy)

    server = await loop.create_server(lambda: Counting(made, lambda: turns, n, all_made),
                                      "127.0.0.1", 0, backlog=1024,
                                      ssl=tls[0] if tls else None)
    port = server.sockets[0].getsockname()[1]
    # Connected by the kernel, before the loop runs again: all in the queue.
    clients = [socket.create_connection(("127.0.0.1", port)) for _ in range(n)]
    try:
        loop.call_soon(busy)
        if tls:  # handshakes, in threads: the server's side needs the loop
            def handshake(s: socket.socket) -> str | None:
                s.settimeout(10)
                return tls[1].wrap_socket(s, server_hostname="localhost").version()
            said = await asyncio.wait_for(asyncio.gather(*(
                asyncio.to_thread(handshake, s) for s in clients)), 20)
            assert all(v and v.startswith("TLS") for v in said), said
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(all_made.wait(), 20)
        assert len(made) == n, f"{len(made)} of {n} connections made"
        return made
    finally:
        for s in clients:
            s.close()
        server.close()
        await server.wait_closed()


def test_libuv_alone_takes_one_connection_a_turn() -> None:
    """Why accept.py exists: if this fails, uvloop takes bursts itself."""
    made = uvloop.run(burst(60))
    assert max(made) >= 50, made


def test_a_burst_of_waiting_connections_is_taken_in_a_few_turns() -> None:
    with asyncio.Runner(loop_factory=Loop) as runner:
        made = runner.run(burst(200))
        # Beyond BATCH, a second sweep: two libuv turns and their sweeps.
        assert max(made) <= 6, made
        (drain,) = runner.get_loop().drains
        assert drain.taken >= 200 - 4 and BATCH < 200


@pytest.fixture(scope="module")
def tls() -> tuple[ssl.SSLContext, ssl.SSLContext]:
    ca = trustme.CA()
    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ca.issue_cert("localhost").configure_cert(server)
    client = ssl.create_default_context()
    ca.configure_trust(client)
    return server, client


def test_tls_connections_taken_in_a_sweep_complete_their_handshake(
        tls: tuple[ssl.SSLContext, ssl.SSLContext]) -> None:
    with asyncio.Runner(loop_factory=Loop) as runner:
        runner.run(burst(40, tls))
        (drain,) = runner.get_loop().drains
        assert drain.taken >= 30


def test_a_closed_server_takes_nothing_more() -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        server = await loop.create_server(asyncio.Protocol, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        (drain,) = loop.drains  # type: ignore[attr-defined]
        server.close()
        await server.wait_closed()
        assert drain.sweep() == 0  # the listening socket is closed: no accept on it
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 1):
            pytest.fail("still listening after close")

    with asyncio.Runner(loop_factory=Loop) as runner:
        runner.run(main())


def test_out_of_descriptors_is_said_once_a_minute(caplog: pytest.LogCaptureFixture) -> None:
    import resource

    async def main() -> None:
        loop = asyncio.get_running_loop()
        server = await loop.create_server(asyncio.Protocol, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        (drain,) = loop.drains  # type: ignore[attr-defined]
        clients = [socket.create_connection(("127.0.0.1", port)) for _ in range(3)]
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        # No descriptor left for accept() (the lowest free one is past the
        # limit): the connections stay queued.
        lowest = os.dup(0)
        os.close(lowest)
        resource.setrlimit(resource.RLIMIT_NOFILE, (lowest, hard))
        try:
            assert drain.sweep() == 0
            assert drain.sweep() == 0
        finally:
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        assert drain.sweep() == 3  # descriptors back: all three taken
        for c in clients:
            c.close()
        server.close()
        await server.wait_closed()

    with asyncio.Runner(loop_factory=Loop) as runner:
        runner.run(main())
    said = [r for r in caplog.records if "accepting a connection failed" in r.getMessage()]
    assert len(said) == 1, said
