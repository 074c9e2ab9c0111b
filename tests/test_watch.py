"""The request's watch in-process (app/router/timeouts.py): a plain request
that ends within `LISTEN_AFTER` costs no listener task; one still open then
is listened to, and a client that left before is seen at once."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Iterator
from typing import Any

from app.router import timeouts
from app.router.timeouts import Timeouts, Watch, Why


@contextlib.contextmanager
def timers_armed(loop: asyncio.AbstractEventLoop) -> Iterator[list[float]]:
    """When each timer armed on `loop` meanwhile is due, in order."""
    armed: list[float] = []
    call_at = loop.call_at

    def counting(when: float, callback: Any, *args: Any, **kw: Any) -> asyncio.TimerHandle:
        armed.append(when)
        return call_at(when, callback, *args, **kw)

    loop.call_at = counting  # type: ignore[method-assign]
    try:
        yield armed
    finally:
        del loop.call_at  # type: ignore[method-assign]


async def held(make: Callable[[], Watch], first_byte: bool = False) -> Why | None:
    """A request's task while the engine holds it, its watch made by
    `make`: why the watch ended it (None: it did not)."""
    watch = make()
    if first_byte:
        watch.expect_first_byte()
    try:
        await asyncio.sleep(10)
    except asyncio.CancelledError:
        return watch.caught()
    return None


class Client:
    """An ASGI `receive`: the body was read; `leave` makes it answer disconnect.
    `asked` counts the calls (each one is a listener waiting)."""

    def __init__(self) -> None:
        self.leave = asyncio.Event()
        self.asked = 0

    async def receive(self) -> dict[str, Any]:
        self.asked += 1
        await self.leave.wait()
        return {"type": "http.disconnect"}


async def test_a_request_ending_before_listen_after_starts_no_listener_task() -> None:
    client = Client()
    loop = asyncio.get_running_loop()
    before = len(asyncio.all_tasks())
    watch = Watch(client.receive, Timeouts(), loop.time())
    await asyncio.sleep(0)
    assert len(asyncio.all_tasks()) == before  # no task per plain request
    watch.close()
    await asyncio.sleep(timeouts.LISTEN_AFTER + 0.05)
    assert client.asked == 0  # closed before the listener was due: never started


async def test_a_client_that_left_early_is_seen_once_the_listener_starts() -> None:
    client = Client()
    loop = asyncio.get_running_loop()

    started = loop.time()
    task = asyncio.ensure_future(held(lambda: Watch(client.receive, Timeouts(), loop.time())))
    client.leave.set()  # gone at once: the server remembers the disconnect
    assert await asyncio.wait_for(task, 2) is Why.CLIENT_GONE
    waited = loop.time() - started
    assert timeouts.LISTEN_AFTER - 0.01 <= waited < timeouts.LISTEN_AFTER + 0.5
    assert client.asked == 1


async def test_a_stream_waiting_for_its_first_byte_is_listened_to_after_listen_after() -> None:
    # expect_first_byte reschedules the timer (300 s): the listener's start
    # must not move with it.
    client = Client()
    loop = asyncio.get_running_loop()

    task = asyncio.ensure_future(
        held(lambda: Watch(client.receive, Timeouts(), loop.time()), first_byte=True))
    await asyncio.sleep(timeouts.LISTEN_AFTER + 0.1)
    assert client.asked == 1  # listening now
    client.leave.set()
    assert await asyncio.wait_for(task, 1) is Why.CLIENT_GONE


async def test_a_streams_limits_arm_no_timer_while_one_rings_first() -> None:
    # A stream's first-byte and idle limits come after the listener's
    # start: the timer armed at arrival serves; none is armed or cancelled
    # for them. A limit shorter than the listener's wait is what the timer
    # is armed for at arrival.
    loop = asyncio.get_running_loop()
    with timers_armed(loop) as armed:
        started = loop.time()
        watch = Watch(Client().receive, Timeouts(), started)
        watch.expect_first_byte()
        watch.streaming()
        assert armed == [started + timeouts.LISTEN_AFTER]
        short = Watch(Client().receive, Timeouts(first_byte=0.05), started)
        short.expect_first_byte()
        assert armed[1:] == [started + 0.05]
        watch.close()
        short.close()


class ServerHook:
    """A server's hook for its client's leaving (`DirectBody.on_leave`), as
    `llmgw serve`'s connection offers it (tests/test_direct_body.py runs
    the real one): it calls back once, at once if the client has left."""

    def __init__(self, gone: bool = False) -> None:
        self.gone = gone
        self.hook: Any = None

    def on_leave(self, callback: Any) -> None:
        if self.gone:
            callback()
        else:
            self.hook = callback

    def leave(self) -> None:
        self.gone = True
        hook, self.hook = self.hook, None
        if hook is not None:
            hook()


async def test_a_watch_told_by_its_server_hears_a_leaving_at_once_with_no_task() -> None:
    client, server = Client(), ServerHook()
    loop = asyncio.get_running_loop()
    before = len(asyncio.all_tasks())

    task = asyncio.ensure_future(
        held(lambda: Watch(client.receive, Timeouts(), loop.time(), loop, server), first_byte=True))
    await asyncio.sleep(timeouts.LISTEN_AFTER + 0.1)
    assert len(asyncio.all_tasks()) == before + 1  # the request's own, and no listener
    assert client.asked == 0
    started = loop.time()
    server.leave()
    assert await asyncio.wait_for(task, 1) is Why.CLIENT_GONE
    assert loop.time() - started < 0.05  # not at a timer's ring


async def test_a_watch_whose_client_already_left_is_told_at_once() -> None:
    loop = asyncio.get_running_loop()

    gone = ServerHook(gone=True)
    why = held(lambda: Watch(Client().receive, Timeouts(), loop.time(), loop, gone))
    assert await asyncio.wait_for(why, 0.1) is Why.CLIENT_GONE


async def test_a_stream_told_by_its_server_arms_one_timer_for_its_limits() -> None:
    # No listener to start: the one timer is armed at arrival for the
    # soonest a stream's limit could fall due, and its first-byte and idle
    # limits arm none; a closed watch is deaf to a later leaving.
    loop = asyncio.get_running_loop()
    with timers_armed(loop) as armed:
        started, server, t = loop.time(), ServerHook(), Timeouts(first_byte=30, idle=20)
        watch = Watch(Client().receive, t, started, loop, server)
        watch.expect_first_byte()
        watch.streaming()
        assert armed == [started + 20]
        watch.close()
        server.leave()
        assert watch.why is None
