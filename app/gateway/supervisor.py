"""What runs in a gateway's background, and the order it starts and stops in
(docs/architecture.md, "Processes"; docs/design/stopping.md).

A `Supervisor` holds a list of named services, each with a `start`, a
`stop`, a `run` loop (a task from its start to its stop), or several of
them. It starts them in list order and stops them in reverse: a service
stops before any it depends on. The tasks of services stopped one after
the other (loops, and the follow-ups that routes spawn) are cancelled
together and waited for once, for a bounded time (stopping.py, `ended`):
a task that ignores its cancel is named in the log, never waited on for
good. A loop that dies, or returns, is logged when it does (`_said`). A service's own
`stop` runs once every task stopped before it has ended.

`Leadership` is the loops that run only while this gateway leads: started
and stopped by the elector's callbacks, as client-go's leaderelection's
`OnStartedLeading`/`OnStoppedLeading` (app/control/leader.py).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any

from app.gateway.stopping import ended

Loop = Callable[[], Coroutine[Any, Any, None]]

logger = logging.getLogger(__name__)


def _said(task: asyncio.Task[None]) -> None:
    """A background task ended other than by its cancel: said when it
    happens, not first found at the stop. One that died is an error: the
    gateway goes on without it (its routes answer, what it kept fresh goes
    stale). One that returned did its work (the gc-freeze, once)."""
    if task.cancelled():
        return
    exc = task.exception()
    if exc is not None:
        logger.error("background task %s died: %s", task.get_name(), exc, exc_info=exc)
    else:
        logger.info("background task %s ended", task.get_name())


@dataclass(frozen=True)
class Service:
    """One thing the supervisor starts and stops. `start` is awaited, then
    `run` becomes a task named `name`; at the stop the task is cancelled,
    then `stop` is awaited."""

    name: str
    start: Callable[[], Awaitable[None]] | None = None
    run: Loop | None = None
    stop: Callable[[], Awaitable[None]] | None = None
    # Run only by the process that serves the app (its lifespan), not by
    # a gateway a test starts on its own.
    serving: bool = False


FOLLOW_UPS = "follow-ups"


class Supervisor:
    """Starts services in list order, stops them in reverse. `wait`: how
    long a stop waits for tasks to end after their cancel."""

    def __init__(self, wait: float) -> None:
        self.wait = wait
        self._services: list[Service] = []
        self._started: list[Service] = []
        self._tasks: dict[str, asyncio.Task[None]] = {}
        # Work that must outlive a request's answer (`spawn`); cancelled
        # where the `FOLLOW_UPS` service stands in the list.
        self.spawned: list[asyncio.Task[Any]] = []

    def add(self, *services: Service) -> None:
        """Adds services at the end of the list."""
        self._services.extend(services)

    def follow_ups(self) -> Service:
        """Where in the stop order the spawned work is cancelled."""
        return Service(FOLLOW_UPS)

    async def start(self, serving: bool) -> None:
        """Starts every service in list order; `serving=False`: not those
        only the app's process runs."""
        for service in self._services:
            if service.serving and not serving:
                continue
            if service.start is not None:
                await service.start()
            self._started.append(service)
            if service.run is not None:
                task = asyncio.create_task(service.run(), name=service.name)
                task.add_done_callback(_said)
                self._tasks[service.name] = task

    def spawn(self, work: Coroutine[Any, Any, Any], name: str) -> None:
        """Runs `work` in the background until it ends or the supervisor
        stops."""
        task = asyncio.create_task(work, name=name)
        self.spawned.append(task)
        task.add_done_callback(self._forget)

    def _forget(self, task: asyncio.Task[Any]) -> None:
        if task in self.spawned:
            self.spawned.remove(task)

    def cancel(self, name: str) -> None:
        """Cancels one service's loop ahead of the stop (the stop still
        waits for it)."""
        task = self._tasks.get(name)
        if task is not None:
            task.cancel()

    async def halt(self, name: str) -> None:
        """Cancels one service's loop ahead of the stop and waits for it."""
        task = self._tasks.get(name)
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    async def stop(self) -> None:
        batch: list[asyncio.Task[Any]] = []
        while self._started:
            service = self._started.pop()
            task = self._tasks.pop(service.name, None)
            if task is not None:
                batch.append(task)
            if service.name == FOLLOW_UPS:
                batch += self.spawned
            if service.stop is not None:
                await self._end(batch)
                batch = []
                await service.stop()
        await self._end(batch)

    async def _end(self, tasks: list[asyncio.Task[Any]]) -> None:
        for t in tasks:
            t.cancel()
        await ended(tasks, self.wait, "being cancelled")


class Leadership:
    """The loops that run only while this gateway leads (the reconciler,
    the adapters' loop, the compactor): `started()` and `stopped()` are
    the elector's callbacks. A loop still checks the lead at each pass
    (its writes are fenced): the callbacks only come at the next renewal
    or campaign after a lead lapses."""

    def __init__(self, loops: list[tuple[str, Loop]]) -> None:
        self._loops = loops
        self._running: list[asyncio.Task[None]] = []
        # Cancelled, kept until they end (the loop holds tasks weakly).
        self._ending: set[asyncio.Task[None]] = set()
        self._closed = False

    def started(self) -> None:
        if self._closed or self._running:
            return
        self._running = [asyncio.create_task(loop(), name=name) for name, loop in self._loops]
        for task in self._running:
            task.add_done_callback(_said)

    def stopped(self) -> None:
        tasks, self._running = self._running, []
        for t in tasks:
            t.cancel()
            self._ending.add(t)
            t.add_done_callback(self._ending.discard)

    async def close(self) -> None:
        """No lead from now on: every loop cancelled and waited for."""
        self._closed = True
        self.stopped()
        await asyncio.gather(*self._ending, return_exceptions=True)
