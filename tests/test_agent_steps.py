"""The agent's steps, driven one by one in-process: an in-memory gateway and
a clock the test moves, against real engine processes (the fake vLLM).

heartbeat(), poll(), converge(), observe() and report() are called directly,
so each test takes seconds and no gateway process runs.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import signal
import stat
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from app.agent import health
from app.agent.agent import Agent
from app.agent.config import AgentConfig
from app.agent.gateway_client import GatewayClient, GatewayRefused, GatewayUnreachable
from app.agent.gpus import Hardware, declared
from app.control.state import MAX_DETAIL, MAX_GPUS, MAX_TEXT, NodeInfo, ReplicaStatus
from tests.support.procs import FAKE_BIN, kill_tagged


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def replica(rid: str, gpus: list[int], model: str = "m") -> dict[str, Any]:
    return {"id": rid, "model": model, "weights": f"acme/{model}", "engine": "vllm",
            "gpus": gpus, "key": "llmgw-" + hashlib.sha256(rid.encode()).hexdigest()[:40]}


def answer(revision: int | None, *replicas: dict[str, Any], store: str | None = None
           ) -> dict[str, Any]:
    """An assignments answer as the gateway builds it (revision None, store
    None: gateways that predate them)."""
    shape = [[r["id"], r["model"], r["weights"], r["engine"], r["gpus"]] for r in replicas]
    out: dict[str, Any] = {
        "fingerprint": hashlib.sha256(json.dumps(shape).encode()).hexdigest()[:16],
        "replicas": list(replicas)}
    if revision is not None:
        out["revision"] = revision
    if store is not None:
        out["store"] = store
    return out


class MemoryGateway:
    """The agent's gateway, in memory: serves `answer`, records the rest."""

    def __init__(self) -> None:
        self.answer = answer(0)
        self.failure: Exception | None = None
        self.heartbeats: list[dict[str, Any]] = []
        self.reports: list[list[dict[str, Any]]] = []
        self.moved_on = 0

    async def start(self) -> None:
        pass

    async def close(self) -> None:
        pass

    async def heartbeat(self, inventory: dict[str, Any]) -> dict[str, Any]:
        self.heartbeats.append(inventory)
        return {"node": inventory["name"], "ttl": 6}

    async def assignments(self, since: str, wait: float) -> dict[str, Any]:
        if self.failure is not None:
            raise self.failure
        return self.answer

    async def report(self, replicas: list[dict[str, Any]]) -> None:
        self.reports.append(replicas)

    def move_on(self) -> None:
        self.moved_on += 1

    def phases(self) -> dict[str, str]:
        return {r["id"]: r["phase"] for r in self.reports[-1]}


def config(tmp_path: Path, gateways: list[str] | None = None) -> AgentConfig:
    return AgentConfig(
        gateways=gateways or ["http://127.0.0.1:9"], node="node-1", token="t",
        gpus=declared(4), engines=["vllm"], work_dir=tmp_path / "agent",
        vllm_bin=str(FAKE_BIN / "vllm"), advertise_host="127.0.0.1", probe_timeout=0.3)


@pytest.fixture
def engines_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[str]:
    """Engines inherit this process's environment: the fake's interpreter,
    and a tag by which teardown finds whatever a test left running."""
    tag = f"TESTS_PROC_TAG={tmp_path}"
    monkeypatch.setenv("FAKE_VLLM_PYTHON", sys.executable)
    monkeypatch.setenv("TESTS_PROC_TAG", str(tmp_path))
    yield tag
    kill_tagged(tag)


@pytest.fixture
async def agent(engines_env: str, tmp_path: Path) -> AsyncIterator[tuple[Agent, MemoryGateway,
                                                                          Clock]]:
    gw, clock = MemoryGateway(), Clock()
    a = Agent(config(tmp_path), clock=clock, client=gw)
    await a.start()
    try:
        yield a, gw, clock
    finally:
        await a.shutdown(stop_engines=True)


async def observe_until(agent: Agent, pred: Callable[[], bool], what: str,
                        timeout: float = 20.0) -> None:
    """Runs observe() until `pred` holds (each step is one real probe)."""
    deadline = time.monotonic() + timeout
    while True:
        await agent.observe()
        if pred():
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}: "
                                 f"{[(r, e.phase, e.detail) for r, e in agent.running.items()]}")
        await asyncio.sleep(0.05)


def phase(agent: Agent, rid: str) -> str:
    return agent.running[rid].phase


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


def proc_file(pid: int, name: str) -> bytes:
    return Path(f"/proc/{pid}/{name}").read_bytes()


def children(pid: int) -> list[int]:
    found = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                if int((p / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    found.append(int(p.name))
            except (OSError, IndexError, ValueError):
                continue
    return found


async def gone(pids: list[int], timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while any(alive(p) for p in pids):
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.05)
    return True


async def chat(url: str, key: str | None) -> int:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    async with aiohttp.ClientSession() as s, s.post(
        url + "/v1/chat/completions", headers=headers,
        json={"model": "m", "messages": [{"role": "user", "content": "hi"}]},
    ) as r:
        return r.status


async def test_heartbeat_sends_the_inventory_and_beats_three_times_per_ttl(
    agent: tuple[Agent, MemoryGateway, Clock],
) -> None:
    a, gw, _ = agent
    await a.heartbeat()
    assert gw.heartbeats[-1]["name"] == "node-1"
    assert [g["index"] for g in gw.heartbeats[-1]["gpus"]] == [0, 1, 2, 3]
    assert a.heartbeat_every == 2.0  # the gateway's TTL is 6 s


async def test_converge_starts_and_stops_engines_keys_off_their_command_lines(
    agent: tuple[Agent, MemoryGateway, Clock], tmp_path: Path,
) -> None:
    a, gw, _ = agent
    one, two = replica("m-1", [0]), replica("m-2", [1, 2])
    gw.answer = answer(1, one, two)
    assert await a.poll(0) == "changed"
    assert await a.converge() == (["m-1", "m-2"], [])
    await observe_until(a, lambda: phase(a, "m-1") == phase(a, "m-2") == "ready", "both ready")
    assert await a.report()
    assert gw.phases() == {"m-1": "ready", "m-2": "ready"}
    assert not await a.report()  # nothing changed: nothing sent

    for r in (one, two):
        proc = a.running[r["id"]].proc
        assert proc.pid is not None
        # The key is in the engine's environment, which only its user reads,
        # never on its command line, which every local user can.
        assert r["key"].encode() not in proc_file(proc.pid, "cmdline")
        environ = proc_file(proc.pid, "environ").split(b"\0")
        assert f"VLLM_API_KEY={r['key']}".encode() in environ
        assert await chat(proc.url, None) == 401  # the engine still demands it
        assert await chat(proc.url, "llmgw-" + "x" * 40) == 401
        assert await chat(proc.url, r["key"]) == 200
        assert stat.S_IMODE(proc.log_path.stat().st_mode) == 0o600
    assert stat.S_IMODE((tmp_path / "agent" / "logs").stat().st_mode) == 0o700

    # Two GPUs: tensor parallelism, with a worker process, as vLLM has.
    leader = a.running["m-2"].proc.pid
    assert leader is not None
    workers = children(leader)
    assert len(workers) == 1 and alive(workers[0])

    gw.answer = answer(2, one)
    assert await a.poll(0) == "changed"
    assert await a.converge() == ([], ["m-2"])
    # The stop went to the engine's process group: its worker is gone too.
    assert await gone([leader, *workers]), "an engine's worker outlived its stop"
    assert [s.id for s in a.statuses()] == ["m-1"]


async def test_an_answer_older_than_the_one_applied_is_ignored(
    agent: tuple[Agent, MemoryGateway, Clock],
) -> None:
    a, gw, _ = agent
    one = replica("m-1", [0])
    gw.answer = answer(None, one)  # a gateway that predates revisions: taken
    assert await a.poll(0) == "changed"
    gw.answer = answer(5, one)
    assert await a.poll(0) == "unchanged"
    await a.converge()
    pid = a.running["m-1"].proc.pid

    # A gateway whose watch lags answers with the list of an older revision.
    for stale in (answer(4), answer(None)):
        gw.answer = stale
        assert await a.poll(0) == "stale"
        assert await a.converge() == ([], [])
    assert gw.moved_on == 2  # and the agent asks another gateway next
    assert a.running["m-1"].proc.pid == pid and a.running["m-1"].proc.exit_code() is None

    gw.answer = answer(6)
    assert await a.poll(0) == "changed"
    assert await a.converge() == ([], ["m-1"])


@asynccontextmanager
async def started(tmp_path: Path, gw: MemoryGateway, stop_engines: bool = True
                  ) -> AsyncIterator[Agent]:
    """One run of the agent on the test's work dir; the next run adopts
    what this one leaves running (stop_engines False)."""
    a = Agent(config(tmp_path), clock=Clock(), client=gw)
    await a.start()
    try:
        yield a
    finally:
        await a.shutdown(stop_engines=stop_engines)


async def test_a_restarted_agent_ignores_an_older_answer_of_the_same_store(
    engines_env: str, tmp_path: Path,
) -> None:
    gw, one = MemoryGateway(), replica("m-1", [0])
    async with started(tmp_path, gw, stop_engines=False) as first:
        gw.answer = answer(5, one, store="s1")
        assert await first.poll(0) == "changed"
        assert await first.converge() == (["m-1"], [])
        pid = first.running["m-1"].proc.pid

    async with started(tmp_path, gw) as second:
        assert second.running["m-1"].proc.pid == pid  # adopted
        # Its first answer comes from a gateway whose mirror lags: loaded,
        # but from before m-1 was placed. Taken, it would stop m-1's engine.
        gw.answer = answer(4, store="s1")
        assert await second.poll(0) == "stale"
        assert gw.moved_on == 1
        assert await second.converge() == ([], [])
        gw.answer = answer(6, one, store="s1")
        assert await second.poll(0) == "changed"
        assert await second.converge() == ([], [])
        engine = second.running["m-1"].proc
        assert engine.pid == pid and engine.exit_code() is None


async def test_an_answer_from_another_store_is_applied_whatever_its_revision(
    tmp_path: Path,
) -> None:
    gw = MemoryGateway()
    gw.answer = answer(5000, store="s1")
    assert await Agent(config(tmp_path), client=gw).poll(0) == "changed"
    # The store was replaced (a new etcd counts from 1 again): its first
    # answer is taken, and is what the next run compares with.
    gw.answer = answer(3, replica("m-1", [0]), store="s2")
    assert await Agent(config(tmp_path), client=gw).poll(0) == "changed"
    gw.answer = answer(2, store="s2")
    assert await Agent(config(tmp_path), client=gw).poll(0) == "stale"
    # A gateway that predates store ids: compared within the run only.
    gw.answer = answer(1)
    restarted = Agent(config(tmp_path), client=gw)
    assert await restarted.poll(0) == "changed"
    gw.answer = answer(0, replica("m-1", [0]))
    assert await restarted.poll(0) == "stale"


async def test_an_unreadable_kept_revision_is_ignored_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture,
) -> None:
    kept = tmp_path / "agent" / "assignments.json"
    kept.parent.mkdir(parents=True)
    gw = MemoryGateway()
    for junk in ('{"store": "s1", "rev', "[]", '{"store": "s1"}', "\xff"):
        kept.write_bytes(junk.encode("latin-1"))
        caplog.clear()
        a = Agent(config(tmp_path), client=gw)
        assert f"ignoring unreadable {kept}" in caplog.text, junk
        gw.answer = answer(7, store="s1")
        assert await a.poll(0) == "changed"
        assert json.loads(kept.read_text()) == {"store": "s1", "revision": 7}


async def test_a_gateway_that_cannot_answer_changes_nothing(
    agent: tuple[Agent, MemoryGateway, Clock],
) -> None:
    a, gw, _ = agent
    gw.answer = answer(3, replica("m-1", [0]))
    await a.poll(0)
    await a.converge()
    gw.failure = GatewayUnreachable("no gateway answered: 503")
    with pytest.raises(GatewayUnreachable):
        await a.poll(0)
    assert await a.converge() == ([], [])
    assert a.running["m-1"].proc.exit_code() is None


async def test_an_engine_that_keeps_dying_is_left_failed_and_says_why(
    agent: tuple[Agent, MemoryGateway, Clock], monkeypatch: pytest.MonkeyPatch,
) -> None:
    a, gw, clock = agent
    # Like a llama.cpp built for another CPU: it answers the health check,
    # then dies by SIGILL on its first real request.
    monkeypatch.setenv("FAKE_VLLM_DIE_ON_CHAT", "SIGILL")
    r = replica("m-1", [0, 1])
    gw.answer = answer(1, r)
    await a.poll(0)
    await a.converge()
    for death in range(1, health.CRASH_LOOP_DEATHS + 1):
        await observe_until(a, lambda: phase(a, "m-1") == "ready", f"ready before death {death}")
        entry = a.running["m-1"]
        leader = entry.proc.pid
        assert leader is not None
        workers = children(leader)
        assert workers
        with entry.proc.log_path.open("a") as log:  # an engine echoing its settings
            log.write(f"settings: api_key={r['key']}\n")
        with pytest.raises(aiohttp.ClientError):
            await chat(entry.proc.url, r["key"])
        await observe_until(a, lambda: phase(a, "m-1") == "failed", f"death {death} seen")
        detail = entry.detail
        assert "engine killed by SIGILL" in detail
        assert "api_key=***" in detail and r["key"] not in detail
        assert await gone(workers), "a dead engine's worker was left behind"
        await a.report()
        assert gw.phases() == {"m-1": "failed"}
        if death < health.CRASH_LOOP_DEATHS:
            assert f"({death} of {health.CRASH_LOOP_DEATHS} deaths allowed" in detail
            assert await a.converge() == ([], [])  # backoff first
            clock.now += health.backoff(death)
            assert await a.converge() == (["m-1"], [])
            assert phase(a, "m-1") == "starting"

    assert f"{health.CRASH_LOOP_DEATHS} deaths within 10 min" in detail
    assert "not restarted until its assignment changes" in detail
    clock.now += 3600
    assert await a.converge() == ([], [])
    await a.observe()
    assert phase(a, "m-1") == "failed" and a.running["m-1"].detail == detail

    # A new assignment for the replica (other GPUs) is a new start.
    gw.answer = answer(2, replica("m-1", [2]))
    assert await a.poll(0) == "changed"
    assert await a.converge() == (["m-1"], ["m-1"])
    assert phase(a, "m-1") == "starting"


def _hold(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The fake vLLM serving "m" waits before it binds its port until the
    returned folder's file "m" is removed (FAKE_VLLM_HOLD_DIR)."""
    hold = tmp_path / "hold"
    hold.mkdir()
    (hold / "m").touch()
    monkeypatch.setenv("FAKE_VLLM_HOLD_DIR", str(hold))
    return hold


async def test_an_engine_never_ready_is_stopped_at_the_start_timeout_until_left_failed(
    engines_env: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Like a vLLM hung in its load: it runs, but never binds its port.
    hold = _hold(tmp_path, monkeypatch)
    gw, clock = MemoryGateway(), Clock()
    a = Agent(replace(config(tmp_path), start_timeout=30.0), clock=clock, client=gw)
    await a.start()
    try:
        r = replica("m-1", [0])
        gw.answer = answer(1, r)
        await a.poll(0)
        for death in range(1, health.CRASH_LOOP_DEATHS + 1):
            assert await a.converge() == (["m-1"], [])
            entry = a.running["m-1"]
            pid = entry.proc.pid
            assert pid is not None
            assert await wait_for_log(entry.proc.log_path, "held until")
            clock.now += 29.9  # not before the timeout
            await a.observe()
            assert phase(a, "m-1") == "starting" and alive(pid)
            clock.now += 0.1
            await a.observe()
            assert phase(a, "m-1") == "failed" and not alive(pid)
            detail = entry.detail
            assert detail.startswith("not ready within 30 s of its start; stopped")
            assert "held until" in detail  # the last log lines say where it hung
            await a.report()
            assert gw.reports[-1][0]["phase"] == "failed"
            assert gw.reports[-1][0]["detail"] == detail
            if death < health.CRASH_LOOP_DEATHS:
                assert f"({death} of {health.CRASH_LOOP_DEATHS} deaths allowed" in detail
                assert not gw.reports[-1][0]["given_up"]
                assert await a.converge() == ([], [])  # backoff first
                clock.now += health.backoff(death)
        assert f"{health.CRASH_LOOP_DEATHS} deaths within 10 min" in detail
        assert gw.reports[-1][0]["given_up"]
        clock.now += 3600
        assert await a.converge() == ([], [])
        assert phase(a, "m-1") == "failed"

        # Once the load can finish, a new assignment starts it, and being
        # ready ends the clock: later observes never stop it.
        (hold / "m").unlink()
        gw.answer = answer(2, replica("m-1", [1]))
        await a.poll(0)
        assert await a.converge() == (["m-1"], ["m-1"])
        await observe_until(a, lambda: phase(a, "m-1") == "ready", "ready once released")
        clock.now += 3600
        await a.observe()
        assert phase(a, "m-1") == "ready"
    finally:
        await a.shutdown(stop_engines=True)


async def test_an_adopted_engine_gets_the_start_timeout_from_its_adoption(
    engines_env: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    _hold(tmp_path, monkeypatch)  # held for good: it only ever times out
    gw = MemoryGateway()
    gw.answer = answer(1, replica("m-1", [0]))
    async with started(tmp_path, gw, stop_engines=False) as first:
        await first.poll(0)
        await first.converge()
        pid = first.running["m-1"].proc.pid
        assert pid is not None
        assert await wait_for_log(first.running["m-1"].proc.log_path, "held until")

    clock = Clock()
    second = Agent(replace(config(tmp_path), start_timeout=30.0), clock=clock, client=gw)
    await second.start()
    try:
        assert second.running["m-1"].proc.pid == pid  # adopted, still loading
        await second.poll(0)
        assert await second.converge() == ([], [])
        clock.now += 29.9
        await second.observe()
        assert phase(second, "m-1") == "starting" and alive(pid)
        clock.now += 0.1
        await second.observe()
        assert phase(second, "m-1") == "failed" and not alive(pid)
        assert second.running["m-1"].detail.startswith("not ready within 30 s")
        assert json.loads((tmp_path / "agent" / "engines.json").read_text()) == []
    finally:
        await second.shutdown(stop_engines=True)


def logged(path: Path, text: str) -> bool:
    return path.exists() and text in path.read_text(errors="replace")


async def wait_for_log(path: Path, text: str, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while not logged(path, text):
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.05)
    return True


async def test_a_ready_replica_survives_failed_liveness_probes_up_to_the_threshold(
    agent: tuple[Agent, MemoryGateway, Clock],
) -> None:
    a, gw, _ = agent
    gw.answer = answer(1, replica("m-1", [0]))
    await a.poll(0)
    await a.converge()
    await observe_until(a, lambda: phase(a, "m-1") == "ready", "ready")
    pid = a.running["m-1"].proc.pid
    assert pid is not None
    os.kill(pid, signal.SIGSTOP)  # alive, but answers nothing: a long stall
    try:
        for _ in range(health.LIVENESS_FAILURES - 1):
            await a.observe()
            assert phase(a, "m-1") == "ready"
        await a.observe()
        assert phase(a, "m-1") == "starting"
        assert "liveness probes failed in a row" in a.running["m-1"].detail
    finally:
        os.kill(pid, signal.SIGCONT)
    await observe_until(a, lambda: phase(a, "m-1") == "ready", "ready again")
    assert a.running["m-1"].proc.pid == pid  # the same engine: not restarted


@pytest.fixture
async def gateways() -> AsyncIterator[tuple[list[str], dict[str, Any]]]:
    """Two real HTTP gateways in-process; `answers[url]` is what each says:
    an HTTP status, or a dict served as JSON."""
    answers: dict[str, Any] = {}
    runners, urls = [], []
    for _ in range(2):
        async def handle(request: web.Request) -> web.Response:
            said = answers[f"http://{request.host}"]
            if isinstance(said, int):
                return web.json_response({"title": "no"}, status=said)
            return web.json_response(said)

        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", handle)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        runners.append(runner)
        urls.append(f"http://127.0.0.1:{port}")
    try:
        yield urls, answers
    finally:
        for r in runners:
            await r.cleanup()


async def test_the_http_client_moves_on_from_a_503_and_names_a_refusal(
    gateways: tuple[list[str], dict[str, Any]], engines_env: str, tmp_path: Path,
) -> None:
    urls, answers = gateways
    client = GatewayClient(urls, "node-1", "t")
    a = Agent(config(tmp_path, urls), client=client)
    await a.start()
    try:
        # The first gateway's state has not loaded: it answers 503, not [].
        answers[urls[0]], answers[urls[1]] = 503, answer(7, replica("m-1", [0]))
        assert await a.poll(0) == "changed"
        assert await a.converge() == (["m-1"], [])
        answers[urls[1]] = 503
        with pytest.raises(GatewayUnreachable, match="no gateway answered"):
            await a.poll(0)
        assert await a.converge() == ([], [])
        assert a.running["m-1"].proc.exit_code() is None
        # A 4xx is the gateway refusing this request, not an outage.
        answers[urls[0]] = answers[urls[1]] = 400
        with pytest.raises(GatewayRefused,
                           match=r"gateway http://127\.0\.0\.1:\d+ refused the request: 400"):
            await a.heartbeat()
    finally:
        await a.shutdown(stop_engines=True)


async def test_reports_fit_the_gateways_caps(agent: tuple[Agent, MemoryGateway, Clock]) -> None:
    """A real agent is never refused for its own report's size
    (docs/design/security.md): a long detail is cut to its start and
    end, extra GPUs and a long discovery note are left out."""
    a, gw, _ = agent
    gw.answer = answer(1, replica("m-1", [0]))
    assert await a.poll(0) == "changed"
    await a.converge()
    a.running["m-1"].detail = "engine died\n" + "a log line\n" * 2000 + "the last line"
    assert await a.report()
    sent = gw.reports[-1][0]
    assert len(sent["detail"]) == MAX_DETAIL, len(sent["detail"])
    assert sent["detail"].startswith("engine died") and sent["detail"].endswith("the last line")
    ReplicaStatus.model_validate(sent)

    hw = Hardware(gpus=declared(MAX_GPUS + 8), source="none (" + "why " * 1000 + ")")
    node = NodeInfo(name="node-1", **hw.node_fields())
    assert len(node.gpus) == MAX_GPUS and len(node.gpu_discovery) == MAX_TEXT
