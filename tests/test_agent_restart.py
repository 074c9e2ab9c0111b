"""An agent that restarts (an upgrade, a crash) adopts the engines it left
running instead of starting them again: no reload, no GPU used twice."""

from __future__ import annotations

import signal
import threading
import time
import uuid

import httpx

from tests.support.procs import (
    Cluster,
    Proc,
    engine_pid,
    engine_pids,
    replicas,
    routes,
    serve_one,
    wait_for,
)


def test_restarted_agent_adopts_its_engines(cluster: Cluster) -> None:
    gw = cluster.gateway("gw-a")
    agent = cluster.agent("node-1", [gw], "--gpus", "1")
    # A name of this run's own: engines are found by it among every process
    # on the machine, other test runs' included.
    name = f"adopt-{uuid.uuid4().hex[:8]}"
    served = serve_one(gw, name)
    key, rep, pid = served.key, served.replica, served.pid

    # A client asks all along, through every stop, crash and restart below.
    answers: list[int] = []
    stop = threading.Event()

    def ask() -> None:
        with httpx.Client(base_url=gw.url, timeout=10,
                          headers={"Authorization": f"Bearer {key}"}) as client:
            while not stop.is_set():
                answers.append(client.post("/v1/chat/completions", json={
                    "model": name, "messages": [{"role": "user", "content": "hi"}]}
                ).status_code)
                time.sleep(0.05)

    asking = threading.Thread(target=ask, daemon=True)
    asking.start()

    # A clean stop leaves the engine serving, through the gateway too.
    agent.signal(signal.SIGTERM)
    assert agent.wait(15) == 0, agent.output()[-2000:]
    assert engine_pid(rep["url"]) == pid
    assert routes(gw, key, name)

    adopted = "adopted engine of " + rep["id"]

    def adopt(*flags: str) -> Proc:
        """Starts an agent for node-1 and waits until *it* adopted the engine
        (the agents of one node share a log file)."""
        before = agent.output().count(adopted)
        new = cluster.agent("node-1", [gw], "--gpus", "1", *flags)
        wait_for(lambda: new.output().count(adopted) > before, 15, "adoption")
        return new

    for _ in ("restart after SIGTERM", "restart after SIGKILL"):
        agent = adopt()
        wait_for(lambda: [(r["id"], r["phase"], r["url"]) for r in replicas(gw)]
                 == [(rep["id"], "ready", rep["url"])], 10, "the same replica ready")
        assert engine_pid(rep["url"]) == pid  # the very same process
        assert engine_pids("--served-model-name", name) == [pid]  # and no second one
        assert routes(gw, key, name)
        agent.kill_alone()  # a crash: the agent dies, its engine does not

    agent = adopt("--stop-engines-on-exit")
    wait_for(lambda: routes(gw, key, name), 10, "routing")
    stop.set()
    asking.join(15)
    # Not one request lost while the agent stopped, crashed and came back.
    assert len(answers) >= 5 and set(answers) == {200}, (len(answers), sorted(set(answers)))
    # Asked to, the agent stops an adopted engine (not its child) on exit.
    agent.signal(signal.SIGTERM)
    assert agent.wait(20) == 0, agent.output()[-2000:]
    assert engine_pids("--served-model-name", name) == []
