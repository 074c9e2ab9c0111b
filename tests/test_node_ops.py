"""Node operations: a node's logs and model cache, read and pruned through any
gateway, which reaches the node's agent API (real gateways, agents, engines).
Log rotation and tails are tested in-process."""

from __future__ import annotations

import os
import signal
import socket
import stat
from pathlib import Path
from typing import Any

import httpx
import pytest

from app.agent import logfiles
from app.agent.engines import open_log
from app.control.keys import engine_key
from app.wire.masking import MASK, mask
from app.wire.tokens import node_token
from tests.support.procs import SECRET, Cluster, GatewayProc, put_model, wait_for, wait_ready


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_engine_log_rotation_keeps_the_engines_descriptor_writing(tmp_path: Path) -> None:
    """Copy-then-truncate: the engine's O_APPEND descriptor writes on at the
    start of the emptied file; copies shift, the oldest is dropped; all 0600."""
    log = tmp_path / "logs" / "r1.log"
    fd = open_log(log)  # as an engine's stdout
    try:
        for gen in range(4):
            os.write(fd, f"generation {gen}\n".encode() * 100)
            logfiles.rotate(log, keep=2)
        os.write(fd, b"after\n")
    finally:
        os.close(fd)
    assert log.read_text() == "after\n"  # no hole of zeros where the old content was
    assert log.with_name("r1.log.1").read_text() == "generation 3\n" * 100
    assert log.with_name("r1.log.2").read_text() == "generation 2\n" * 100
    assert not log.with_name("r1.log.3").exists()
    assert {mode(p) for p in log.parent.iterdir()} == {0o600}
    # A tail longer than the current file reaches into the copies.
    assert logfiles.tail(log, 3, keep=2) == ["generation 3", "generation 3", "after"]


def test_masking_covers_known_and_key_shaped_secrets() -> None:
    key = engine_key(SECRET, "m-1")
    other = engine_key(SECRET, "gone-replica")
    line = f"api_key={key} old={other} token=llmgw-node-{'a' * 40} client=sk-llmgw-{'x' * 43}"
    masked = mask(line, [key])
    assert key not in masked and other not in masked
    assert "llmgw-node-" not in masked and "sk-llmgw-x" not in masked
    assert masked.count(MASK) == 4


def admin(gw: GatewayProc) -> httpx.Client:
    c = gw.admin()
    c.timeout = httpx.Timeout(30)
    return c


def inventory(gw: GatewayProc, node: str) -> dict[str, Any] | None:
    with admin(gw) as c:
        found = [n for n in c.get("/admin/nodes").json() if n["name"] == node]
    return found[0] if found else None


def node_known(gw: GatewayProc, node: str) -> dict[str, Any] | None:
    """The node's inventory once it reports its agent API."""
    info = inventory(gw, node)
    return info if info and info["api_url"] else None


def test_logs_of_the_agent_and_of_a_replica_through_another_gateway(cluster: Cluster) -> None:
    gw_a = cluster.gateway("gw-a")
    gw_b = cluster.gateway("gw-b")
    cluster.agent("node-1", [gw_a], "--gpus", "1")
    put_model(gw_a, "m", {"model": "acme/m", "gpus": 1})
    rid = wait_ready(gw_a)["id"]
    info = wait_for(lambda: node_known(gw_b, "node-1"), 10, "node-1 with its API on gw-b")
    assert info["api_url"].startswith("http://127.0.0.1:")

    engine_log = cluster.tmp / "agent-node-1" / "logs" / f"{rid}.log"
    key = engine_key(SECRET, rid)
    with open(engine_log, "a") as f:  # an engine echoing its settings
        f.write(f"args: api_key={key}\n")

    with admin(gw_b) as c:
        r = c.get("/admin/nodes/node-1/logs", params={"source": "agent", "lines": 200})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["sources"] == sorted(["agent", rid])
        assert any("node API of node-1 at" in line for line in body["lines"]), body["lines"]

        r = c.get("/admin/nodes/node-1/logs", params={"source": rid})
        assert r.status_code == 200, r.text
        lines = r.json()["lines"]
        assert any("Application startup complete" in line for line in lines), lines
        assert lines[-1] == f"args: api_key={MASK}"
        assert key not in r.text

        r = c.get("/admin/nodes/node-1/logs", params={"source": rid, "lines": 2})
        assert len(r.json()["lines"]) == 2

        r = c.get("/admin/nodes/node-1/logs", params={"source": "nope"})
        assert r.status_code == 404 and r.json()["sources"] == sorted(["agent", rid]), r.text
        assert "'nope'" in r.json()["detail"]
        r = c.get("/admin/nodes/node-1/logs", params={"source": "../../../etc/passwd"})
        assert r.status_code == 404, r.text
        r = c.get("/admin/nodes/node-9/logs")
        assert r.status_code == 404 and "node-9" in r.json()["detail"], r.text
        r = c.get("/admin/nodes/node-1/logs", params={"lines": 0})
        assert r.status_code == 422, r.text
    assert httpx.get(gw_b.url + "/admin/nodes/node-1/logs").status_code == 401
    assert mode(engine_log) == 0o600
    assert mode(cluster.tmp / "agent-node-1" / "agent.log") == 0o600


def test_an_unreachable_agent_is_a_502_or_504_never_a_500(cluster: Cluster) -> None:
    gw = cluster.gateway("gw-a", node_api_timeout="1")
    agent = cluster.agent("node-1", [gw], "--gpus", "1")
    wait_for(lambda: node_known(gw, "node-1"), 15, "node-1 with its API")
    agent.signal(signal.SIGSTOP)  # a hung agent: connects (the kernel accepts), never answers
    try:
        with admin(gw) as c:
            r = c.get("/admin/nodes/node-1/logs")
        assert r.status_code == 504, r.text
        assert r.headers["content-type"] == "application/problem+json"
        assert "node-1" in r.json()["detail"] and "did not answer" in r.json()["detail"]
    finally:
        agent.signal(signal.SIGCONT)
    agent.signal(signal.SIGKILL)  # its node key lives on until the node TTL
    with admin(gw) as c:
        r = c.get("/admin/nodes/node-1/weights")
    assert r.status_code == 502, r.text
    assert "unreachable" in r.json()["detail"]

    # A node reporting no API (an older agent), or one elsewhere than its own
    # address: the gateway sends no node token there.
    token = {"Authorization": f"Bearer {node_token(SECRET, 'node-x')}"}
    for api_url, said in (("", "reports no agent API"),
                          ("http://127.0.0.2:9", "not on the node's address")):
        report = {"name": "node-x", "address": "127.0.0.1", "api_url": api_url}
        r = httpx.put(gw.url + "/agent/v1/nodes/node-x", json=report, headers=token)
        assert r.status_code == 200, r.text
        wait_for(lambda u=api_url: (inventory(gw, "node-x") or {}).get("api_url") == u,
                 5, "node-x's inventory")
        with admin(gw) as c:
            r = c.get("/admin/nodes/node-x/logs")
        assert r.status_code == 502 and said in r.json()["detail"], r.text


def make_cache(root: Path) -> tuple[Path, Path]:
    """A Hugging Face style cache, a folder outside it and a symlink out."""
    cache, outside = root / "hub", root / "outside"
    outside.mkdir(parents=True)
    (outside / "keep.txt").write_text("not the cache's")
    for name, size in (("models--acme--m", 1 << 20), ("models--other--x", 2048)):
        blobs = cache / name / "blobs"
        blobs.mkdir(parents=True)
        (blobs / "b1").write_bytes(b"w" * size)
        snap = cache / name / "snapshots" / "abc123"
        snap.mkdir(parents=True)
        (snap / "model.safetensors").symlink_to("../../blobs/b1")
    (cache / ".locks").mkdir()
    (cache / "models--evil").symlink_to(outside, target_is_directory=True)
    return cache, outside


def test_all_in_one_serves_its_own_nodes_logs(solo: Cluster) -> None:
    gw = solo.gateway("aio", local_gpus="1", local_node="local")
    wait_for(lambda: node_known(gw, "local"), 20, "the in-process agent's API")
    with admin(gw) as c:
        r = c.get("/admin/nodes/local/logs", params={"lines": 500})
    assert r.status_code == 200, r.text
    assert any("node API of local at" in line for line in r.json()["lines"])


def test_weights_listed_and_removed_only_inside_the_cache_and_never_in_use(
    cluster: Cluster,
) -> None:
    cache, outside = make_cache(cluster.tmp / "cache")
    gw = cluster.gateway("gw-a")
    cluster.agent("node-1", [gw], "--gpus", "1", "--cache-dir", str(cache))
    put_model(gw, "m", {"model": "acme/m", "gpus": 1})
    rid = wait_ready(gw)["id"]
    wait_for(lambda: node_known(gw, "node-1"), 10, "node-1 with its API")

    with admin(gw) as c:
        r = c.get("/admin/nodes/node-1/weights")
        assert r.status_code == 200, r.text
        entries = {e["path"]: e for e in r.json()["entries"]}
        assert set(entries) == {"models--acme--m", "models--other--x", "models--evil"}
        assert entries["models--acme--m"]["size"] == 1 << 20  # the blob once, not its link
        assert entries["models--acme--m"]["model"] == "acme/m"
        assert entries["models--acme--m"]["in_use_by"] == [rid]
        assert entries["models--other--x"]["in_use_by"] == []
        assert entries["models--other--x"]["last_used"] > 0

        def delete(*paths: str) -> httpx.Response:
            return c.request("DELETE", "/admin/nodes/node-1/weights", json={"paths": list(paths)})

        refused = {
            "../outside/keep.txt": (400, "'..'"),
            "models--other--x/../../outside": (400, "'..'"),
            "models--evil": (400, "symlink"),
            "models--evil/keep.txt": (400, "not inside the cache"),
            str(outside / "keep.txt"): (400, "not inside the cache"),
            "/etc/passwd": (400, "not inside the cache"),
            str(cache): (400, "not inside the cache"),
            "models--acme--m": (409, rid),
            "models--acme--m/blobs/b1": (409, rid),
            "models--nope": (404, "no such"),
        }
        for path, (status, said) in refused.items():
            r = delete(path)
            assert r.status_code == status, (path, r.text)
            assert r.json()["path"] == path and repr(path) in r.json()["detail"], r.text
            assert said in r.json()["detail"], r.text
        # All or nothing: one refused path removes none.
        r = delete("models--other--x", "models--acme--m")
        assert r.status_code == 409, r.text
        assert (cache / "models--other--x").exists()
        r = c.request("DELETE", "/admin/nodes/node-1/weights", json={"paths": []})
        assert r.status_code == 422, r.text

        r = delete("models--other--x")
        assert r.status_code == 200, r.text
        assert r.json()["removed"] == ["models--other--x"]
    assert not (cache / "models--other--x").exists()
    assert (outside / "keep.txt").read_text() == "not the cache's"
    assert (cache / "models--acme--m" / "blobs" / "b1").exists()


async def test_the_agent_rotates_engine_logs_past_the_cap(tmp_path: Path) -> None:
    from app.agent.agent import Agent
    from app.agent.config import AgentConfig
    from app.agent.engines import EngineProcess, EngineSpec
    from app.agent.nodeops import NodeOpsConfig
    from app.agent.running import Running

    agent = Agent(AgentConfig(
        gateways=["http://127.0.0.1:9"], node="n", token="t", gpus=[], engines=["vllm"],
        work_dir=tmp_path, advertise_host="127.0.0.1",
        ops=NodeOpsConfig(log_max_bytes=1000, log_keep=2)))
    logs = {}
    for rid, size in (("big", 1001), ("small", 1000)):
        spec = EngineSpec(replica_id=rid, model="m", weights="w", engine="vllm", gpus=(0,),
                          key="k")
        logs[rid] = tmp_path / "logs" / f"{rid}.log"
        os.close(open_log(logs[rid]))
        logs[rid].write_bytes(b"x" * size)
        agent.running[rid] = Running(EngineProcess(spec, "127.0.0.1", 9, logs[rid]))
    rotated = await agent.ops.rotate(e.proc.log_path for e in agent.running.values())
    assert rotated == [logs["big"]]
    assert logs["big"].stat().st_size == 0
    assert logs["big"].with_name("big.log.1").stat().st_size == 1001
    assert logs["small"].stat().st_size == 1000


async def test_an_agent_whose_api_port_is_taken_runs_on_without_its_api(
    tmp_path: Path, caplog: pytest.LogCaptureFixture,
) -> None:
    from app.agent.agent import Agent
    from app.agent.config import AgentConfig
    from app.agent.nodeops import NodeOpsConfig

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        agent = Agent(AgentConfig(
            gateways=["http://127.0.0.1:9"], node="n", token="t", gpus=[], engines=[],
            work_dir=tmp_path, advertise_host="127.0.0.1", ops=NodeOpsConfig(api_port=port)))
        await agent.start()
        try:
            assert agent.inventory().api_url == ""
            assert f"node API not served: cannot listen on 127.0.0.1:{port}" in caplog.text
        finally:
            await agent.shutdown()


class NoEngines:
    def engine_specs(self) -> list[Any]:
        return []


async def test_node_api_refuses_bad_requests_with_problems(tmp_path: Path) -> None:
    from app.agent.nodeapi import NodeApi, NodeApiConfig

    cache = tmp_path / "not-a-folder"
    cache.write_text("")
    api = NodeApi(NodeApiConfig(node="n", token="node-token", work_dir=tmp_path,
                                cache_dir=cache), NoEngines())
    url = await api.start("127.0.0.1", 0)
    try:
        async with httpx.AsyncClient(base_url=url, timeout=10) as c:
            r = await c.get("/node/v1/logs", headers={"Authorization": "Bearer wrong"})
            assert r.status_code == 401
            auth = {"Authorization": "Bearer node-token"}
            r = await c.get("/node/v1/logs", params={"lines": "x"}, headers=auth)
            assert r.status_code == 400 and "lines" in r.json()["detail"]
            r = await c.get("/node/v1/weights", headers=auth)
            assert r.status_code == 500 and r.json()["title"] == "Cache unreadable"
            r = await c.request("DELETE", "/node/v1/weights", content=b"{", headers=auth)
            assert r.status_code == 400 and r.json()["title"] == "Bad body"
            r = await c.request("DELETE", "/node/v1/weights", json={"paths": [1]}, headers=auth)
            assert r.status_code == 400
            r = await c.get("/node/v1/nothing", headers=auth)
            assert r.status_code == 404
            assert r.headers["content-type"].startswith("application/problem+json")
    finally:
        await api.stop()
