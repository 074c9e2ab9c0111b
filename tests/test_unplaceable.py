"""A model no node can take is refused at once, with the leader's reasons,
not held for a replica that will never come (docs/design/placement.md and
docs/design/routing.md, "Scale from zero"). In process: the store, a gateway's
mirror and publisher, the /v1 proxy over the table it fills, an engine
stand-in; and the leader's own plan() over the same state, which the
gateway's answer must agree with."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from app.control import state as s
from app.control.keys import SecretRing
from app.control.mirror import Mirror
from app.control.placement.agentversion import default_window
from app.control.plan.planner import PlanInput, PlanPolicy, plan
from app.gateway.publish import Publisher, Timing
from app.router.timeouts import Timeouts
from app.store.embedded import EmbeddedStore
from tests.support.procs import until
from tests.support.proxy_rig import CLIENT_KEY, Rig, hash_key, started

SECRET = "unplaceable-test-secret-0123456789"
# Started on demand: a request is what places its replica (scale from zero).
LAZY = s.StoredModel(name="lazy", model="acme/lazy", gpus=1,
                     replicas=s.ReplicaRange(min=0, max=1), idle_timeout=600)
NODE = s.NodeInfo(name="n", gpus=[s.GpuInfo(index=0, memory_mib=81920)], engines=["vllm"])


class Fleet:
    """A gateway's view of a fleet in a real (embedded) store: its mirror
    and publisher filling the rig's route table."""

    def __init__(self, store: EmbeddedStore, rig: Rig) -> None:
        self.store, self.rig = store, rig
        self.mirror = Mirror(store)
        self.window = default_window()
        Publisher(self.mirror, rig.table, SecretRing(SECRET), self.window,
                  timing=Timing(timer=lambda: 0.0))  # never paced

    async def put(self, key: str, value: s.BaseModel) -> None:
        rev = await self.store.put(key, value.model_dump_json().encode())
        assert await self.mirror.wait_for(rev, 2)
        await asyncio.sleep(0)  # the publish is scheduled with call_soon

    async def delete(self, key: str) -> None:
        await self.store.delete(key)
        assert await self.mirror.wait_for((await self.store.range(key)).revision, 2)
        await asyncio.sleep(0)

    def leader_says(self, name: str) -> str:
        """Why the leader's pass leaves a replica of `name` unplaced, were
        it wanted (min 1): plan() over the same mirrored state."""
        models = dict(self.mirror.models())
        models[name] = models[name].model_copy(update={"replicas": s.ReplicaRange(min=1,
                                                                                max=1)})
        p = plan(PlanInput(
                models, self.mirror.nodes(), self.mirror.replicas(), now=time.time(),
                nodeconfs=self.mirror.nodeconfs(), quotas=self.mirror.quotas()),
                PlanPolicy(drain_seconds=30, new_suffix=lambda: "x", agent_window=self.window))
        return p.unplaced.get(name, "")


@pytest.fixture
async def fleet(tmp_path: Path) -> AsyncIterator[Fleet]:
    store = await EmbeddedStore.open(tmp_path / "state.db", expiry_interval=None)
    # A held request waits the default 300 s: a test that sees it held fails.
    timeouts = Timeouts(connect=2, first_byte=10, idle=10, request=600, cooldown=5,
                        cold_start=300, cold_start_held=4)
    async with started(Rig(timeouts)) as rig:
        f = Fleet(store, rig)
        f.mirror.start()
        try:
            await f.put(s.KEYS + hash_key(CLIENT_KEY), s.ClientKey(id="k1", name="t", created=0))
            await f.put(s.MODELS + "lazy", LAZY)
            await f.put(s.NODES + "n", NODE)
            yield f
        finally:
            await f.mirror.stop()
            await store.close()


async def test_a_model_no_node_can_take_is_refused_at_once_until_a_node_can(
        fleet: Fleet) -> None:
    """One node, cordoned: the leader says `n: cordoned`; a request is
    answered 503 at once saying so, not held for 300 s. Uncordoned, the
    model is placeable again: a request is held until its replica is
    ready, then answered. Seen to fail: the gateway's placement left out
    node confs, found room on n, and held the request."""
    rig = fleet.rig
    await fleet.put(s.NODECONF + "n", s.NodeConf(cordoned=True))
    assert fleet.leader_says("lazy") == "n: cordoned"
    call = asyncio.create_task(rig.chat("lazy"))
    done, _ = await asyncio.wait({call}, timeout=5)
    assert done, "held for a model no node can take"
    resp = call.result()
    assert resp.status_code == 503, resp.text
    err = resp.json()["error"]
    assert err["code"] == "no_ready_replica" and err["type"] == "service_unavailable"
    assert err["message"] == "No replica of 'lazy' is ready: no replica is placed: n: cordoned"
    assert not rig.table.holdable("lazy")

    # Uncordoned (an operator's edit: published at once, never paced).
    await fleet.put(s.NODECONF + "n", s.NodeConf())
    await until(lambda: rig.table.holdable("lazy"), "lazy placeable again", 2)
    assert fleet.leader_says("lazy") == ""
    await held_then_served(fleet)


async def held_then_served(fleet: Fleet) -> None:
    """A request for "lazy" is held, then answered once its replica (on n)
    is ready."""
    rig = fleet.rig
    up = await rig.upstream("lazy-1")
    call = asyncio.create_task(rig.chat("lazy"))
    await until(lambda: rig.table.held() == {"lazy": 1}, "the request held", 2)
    await fleet.put(s.REPLICAS + "lazy-1", s.Replica(id="lazy-1", model="lazy", node="n",
                                                     gpus=[0], weights="acme/lazy"))
    await fleet.put(s.STATUS + "lazy-1", s.ReplicaStatus(id="lazy-1", node="n", phase="ready",
                                                         url=up.url))
    resp = await asyncio.wait_for(call, 5)
    assert resp.status_code == 200 and resp.headers["x-llmgw-replica"] == "lazy-1"


@pytest.mark.parametrize("case", ["drained", "pool", "quota", "old agent"])
async def test_what_the_leader_cannot_place_the_gateway_refuses_in_its_words(
        fleet: Fleet, case: str) -> None:
    """Each input of the leader's placement that leaves a model without a
    node (node confs: a drain, a pool; a quota over every model's replicas;
    the agent window): the gateway answers at once with the leader's own
    reasons. Seen to fail for the drain, the pool and the quota: held."""
    rig = fleet.rig
    if case == "drained":
        await fleet.put(s.NODECONF + "n", s.NodeConf(cordoned=True, draining=True))
    elif case == "pool":
        await fleet.put(s.NODECONF + "n", s.NodeConf(pool="research"))
    elif case == "quota":
        await fleet.put(s.QUOTAS + "team", s.Quota(max_gpus=1))
        await fleet.put(s.MODELS + "lazy", LAZY.model_copy(update={"quota": "team"}))
        # Another model of the scope holds its one GPU, on another node.
        await fleet.put(s.MODELS + "busy", s.StoredModel(name="busy", model="acme/busy",
                                                        gpus=1, quota="team"))
        await fleet.put(s.NODES + "n2", NODE.model_copy(update={"name": "n2"}))
        await fleet.put(s.REPLICAS + "busy-1", s.Replica(id="busy-1", model="busy", node="n2",
                                                         gpus=[0], weights="acme/busy"))
    else:
        await fleet.put(s.NODES + "n", NODE.model_copy(update={"version": "0.0.1"}))
    said = fleet.leader_says("lazy")
    assert said, "the leader places it: not a refusal"
    call = asyncio.create_task(rig.chat("lazy"))
    done, _ = await asyncio.wait({call}, timeout=5)
    assert done, f"held for a model the leader cannot place: {said}"
    resp = call.result()
    assert resp.status_code == 503, resp.text
    assert resp.json()["error"]["message"] == (
        f"No replica of 'lazy' is ready: no replica is placed: {said}")
    assert not rig.table.holdable("lazy")


@pytest.mark.parametrize("case", ["labels", "cleared GPU", "second profile"])
async def test_what_the_leader_can_place_the_gateway_holds_for(
        fleet: Fleet, case: str) -> None:
    """The other way round: what the leader places from an input the
    gateway left out (a node's labels and an admin's cleared GPU are in its
    conf; a model's second profile) is held for, then served, not refused.
    Seen to fail for each: 503 at once, "no replica is placed: ..."."""
    if case == "labels":
        await fleet.put(s.NODECONF + "n", s.NodeConf(labels={"zone": "eu"}))
        await fleet.put(s.MODELS + "lazy", LAZY.model_copy(update={"gpus": None, "profiles": [
            s.Profile(gpus=1, node_selector={"zone": "eu"})]}))
    elif case == "cleared GPU":
        sick = s.GpuInfo(index=0, memory_mib=81920, health="unhealthy",
                         health_reason="Xid 79")
        await fleet.put(s.NODES + "n", NODE.model_copy(update={"gpus": [sick]}))
        await fleet.put(s.NODECONF + "n", s.NodeConf(gpu_cleared={0: "Xid 79"}))
    else:  # the first profile wants a pool no node is in
        await fleet.put(s.MODELS + "lazy", LAZY.model_copy(update={"gpus": None, "profiles": [
            s.Profile(name="big", gpus=1, pool="h100"), s.Profile(name="small", gpus=1)]}))
    assert fleet.leader_says("lazy") == ""
    await held_then_served(fleet)


async def test_the_admin_api_and_metrics_say_what_the_leader_decides(tmp_path: Path) -> None:
    """A model whose first profile fits nowhere and whose second fits on n:
    the leader places it (any profile, in order), so neither the model's
    health (GET /admin/models) nor `llmgw_model_unplaceable` says it is
    unplaceable. A gateway that never leads, so that nothing is placed and
    both are asked. Seen to fail: "unplaceable", n: in pool default, the
    profile wants pool h100 (the first profile alone)."""
    from app.gateway.main import create_app
    from app.gateway.settings import Settings
    from tests.support.scrape import model_status_and_metrics

    admin = "unplaceable-admin-token-0123456"
    app = create_app(Settings(data_dir=tmp_path / "gw", gateway_id="gw", admin_token=admin,
                              secret=SECRET, local_agent=False), campaign=False)
    gw = app.state.gateway
    await gw.start()
    try:
        two = LAZY.model_copy(update={"name": "two", "gpus": None, "replicas": None,
                                      "idle_timeout": None, "profiles": [
                                          s.Profile(name="big", gpus=1, pool="h100"),
                                          s.Profile(name="small", gpus=1)]})
        status, metrics = await model_status_and_metrics(
            app, gw, admin, "two", ((s.MODELS + "two", two), (s.NODES + "n", NODE)))
        assert (status["replicas"], status["wanted"]) == (0, 1)
        assert status["unplaced"] is None, status
        assert status["health"]["state"] == "degraded", status
        assert metrics[("llmgw_model_unplaceable", (("model", "two"),))] == 0
    finally:
        await gw.stop()
