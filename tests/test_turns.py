"""New requests take turns with the streams (app/router/turns.py), on a
real loop: a few begin each turn, the rest in order in the turns after;
light load never waits."""

from __future__ import annotations

import asyncio

from app.router.turns import Turns


class TurnCounter:
    """The loop's turns, counted by a callback that schedules itself again."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop, self.turn, self.on = loop, 0, True
        loop.call_soon(self._tick)

    def _tick(self) -> None:
        self.turn += 1
        if self.on:
            self.loop.call_soon(self._tick)


async def test_a_burst_begins_a_few_a_turn_in_order_of_arrival() -> None:
    loop = asyncio.get_running_loop()
    turns = Turns(loop, per_turn=4)
    counter = TurnCounter(loop)
    began: list[tuple[int, int]] = []  # (request, turn)

    async def request(i: int) -> None:
        wait = turns.begin()
        if wait is not None:
            await wait
        began.append((i, counter.turn))

    tasks = [asyncio.ensure_future(request(i)) for i in range(10)]
    await asyncio.sleep(0)  # every request's first step, in one turn
    assert [i for i, _ in began] == [0, 1, 2, 3] and turns.waiting() == 6
    await asyncio.gather(*tasks)
    counter.on = False
    assert [i for i, _ in began] == list(range(10))  # in order of arrival
    per_turn = [sum(1 for _, t in began if t == turn) for turn in {t for _, t in began}]
    assert sorted(per_turn) == [2, 4, 4], began  # never more than 4 a turn


async def test_light_load_never_waits_nor_holds_the_next_turn() -> None:
    turns = Turns(asyncio.get_running_loop(), per_turn=4)
    for _ in range(50):  # two a turn
        assert turns.begin() is None
        assert turns.begin() is None
        await asyncio.sleep(0)
    # Spent within a turn: renewed by the next, where the next request begins.
    for _ in range(4):
        assert turns.begin() is None
    await asyncio.sleep(0)
    assert turns.begin() is None


async def test_a_request_cancelled_while_it_waits_gives_its_place_to_the_next() -> None:
    turns = Turns(asyncio.get_running_loop(), per_turn=1)
    assert turns.begin() is None
    first, second = turns.begin(), turns.begin()
    assert first is not None and second is not None
    first.cancel()
    for _ in range(2):  # the renewal's turn, then the woken one's
        await asyncio.sleep(0)
    assert second.done() and not second.cancelled() and turns.waiting() == 0
