"""A gateway's services (app/gateway/supervisor.py): started in list order,
stopped in reverse, loops cancelled before the stop of what they stand on;
the leader-only loops started and stopped by the elector's callbacks, on
the real embedded store."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pytest

from app.control import state as s
from app.control.leader import Elector
from app.gateway.supervisor import Leadership, Service, Supervisor
from app.store.embedded import EmbeddedStore


async def test_services_start_in_order_and_stop_in_reverse() -> None:
    said: list[str] = []

    def step(what: str) -> Service:
        async def start() -> None:
            said.append(f"start {what}")

        async def stop() -> None:
            said.append(f"stop {what}")

        return Service(what, start=start, stop=stop)

    def loop(what: str) -> Service:
        async def run() -> None:
            try:
                await asyncio.Event().wait()
            finally:
                said.append(f"ended {what}")

        return Service(what, run=run)

    sup = Supervisor(wait=5.0)
    sup.add(step("store"), step("mirror"), sup.follow_ups(), loop("publisher"),
            loop("usage"), Service("app-only", run=loop("x").run, serving=True), step("agent"))
    await sup.start(serving=False)
    assert said == ["start store", "start mirror", "start agent"]
    follow_up = asyncio.Event()
    sup.spawn(follow_up.wait(), "a route's follow-up")
    await asyncio.sleep(0)
    said.clear()
    await sup.stop()
    # Each stop after every loop started after it has ended; the loops in
    # between, and the follow-ups, cancelled together.
    assert said[0] == "stop agent"
    assert sorted(said[1:3]) == ["ended publisher", "ended usage"]
    assert said[3:] == ["stop mirror", "stop store"]
    assert not sup.spawned  # cancelled, and forgotten once ended


async def test_leader_only_loops_run_while_the_elector_leads(tmp_path: Path) -> None:
    store = await EmbeddedStore.open(tmp_path / "state.db")
    running: dict[str, int] = {"a": 0, "b": 0}

    def reconciler(name: str) -> Leadership:
        async def run() -> None:
            running[name] += 1
            try:
                await asyncio.Event().wait()
            finally:
                running[name] -= 1

        return Leadership([("reconciler", run)])

    try:
        lead = {n: reconciler(n) for n in ("a", "b")}
        electors = {n: Elector(store, s.GatewayInfo(id=n, url=f"http://{n}", version="t",
                                                    started=0), ttl=10,
                               on_started_leading=lead[n].started,
                               on_stopped_leading=lead[n].stopped) for n in ("a", "b")}
        assert (await electors["a"].tick()).is_leader
        assert not (await electors["b"].tick()).is_leader
        await asyncio.sleep(0)
        assert running == {"a": 1, "b": 0}
        await electors["a"].step_down()  # OnStoppedLeading: its loop cancelled
        assert (await electors["b"].tick()).is_leader
        await asyncio.sleep(0.05)
        assert running == {"a": 0, "b": 1}
        await lead["b"].close()  # a stop: never again, even if told
        lead["b"].started()
        await asyncio.sleep(0)
        assert running == {"a": 0, "b": 0}
        await lead["a"].close()
    finally:
        await store.close()


async def test_a_loop_that_dies_is_logged_when_it_dies(
        caplog: pytest.LogCaptureFixture) -> None:
    """A background loop that raises is said at once, with its name and
    the error, not only found at the stop; one that returns is said at
    INFO. A loop cancelled by the stop is not said."""
    async def dies() -> None:
        raise RuntimeError("the store answered nonsense")

    async def returns() -> None:
        return

    async def runs() -> None:
        await asyncio.Event().wait()

    sup = Supervisor(wait=5.0)
    sup.add(Service("dying", run=dies), Service("done", run=returns),
            Service("steady", run=runs))
    with caplog.at_level(logging.INFO, logger="app.gateway.supervisor"):
        await sup.start(serving=False)
        for _ in range(3):
            await asyncio.sleep(0)
        said = [(r.levelname, r.getMessage()) for r in caplog.records]
        assert ("ERROR", "background task dying died: the store answered nonsense") in said
        died = next(r for r in caplog.records if "dying" in r.getMessage())
        assert died.exc_info is not None  # the traceback, for where it died
        assert ("INFO", "background task done ended") in said
        caplog.clear()
        await sup.stop()
    assert [r.getMessage() for r in caplog.records] == []
