"""New requests take turns with the streams already flowing
(docs/design/hot-path.md, "New requests take turns").

asyncio runs every callback that is ready at the start of a loop turn
before it looks at the sockets again; a stream's chunk is relayed from the
read callback, when the loop looks. A burst of new requests makes one turn
long: each runs its first step (the key, the body, the route, the engine's
request written) in the same turn, some 150-300 us each, and every chunk
that arrived meanwhile waits for the turn to end (256 streams started at
once held chunks 60-70 ms). `Turns` lets at most `per_turn` requests begin
until the loop has turned; the others wait in arrival order, costing
nothing while they wait, and begin in the turns that follow.
"""

from __future__ import annotations

import asyncio
from collections import deque

# Requests begun per loop turn while others wait: a turn's new work is then
# a few milliseconds of CPU. At 8 and at 16, 512 streams started at once
# kept every chunk within 25 ms; 8 cost c=64 some 10 us a request (more
# requests waited a turn), 16 nothing measurable (bench/RESULTS.md, "New
# requests take turns").
PER_TURN = 16


class Turns:
    """`begin()` returns None when a request may begin now, else a future
    to await: it is set in a later turn, in order of arrival."""

    __slots__ = ("_armed", "_loop", "_waiting", "per_turn", "used")

    def __init__(self, loop: asyncio.AbstractEventLoop, per_turn: int = PER_TURN) -> None:
        self._loop = loop
        self.per_turn = per_turn
        self.used = 0  # requests begun since the budget was last renewed
        self._armed = False  # a renewal is scheduled
        self._waiting: deque[asyncio.Future[None]] = deque()

    def begin(self) -> asyncio.Future[None] | None:
        if self.used < self.per_turn and not self._waiting:
            self.used += 1
            if self.used == self.per_turn:
                self._arm()  # spent: renewed in the next turn
            return None
        fut = self._loop.create_future()
        self._waiting.append(fut)
        self._arm()
        return fut

    def waiting(self) -> int:
        return len(self._waiting)

    def _renew(self) -> None:
        """The next turn: up to `per_turn` waiting requests begin (in the
        turn after this one, as their tasks wake)."""
        self._armed = False
        self.used = 0
        waiting = self._waiting
        while waiting and self.used < self.per_turn:
            fut = waiting.popleft()
            if not fut.done():  # a request cancelled while it waited
                fut.set_result(None)
                self.used += 1
        if self.used >= self.per_turn:
            self._arm()

    def _arm(self) -> None:
        # The renewal runs in the next turn, after the loop has looked at
        # its sockets; whenever the budget is spent, one is armed.
        if not self._armed:
            self._armed = True
            self._loop.call_soon(self._renew)
