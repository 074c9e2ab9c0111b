"""An agent that restarts (an upgrade, a crash) adopts the engines it left
running instead of starting them again: no reload, no GPU used twice."""

from __future__ import annotations

import json
import signal
import threading
import time
import uuid
from pathlib import Path

import httpx

from tests.support.procs import (
    Cluster,
    Proc,
    engine_pid,
    engine_pids,
    make_key,
    put_model,
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


def test_agent_killed_while_its_second_engine_loads(cluster: Cluster, tmp_path: Path) -> None:
    """SIGKILLed once its first engine serves and while its second still
    loads, a restarted agent adopts both (each was recorded as it started):
    the same two processes, the first never restarted, the second ready once
    loaded, and never a second engine for either replica."""
    tag = uuid.uuid4().hex[:8]
    first, second = f"first-{tag}", f"second-{tag}"
    hold = tmp_path / "hold"  # the fake vLLM of `second` loads until its file goes
    hold.mkdir()
    (hold / second).touch()
    env = {"FAKE_VLLM_HOLD_DIR": str(hold)}
    work = cluster.tmp / "agent-node-1"

    gw = cluster.gateway("gw-a")
    agent = cluster.agent("node-1", [gw], "--gpus", "2", env_extra=env)
    key = make_key(gw)
    for name in (first, second):
        put_model(gw, name, {"model": "acme/m", "gpus": 1})

    def ids() -> dict[str, str]:
        return {r["model"]: r["id"] for r in replicas(gw)}

    rid = wait_for(lambda: (found := ids()).keys() == {first, second} and found, 20,
                   "both replicas placed")

    def recorded() -> dict[str, int]:
        """Replica id -> pid, as engines.json holds them for the next run."""
        return {r["replica_id"]: r["pid"] for r in json.loads((work / "engines.json").read_text())}

    def one_engine(name: str) -> int:
        pids = engine_pids("--served-model-name", name)
        assert len(pids) == 1, f"expected one engine for {name}, found {pids}"
        return pids[0]

    def both_started() -> bool:
        # The second spawned and recorded (its process the one recorded),
        # but held: not ready. The first serves.
        return (routes(gw, key, first) and recorded().keys() == {rid[first], rid[second]}
                and engine_pids("--served-model-name", second) == [recorded()[rid[second]]])

    wait_for(both_started, 30, "the first engine serving, the second started and recorded")
    pid_a, pid_b = one_engine(first), one_engine(second)
    assert recorded() == {rid[first]: pid_a, rid[second]: pid_b}
    phases = {r["model"]: r["phase"] for r in replicas(gw)}
    assert phases == {first: "ready", second: "starting"}, phases

    agent.kill_alone()  # a crash: the agent dies, both engines live on
    assert (one_engine(first), one_engine(second)) == (pid_a, pid_b)

    before = len(agent.output())
    agent = cluster.agent("node-1", [gw], "--gpus", "2", "--stop-engines-on-exit",
                          env_extra=env)

    def since_restart() -> str:
        return agent.output()[before:]

    wait_for(lambda: all(f"adopted engine of {rid[n]} (pid {p}," in since_restart()
                         for n, p in ((first, pid_a), (second, pid_b))), 15, "both adopted")
    # The first routes on through the restart; the second is still loading.
    wait_for(lambda: routes(gw, key, first), 10, "routing to the first")
    assert (one_engine(first), one_engine(second)) == (pid_a, pid_b)

    (hold / second).unlink()  # the second engine finishes loading

    def all_phases() -> list[tuple[str, str]]:
        return sorted((r["model"], r["phase"]) for r in replicas(gw))

    wait_for(lambda: all_phases() == [(first, "ready"), (second, "ready")], 20, "both ready")
    wait_for(lambda: routes(gw, key, second), 10, "routing to the second")
    assert (one_engine(first), one_engine(second)) == (pid_a, pid_b)
    assert recorded() == {rid[first]: pid_a, rid[second]: pid_b}
    assert "started vllm engine" not in since_restart(), since_restart()[-2000:]
    # Each engine's log shows one start: neither was started again.
    for name in (first, second):
        log = (work / "logs" / f"{rid[name]}.log").read_text()
        assert log.count("non-default args:") == 1, log[-2000:]

    agent.signal(signal.SIGTERM)
    assert agent.wait(20) == 0, agent.output()[-2000:]
    assert engine_pids("--served-model-name", first) == []
    assert engine_pids("--served-model-name", second) == []
