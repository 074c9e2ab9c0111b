"""uvicorn's keep-alive timeout under `llmgw serve`'s protocol
(app/gateway/http1.py): an idle kept-open connection is closed after
the timeout, a busy one never is, and its requests do not arm a timer each
(uvicorn armed one after every response and cancelled it at the next read).
A real uvicorn server in-process, raw sockets as clients."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

from app.gateway.http1 import protocol
from tests.support.inprocess_server import serving

KEEP_ALIVE = 0.4
GET = b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"
OK = b"HTTP/1.1 200 OK"


async def app(scope: Any, receive: Any, send: Any) -> None:
    if scope["type"] != "http":
        return
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"ok"})


class CountingLoop:
    """The running loop, counting the keep-alive timers armed through it."""

    armed = 0

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop

    def call_later(self, delay: float, callback: Any, *args: Any) -> asyncio.TimerHandle:
        if getattr(callback, "__name__", "") == "timeout_keep_alive_handler":
            CountingLoop.armed += 1
        return self._loop.call_later(delay, callback, *args)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loop, name)


base = protocol(30, 30)


def counted(**kwargs: Any) -> Any:
    """A connection's protocol, as uvicorn makes it, on a loop that counts."""
    made = base(**kwargs)
    made.loop = CountingLoop(made.loop)
    return made


@pytest.fixture
async def port() -> AsyncIterator[int]:
    async with serving(app, http=counted, timeout_keep_alive=KEEP_ALIVE) as served:
        CountingLoop.armed = 0
        yield served.port


async def answer(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> bytes:
    w.write(GET)
    head = await asyncio.wait_for(r.readuntil(b"\r\n\r\n"), 2)
    await asyncio.wait_for(r.readexactly(2), 2)
    return head


async def test_requests_back_to_back_arm_no_timer_each(port: int) -> None:
    loop = asyncio.get_running_loop()
    r, w = await asyncio.open_connection("127.0.0.1", port)
    started = loop.time()
    for _ in range(80):
        assert (await answer(r, w)).startswith(OK)
    took = loop.time() - started
    # One timer, armed again once per timeout's length at most (uvicorn's
    # own: one a request, 80).
    assert CountingLoop.armed <= took / KEEP_ALIVE + 2, (CountingLoop.armed, took)
    assert took / KEEP_ALIVE + 2 < 40  # else the count could not tell
    w.close()


async def test_a_busy_connection_outlives_the_timeout_and_an_idle_one_is_closed(
        port: int) -> None:
    loop = asyncio.get_running_loop()
    r, w = await asyncio.open_connection("127.0.0.1", port)
    started = loop.time()
    while True:  # a request every tenth of a second
        assert (await answer(r, w)).startswith(OK)
        idle = loop.time()
        if idle - started > 3 * KEEP_ALIVE:
            break
        await asyncio.sleep(0.1)
    assert await asyncio.wait_for(r.read(1), KEEP_ALIVE + 2) == b""  # closed by the gateway
    waited = loop.time() - idle
    assert KEEP_ALIVE - 0.05 <= waited < KEEP_ALIVE + 0.3, waited
    w.close()


async def test_a_connection_idle_between_two_requests_gets_the_whole_timeout(
        port: int) -> None:
    # Idle most of the timeout, a request, idle again: the timer armed for
    # the first idle spell must not close it early in the second.
    loop = asyncio.get_running_loop()
    r, w = await asyncio.open_connection("127.0.0.1", port)
    assert (await answer(r, w)).startswith(OK)
    await asyncio.sleep(KEEP_ALIVE * 0.75)
    assert (await answer(r, w)).startswith(OK)
    second = loop.time()
    assert await asyncio.wait_for(r.read(1), KEEP_ALIVE + 2) == b""
    assert loop.time() - second >= KEEP_ALIVE - 0.05
    w.close()
