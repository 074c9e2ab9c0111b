"""The limits on one request's life, and the watch that enforces them.

`Watch` ends a request's work by cancelling the task that serves it, for one
of six reasons (`Why`): the client went away, the request's deadline passed,
a stream's first byte did not come in time, a stream went silent, its
client stopped taking what it is sent, or the gateway's stop ran out of
grace (`cut()`). One
watch per request, armed once its body is read, with one timer handle.
How it hears the client leave depends on the server: `llmgw serve`'s calls
the watch back when the connection drops (`DirectBody.on_leave`), at no
cost to a request that keeps its client; under any other ASGI server a
listener task waits on `receive`, started only for a request still open
`LISTEN_AFTER` seconds after it arrived (the timer starts it): a task per
request was the largest single cost of a plain one (bench/README.md), and
at thousands of streams its task, coroutines, future and second timer were
a tenth of what each stream left for the collector to walk. A client that
left before either is heard at once (the server remembers the disconnect).
The per-chunk cost of a stream is four attribute writes (`read_since`,
`send_since`), not a timer per chunk.

Why a self-cancelling watch rather than `asyncio.wait({upstream,
disconnected})` as Starlette does: the work stays in the request's own task
(no second task per plain request), and the same mechanism serves the
timeouts. Cancelling the task closes the engine's connection wherever it
waits (connecting, waiting for headers, reading), which is how the engine
learns to stop (vLLM aborts a request whose connection closes).
"""

from __future__ import annotations

import asyncio
import enum
import math
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from typing import Any

from app.router.direct_body import DirectBody

Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]

# Seconds after its arrival before a request's client is listened to for a
# disconnect. What it costs: an engine may go on this long for a client that
# left (a plain request finishing sooner never gets a listener task).
LISTEN_AFTER = 0.25


@dataclass(frozen=True, slots=True)
class Timeouts:
    """Seconds; see app/gateway/settings/router.py for what each value costs."""

    connect: float = 5.0
    first_byte: float = 300.0
    idle: float = 60.0
    request: float = 600.0
    cooldown: float = 5.0
    # Scale from zero: how long a request for a model that is starting is
    # held, and how many such requests a model may have waiting here.
    cold_start: float = 300.0
    cold_start_held: int = 64
    # Spill-over: how long a request for a model with an overflow waits for
    # a replica on its way before it spills (app/router/spill.py).
    spill_hold: float = 10.0


def past_deadline(t: Timeouts) -> str:
    """What a client whose request ran out of its whole deadline is told."""
    return f"The request did not finish within {t.request:g} s."


class Why(enum.Enum):
    """Why a watch ended a request."""

    CLIENT_GONE = "client gone"
    DEADLINE = "deadline"
    FIRST_BYTE = "first byte"
    IDLE = "idle"
    CLIENT_STALLED = "client stalled"
    # The gateway is stopping and its grace period ran out (cli.py).
    SHUTDOWN = "shutdown"


class Watch:
    """Cancels the current task when its client leaves or a limit expires.

    The task catches the `CancelledError` and asks `caught()` why: a reason
    means the watch did it (the cancellation is then withdrawn, so the task
    can still answer), None means someone else did (server shutdown), and
    the error must propagate. `close()` disarms it before the final message
    of a response: an ASGI server's `receive` answers `http.disconnect` once
    the response is complete, which must not read as a client leaving.

    Streams: `expect_first_byte()` when a stream attempt starts; then the
    relay sets `read_since` to the loop's time before each upstream read and
    to 0.0 after it. A read pending longer than the limit (first byte, then
    idle) expires; time spent sending to a slow client does not count. Once
    streaming, the relay also sets `send_since` around each send to the
    client: a send pending for the idle limit (a client connected but
    reading nothing, its socket full) expires too.
    """

    __slots__ = ("_armed", "_deadline", "_due", "_first", "_limit", "_listen_at", "_listener",
                 "_loop", "_receive", "_task", "_timeouts", "_timer", "read_since", "send_since",
                 "why")

    def __init__(self, receive: Receive, timeouts: Timeouts, started: float,
                 loop: asyncio.AbstractEventLoop | None = None,
                 leaving: DirectBody | None = None) -> None:
        """`started`: the loop's time at the request's arrival; `loop`: the
        running loop, when the caller has it (Python 3.11 asks the kernel
        for the process id on each `get_running_loop()`: a system call);
        `leaving`: the server's own hook for the client's leaving, where it
        offers one (then `receive` is never listened to)."""
        self._loop = loop or asyncio.get_running_loop()
        task = asyncio.current_task(self._loop)
        assert task is not None, "a Watch runs inside the request's task"
        self._task = task
        self._timeouts = timeouts
        self._deadline = started + timeouts.request
        self._limit = 0.0  # the pending read's limit; 0: reads are not timed
        self._first = False  # the limit is the first byte's, not idle
        self.read_since = 0.0
        self.send_since = 0.0
        self.why: Why | None = None
        self._armed = True
        # Kept only to listen to: a server's hook holds the watch, and the
        # watch holding the server's request back would make a cycle.
        self._receive = receive if leaving is None else None
        self._listener: asyncio.Future[None] | None = None  # started by the timer
        # No listener ever where the server calls back.
        self._listen_at = started + LISTEN_AFTER if leaving is None else math.inf
        # When the armed timer rings (inf: none armed). A limit set later
        # moves it only earlier: one that rings early finds nothing due and
        # arms itself for what is. So it is first armed no later than a
        # stream's first byte and idle limits could fall due, and a stream
        # arms it once, not three times.
        self._due = min(self._deadline, self._listen_at,
                        started + min(timeouts.first_byte, timeouts.idle))
        self._timer = self._loop.call_at(self._due, self._check)
        if leaving is not None:
            leaving.on_leave(self._left_now)  # at once if the client already left

    def expect_first_byte(self) -> None:
        """A stream attempt starts: its first body byte is due within the limit."""
        self._limit = self._timeouts.first_byte
        self._first = True
        self.read_since = self._loop.time()
        self._schedule(self.read_since + self._limit)

    def streaming(self) -> None:
        """The first byte came: from now on no read may stay pending `idle` seconds."""
        self._limit = self._timeouts.idle
        self._first = False
        self.read_since = 0.0
        self._schedule(self._loop.time() + self._limit)

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        return self._loop

    def left(self) -> float:
        """Seconds until the request's deadline."""
        return self._deadline - self._loop.time()

    def caught(self) -> Why | None:
        """After a CancelledError: why the watch cancelled, or None if it did not."""
        if self.why is None:
            return None
        self._task.uncancel()
        self.close()
        return self.why

    def cut(self) -> None:
        """The gateway stops: the request ends as a timeout would end it (a
        stream with an error event), unless its answer is already complete."""
        self._fire(Why.SHUTDOWN)

    def close(self) -> None:
        if self._armed:
            self._armed = False
            self._timer.cancel()
            self._due = math.inf
            if self._listener is not None:
                self._listener.cancel()

    def _fire(self, why: Why) -> None:
        if self._armed and self.why is None:
            self.why = why
            self._timer.cancel()
            self._due = math.inf
            self._task.cancel()

    def _left_now(self) -> None:
        self._fire(Why.CLIENT_GONE)

    def _left(self, f: asyncio.Future[None]) -> None:
        if not f.cancelled():
            f.exception()  # retrieved: a failing receive also means the client is gone
            self._fire(Why.CLIENT_GONE)

    def _schedule(self, due: float) -> None:
        if self._listener is None:
            due = min(due, self._listen_at)
        due = min(due, self._deadline)
        if due >= self._due:
            return  # the armed timer rings first, and looks again
        self._timer.cancel()
        self._due = due
        self._timer = self._loop.call_at(due, self._check)

    def _listen(self) -> None:
        assert self._receive is not None  # a server's hook leaves no time to listen at
        self._listener = self._loop.create_task(_disconnect(self._receive))
        self._listener.add_done_callback(self._left)

    def _check(self) -> None:
        self._due = math.inf  # rung: none armed
        now = self._loop.time()
        if self._listener is None and self._armed and now >= self._listen_at:
            self._listen()
        if now >= self._deadline:
            self._fire(Why.DEADLINE)
        elif not self._limit:
            self._schedule(self._deadline)
        elif self.read_since and now - self.read_since >= self._limit:
            self._fire(Why.FIRST_BYTE if self._first else Why.IDLE)
        elif self.send_since and now - self.send_since >= self._limit:
            self._fire(Why.CLIENT_STALLED)
        else:  # a read or a send pending for less than its limit, or neither
            pending = [t for t in (self.read_since, self.send_since) if t]
            self._schedule(min(pending, default=now) + self._limit)


async def _disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
