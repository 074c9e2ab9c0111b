"""`Pause`: a loop's wait between its steps, which a wake ends early.

A future and a timer, not `asyncio.wait_for` on an event (which makes and
cancels a task each wait) nor a sleep: the gateway's periodic loops wait
this way every step (docs/design/hot-path.md, "An idle gateway"). A wake
that comes while no wait runs (the loop is in its step) ends the next wait
at once, so it is never lost.
"""

from __future__ import annotations

import asyncio


class Pause:
    __slots__ = ("_waiting", "_woken")

    def __init__(self) -> None:
        self._waiting: asyncio.Future[None] | None = None
        self._woken = False

    @property
    def waiting(self) -> bool:
        """Whether a wait runs now."""
        return self._waiting is not None

    def wake(self) -> None:
        """Ends the wait that runs, or else the next one at once."""
        waiting = self._waiting
        if waiting is None:
            self._woken = True
        elif not waiting.done():
            waiting.set_result(None)

    async def wait(self, seconds: float) -> None:
        """Until `seconds` have passed or `wake()` is called (at once if it
        was since the last wait)."""
        if self._woken:
            self._woken = False
            return
        loop = asyncio.get_running_loop()
        self._waiting = waiting = loop.create_future()
        timer = loop.call_later(seconds, _resolve, waiting)
        try:
            await waiting
        finally:
            timer.cancel()
            self._waiting = None
            self._woken = False


def _resolve(waiting: asyncio.Future[None]) -> None:
    if not waiting.done():
        waiting.set_result(None)
