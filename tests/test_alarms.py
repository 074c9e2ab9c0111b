"""The watches' one loop timer (app/router/timeouts.py, `Alarms`): requests
share it instead of arming and cancelling a loop timer each, a check runs at
most one slot late, a closed watch is never checked, and the slots it leaves
go when their time comes. The loop is a clock and a timer list (time is
injected); the watches are the real ones in the last test."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import uvloop

from app.router.timeouts import ALARM_SLOT, Alarms, Timeouts, Watch, Why

LATE = ALARM_SLOT + 0.001 + 1e-9  # a slot, and the loop clock's millisecond


@dataclass
class Handle:
    when: float
    callback: Any
    cancelled: bool = False

    def cancel(self) -> None:
        self.cancelled = True


@dataclass
class Loop:
    """What Alarms asks of the event loop: its clock and call_at."""

    now: float = 1000.0
    armed: list[Handle] = field(default_factory=list)

    def time(self) -> float:
        return self.now

    def call_at(self, when: float, callback: Any) -> Handle:
        h = Handle(when, callback)
        self.armed.append(h)
        return h

    def live(self) -> list[Handle]:
        return [h for h in self.armed if not h.cancelled]

    def run_until(self, t: float) -> None:
        """Advances the clock to `t`, ringing what is due on the way."""
        while True:
            due = sorted((h for h in self.live() if h.when <= t), key=lambda h: h.when)
            if not due:
                break
            h = due[0]
            self.armed.remove(h)
            self.now = max(self.now, h.when)
            h.callback()
        self.now = t


class Checked:
    """A watch as Alarms sees it: `_check` counted; it may ask to be checked again."""

    def __init__(self, alarms: Alarms, again_in: float = 0.0) -> None:
        self.alarms = alarms
        self.checks: list[float] = []
        self.again_in = again_in
        self.slot = 0

    def _check(self) -> None:
        now = self.alarms._loop.time()
        self.checks.append(now)
        if self.again_in:
            self.slot = self.alarms.add(self, now + self.again_in)  # type: ignore[arg-type]


def test_a_thousand_requests_share_one_loop_timer() -> None:
    loop = Loop()
    alarms = Alarms(loop)  # type: ignore[arg-type]
    watches = []
    for _ in range(1000):
        loop.now += 0.0001  # 10,000 requests a second
        w = Checked(alarms)
        w.slot = alarms.add(w, loop.now + 0.25)  # type: ignore[arg-type]
        watches.append(w)
    # One timer armed, for the earliest slot; a later slot never re-arms it.
    assert len(loop.armed) == 1
    for w in watches[:990]:
        alarms.remove(w, w.slot)  # type: ignore[arg-type]
    loop.run_until(loop.now + 1.0)
    checked = [w for w in watches if w.checks]
    assert checked == watches[990:]  # the closed ones never were
    assert alarms.pending() == 0
    assert not alarms._slots and not alarms._due  # nothing left behind
    assert not loop.live()  # and no timer armed for nothing


def test_a_check_runs_at_its_due_time_or_within_one_slot_after() -> None:
    loop = Loop(now=500.003)
    alarms = Alarms(loop)  # type: ignore[arg-type]
    for delay in (0.25, 0.013, 3.7, 0.25):
        w = Checked(alarms)
        due = loop.now + delay
        alarms.add(w, due)  # type: ignore[arg-type]
        loop.run_until(due + 2 * ALARM_SLOT)
        assert len(w.checks) == 1
        assert due <= w.checks[0] <= due + LATE


def test_an_earlier_due_time_rearms_the_timer_for_it() -> None:
    loop = Loop()
    alarms = Alarms(loop)  # type: ignore[arg-type]
    late, soon = Checked(alarms), Checked(alarms)
    alarms.add(late, loop.now + 60)  # type: ignore[arg-type]
    alarms.add(soon, loop.now + 0.1)  # type: ignore[arg-type]
    assert [h.when for h in loop.live()] == [min(h.when for h in loop.armed)]
    loop.run_until(loop.now + 0.2)
    assert soon.checks and not late.checks
    assert len(loop.live()) == 1 and loop.live()[0].when >= 1060  # armed for the late one


def test_a_check_that_asks_again_is_rung_later_not_in_the_same_ring() -> None:
    loop = Loop()
    alarms = Alarms(loop)  # type: ignore[arg-type]
    w = Checked(alarms, again_in=1.0)
    alarms.add(w, loop.now + 1.0)  # type: ignore[arg-type]
    loop.run_until(loop.now + 3.5)
    assert len(w.checks) == 3  # once a second, never twice in one ring
    gaps = [b - a for a, b in zip(w.checks, w.checks[1:], strict=False)]
    assert all(1.0 <= g <= 1.0 + LATE for g in gaps)


async def test_watches_of_one_proxy_share_its_alarms_and_still_fire() -> None:
    """The real watches: a first-byte limit expires through the shared
    timer, and a closed watch leaves nothing to check."""
    loop = asyncio.get_running_loop()
    alarms = Alarms(loop)
    gone = asyncio.Event()

    async def receive() -> dict[str, Any]:
        await gone.wait()
        return {"type": "http.disconnect"}

    async def stream() -> Why | None:
        watch = Watch(receive, Timeouts(first_byte=0.1), loop.time(), alarms)
        watch.expect_first_byte()
        try:
            await asyncio.sleep(5)  # no byte comes
        except asyncio.CancelledError:
            return watch.caught()
        return None

    async def plain() -> None:
        watch = Watch(receive, Timeouts(), loop.time(), alarms)
        await asyncio.sleep(0)
        watch.close()

    started = loop.time()
    results = await asyncio.gather(stream(), *(plain() for _ in range(50)))
    assert results[0] is Why.FIRST_BYTE
    assert 0.1 <= loop.time() - started < 0.1 + ALARM_SLOT + 0.2
    assert alarms.pending() == 0


def test_on_uvloop_each_slot_rings_once() -> None:
    """uvloop rounds a timer's delay to the millisecond and reads a cached
    clock: a timer for a slot's very end rang before it, found nothing due
    and was armed again for no delay, turn after turn until the clock moved
    (340 rings for 51 slots)."""
    rings = 0

    class Counting(Alarms):
        def _ring(self) -> None:
            nonlocal rings
            rings += 1
            super()._ring()

    async def main() -> tuple[int, int]:
        loop = asyncio.get_running_loop()
        alarms = Counting(loop)
        watches, slots = [], set()
        for i in range(200):
            w = Checked(alarms)
            slots.add(alarms.add(w, loop.time() + 0.013 + i * 0.0037))  # type: ignore[arg-type]
            watches.append(w)
            await asyncio.sleep(0.0011)
        await asyncio.sleep(1.0)
        assert all(len(w.checks) == 1 for w in watches)
        return rings, len(slots)

    loop = uvloop.new_event_loop()
    try:
        rang, slots = loop.run_until_complete(main())
    finally:
        loop.close()
    assert rang <= slots + 1, (rang, slots)
