"""The engine-load poll split among a gateway's workers
(app/gateway/worker_loads.py, docs/design/workers.md), in-process:
two workers' pollers over one data dir against fake agents, with an
injected clock. Each node is asked by one worker a round, and each worker
routes by every node's figures."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from app.gateway import worker_loads
from app.gateway.worker_loads import WorkerLoads
from app.router.choice import EngineLoad
from app.router.engine_load import EngineLoadPoller, NodeAgent
from app.router.published import Endpoint
from app.router.table import RouteTable
from app.router.upstream import UpstreamClient
from tests.test_node_loads import DEAD, Clock, Directory, loads_body, servers  # noqa: F401

NODES = 8


def test_each_node_is_one_workers_and_the_parts_are_even() -> None:
    three = [WorkerLoads(Path("/nonexistent"), i, 3) for i in range(3)]
    names = [f"gpu-node-{i:05d}" for i in range(3000)]
    counts = [sum(w.mine(n) for n in names) for w in three]
    assert all(sum(w.mine(n) for w in three) == 1 for n in names)
    assert min(counts) > 900 and max(counts) < 1100, counts


async def test_two_workers_ask_each_node_once_a_round_and_route_by_all(
    servers: Callable[[str, str], Any], tmp_path: Path,  # noqa: F811
) -> None:
    clock = Clock(100.0)
    fig = {"running": 2, "waiting": 1, "kv": 0.3, "age_s": 0.0}
    agents = []
    for i in range(NODES):
        agent = await servers("/node/v1/loads", "tok")
        agent.answer = loads_body({f"r{i}": fig})
        agents.append(agent)
    directory = Directory({f"r{i}": NodeAgent(f"n{i}", agents[i].url, ("tok",))
                           for i in range(NODES)})
    client = UpstreamClient(0.25)
    tables, pollers = [], []
    for w in range(2):
        table = RouteTable(clock=clock)
        table.set_endpoints({"m": [Endpoint(f"r{i}", DEAD, "ek") for i in range(NODES)]})
        poller = EngineLoadPoller(table, lambda: client, clock=clock, directory=directory)
        poller.share = WorkerLoads(tmp_path, w, 2, clock=clock)
        tables.append(table)
        pollers.append(poller)
    everyone = {f"r{i}" for i in range(NODES)}
    try:
        own = [set(await p.poll()) for p in pollers]
        # Each node asked once, by one worker: the parts split the fleet.
        assert [a.hits for a in agents] == [1] * NODES
        assert own[0] | own[1] == everyone and not own[0] & own[1] and own[0] and own[1]
        # Worker 1 polled after worker 0 wrote: it routes by every figure.
        assert set(tables[1].fresh_loads()) == everyone
        assert tables[1].fresh_loads()["r0"] == EngineLoad(2.0, 1.0, 0.3, 100.0)
        clock.now = 101.0
        await pollers[0].poll()
        assert set(tables[0].fresh_loads()) == everyone
        assert sum(a.hits for a in agents) == NODES + len(own[0])

        # Worker 1 dies: its file stops changing, its figures go stale (3
        # rounds) and are unknown, never passed off as fresh.
        for t in (102.0, 103.0, 104.0):
            clock.now = t
            await pollers[0].poll()
        assert set(tables[0].fresh_loads()) == own[0]
        # It is back: its part is known again at worker 0's next round.
        await pollers[1].poll()
        clock.now = 105.0
        await pollers[0].poll()
        assert set(tables[0].fresh_loads()) == everyone
    finally:
        await client.close()


def _write(tmp: Path, i: int, data: bytes) -> None:
    (tmp / worker_loads.FOLDER).mkdir(exist_ok=True)
    (tmp / worker_loads.FOLDER / f"{i}.json").write_bytes(data)


def test_the_others_files_are_read_when_they_change_and_only_in_shape(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch,
) -> None:
    clock = Clock(100.0)
    me = WorkerLoads(tmp_path, 0, 3, clock=clock)
    assert me.read() is None  # no other worker has written yet
    WorkerLoads(tmp_path, 1, 3, clock=clock).write({"a": EngineLoad(1.0, 0.0, 0.5, 99.0)})
    assert me.read() == {"a": EngineLoad(1.0, 0.0, 0.5, 99.0)}
    assert me.read() is None  # unchanged: not read again

    good = {"loads": {"b": [0, 2, 0.1, 99.5]}}
    bad: list[Any] = [
        b"not json", b"[]", b'{"loads": []}',
        *(json.dumps({"loads": {"b": v}}).encode() for v in (
            [1, 2, 0.1], [-1, 0, 0.1, 99], [1, 0, 1.5, 99], [True, 0, 0.1, 99],
            [1, 0, 0.1, "99"], [1, 0, float("nan"), 99],
            [1, 0, 0.1, 102.0])),  # read after now: an earlier boot's clock
    ]
    caplog.set_level(logging.WARNING, logger="app.gateway.worker_loads")
    for data in bad:
        _write(tmp_path, 2, data)
        assert me.read() == {"a": EngineLoad(1.0, 0.0, 0.5, 99.0)}, data
    assert len([r for r in caplog.records if "worker 2's engine loads" in r.message]) == 1
    _write(tmp_path, 2, json.dumps(good).encode())
    assert me.read() == {"a": EngineLoad(1.0, 0.0, 0.5, 99.0),
                         "b": EngineLoad(0.0, 2.0, 0.1, 99.5)}
    monkeypatch.setattr(worker_loads, "MAX_BYTES", 20)
    _write(tmp_path, 2, json.dumps(good).encode() + b" " * 40)
    assert me.read() == {"a": EngineLoad(1.0, 0.0, 0.5, 99.0)}
    # A file gone (its worker cleared): its figures go with it.
    (tmp_path / worker_loads.FOLDER / "1.json").unlink()
    assert me.read() == {}
    worker_loads.clear(tmp_path)
    assert not list((tmp_path / worker_loads.FOLDER).glob("*.json"))
