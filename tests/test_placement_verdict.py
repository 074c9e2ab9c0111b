"""Placement's verdict as data (app/control/placement/verdict.py): each node
refused is FILTERED by a named constraint or EXHAUSTED on a named dimension,
counted per reason with a few nodes named, however large the fleet
(docs/design/placement.md). Pure functions, so each case is one call."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from app.control import state as s
from app.control.placement.agentversion import Window
from app.control.placement.fleet import model_health
from app.control.placement.placer import Placer, place_any
from app.control.placement.verdict import Constraint, Dimension, NoFit

GIB = 1024


def gpu_node(name: str, gpus: int = 1, **kw: Any) -> s.NodeInfo:
    return s.NodeInfo(name=name, engines=["vllm", "llamacpp"],
                      gpus=[s.GpuInfo(index=i, memory_mib=24 * GIB) for i in range(gpus)], **kw)


def model(quota: str | None = None, **profile: Any) -> s.StoredModel:
    return s.StoredModel(name="m", model="org/m", profiles=[s.Profile(**profile)], quota=quota)


def refused(nodes: list[s.NodeInfo], spec: s.StoredModel, *,
            confs: dict[str, s.NodeConf] | None = None,
            replicas: dict[str, s.Replica] | None = None,
            quotas: dict[str, s.Quota] | None = None,
            window: Window | None = None) -> NoFit:
    placer = Placer({n.name: n for n in nodes}, replicas or {}, nodeconfs=confs or {},
                    quotas=quotas or {}, models={"m": spec}, agent_versions=window)
    got, _ = place_any(placer, "m", spec)
    assert isinstance(got, NoFit), got
    return got


def held(node: str, gpus: list[int], model: str = "other") -> dict[str, s.Replica]:
    return {f"{model}-1": s.Replica(id=f"{model}-1", model=model, node=node, gpus=gpus,
                                    weights=f"org/{model}")}


SICK = s.GpuInfo(index=0, memory_mib=24 * GIB, health="unhealthy", health_reason="XID 79")

# Each case: one node, refused for one reason.
CASES: dict[str, tuple[Constraint | Dimension, dict[str, Any]]] = {
    "agent version outside the window": (Constraint.AGENT_VERSION, {
        "nodes": [gpu_node("n", version="0.1.0")], "window": Window("1.0.0", "1.2.0")}),
    "draining": (Constraint.DRAINING, {"confs": {"n": s.NodeConf(draining=True)}}),
    "cordoned": (Constraint.CORDONED, {"confs": {"n": s.NodeConf(cordoned=True)}}),
    "another pool": (Constraint.POOL, {"confs": {"n": s.NodeConf(pool="batch")}}),
    "labels": (Constraint.NODE_SELECTOR, {"spec": model(node_selector={"zone": "eu"})}),
    "engine missing": (Constraint.ENGINE, {
        "nodes": [s.NodeInfo(name="n", engines=["llamacpp"], gpus=[s.GpuInfo(index=0)])]}),
    "engine build none": (Constraint.ENGINE_BUILD, {
        "confs": {"n": s.NodeConf(engine_build="none")}}),
    "llama.cpp on a GPU node": (Constraint.CPU_NODE, {"spec": model(engine="llamacpp")}),
    "the free GPU is sick": (Constraint.SICK_GPU, {
        "nodes": [s.NodeInfo(name="n", engines=["vllm"], gpus=[SICK])]}),
    "every GPU held": (Dimension.GPUS, {"replicas": held("n", [0])}),
    "too little memory": (Dimension.GPU_MEMORY, {"spec": model(gpu_memory_gib=40)}),
    "quota full": (Dimension.QUOTA, {
        "spec": model(quota="team"), "quotas": {"team": s.Quota(max_gpus=0)}}),
}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_each_refusal_is_a_named_filter_or_exhaustion(
        case: tuple[Constraint | Dimension, dict[str, Any]]) -> None:
    reason, given = case
    got = refused(given.get("nodes", [gpu_node("n")]), given.get("spec", model()),
                  confs=given.get("confs"), replicas=given.get("replicas"),
                  quotas=given.get("quotas"), window=given.get("window"))
    (why,) = got.refusals["n"]
    assert why.reason is reason and why.filtered == isinstance(reason, Constraint)
    filtered, exhausted = got.counts()
    assert (filtered, exhausted) == (({reason: 1}, {}) if isinstance(reason, Constraint)
                                     else ({}, {reason: 1}))
    said = got.as_dict()
    key = "nodes_filtered" if isinstance(reason, Constraint) else "nodes_exhausted"
    assert said["nodes_evaluated"] == 1 and said[key] == {reason.value: 1}
    (group,) = said["reasons"]
    assert group["count"] == 1 and group["nodes"] == ["n"]
    assert group["constraint" if isinstance(reason, Constraint) else "dimension"] == reason.value
    # The text a client is told is the same as the detail, said at the edge.
    assert said["text"] == str(got) == f"n: {why.detail}" == f"n: {group['detail']}"


def test_a_sick_gpu_on_a_full_node_is_exhaustion_not_a_filter() -> None:
    """Were the sick GPU healthy the node would still be short (2 wanted,
    1 held): GPUs, the dimension, are what it lacks; the text names the
    sick GPU either way."""
    node = s.NodeInfo(name="n", engines=["vllm"], gpus=[SICK, s.GpuInfo(index=1)])
    (why,) = refused([node], model(gpus=2), replicas=held("n", [1])).refusals["n"]
    assert (why.reason, why.detail) == (
        Dimension.GPUS, "needs 2 free GPUs, has 0 of 2; GPU 0 unhealthy")
    # One wanted: the sick GPU alone keeps it out, a filter.
    (why,) = refused([node], model(gpus=1), replicas=held("n", [1])).refusals["n"]
    assert (why.reason, why.detail) == (
        Constraint.SICK_GPU, "needs 1 free GPUs, has 0 of 2; GPU 0 unhealthy")


def test_each_profile_tried_is_counted_under_its_own_name() -> None:
    spec = s.StoredModel(name="m", model="org/m", profiles=[
        s.Profile(name="big", gpus=2), s.Profile(name="eu", node_selector={"zone": "eu"})])
    got = refused([gpu_node("a"), gpu_node("b")], spec)
    assert got.counts() == ({Constraint.NODE_SELECTOR: 2}, {Dimension.GPUS: 2})
    assert [(g["profile"], g.get("constraint") or g["dimension"], g["count"])
            for g in got.as_dict()["reasons"]] == [
        ("eu", "node_selector", 2), ("big", "gpus", 2)]
    assert got.texts()["a"] == ("big: needs 2 free GPUs, has 1 of 1; "
                                "eu: labels do not match node_selector zone=eu")


def test_a_10000_node_fleet_s_verdict_stays_small() -> None:
    """The counts are exact, the names bounded: a full 10,000-node fleet's
    verdict is a few hundred bytes of JSON, not a megabyte."""
    nodes = [gpu_node(f"node-{i:05d}") for i in range(10_000)]
    confs = {f"node-{i:05d}": s.NodeConf(cordoned=True) for i in range(0, 10_000, 4)}
    replicas = {f"r{i}": s.Replica(id=f"r{i}", model="x", node=f"node-{i:05d}", gpus=[0],
                                   weights="org/x")
                for i in range(10_000) if i % 4}
    got = refused(nodes, model(), confs=confs, replicas=replicas)
    assert got.evaluated == 10_000
    assert got.counts() == ({Constraint.CORDONED: 2_500}, {Dimension.GPUS: 7_500})
    said = got.as_dict()
    assert [len(g["nodes"]) for g in said["reasons"]] == [5, 5]
    assert said["reasons"][0]["nodes"] == [f"node-{i:05d}" for i in range(0, 20, 4)]
    assert len(json.dumps(said)) < 1_000, len(json.dumps(said))


def test_no_nodes_is_an_empty_verdict() -> None:
    got = NoFit({})
    assert (str(got), got.evaluated, got.counts()) == ("no nodes", 0, ({}, {}))
    assert got.as_dict() == {"nodes_evaluated": 0, "nodes_filtered": {}, "nodes_exhausted": {},
                             "reasons": [], "text": "no nodes"}


async def test_the_admin_api_gives_the_verdict_and_its_text(tmp_path: Path) -> None:
    """GET /admin/models: `unplaced` (the text, as before) and `placement`
    (the verdict as data), from the same decision /metrics reads."""
    from app.gateway.main import create_app
    from app.gateway.settings import Settings
    from tests.support.scrape import model_status_and_metrics

    admin = "verdict-admin-token-0123456789"
    app = create_app(Settings(data_dir=tmp_path / "gw", gateway_id="gw", admin_token=admin,
                              secret="verdict-test-secret-0123456789", local_agent=False),
                     campaign=False)
    gw = app.state.gateway
    await gw.start()
    try:
        one = s.StoredModel(name="one", model="acme/one", gpus=1)
        node = s.NodeInfo(name="n", gpus=[s.GpuInfo(index=0)], engines=["vllm"])
        status, metrics = await model_status_and_metrics(
            app, gw, admin, "one", ((s.MODELS + "one", one), (s.NODES + "n", node),
                                    (s.NODECONF + "n", s.NodeConf(cordoned=True))))
        assert status["unplaced"] == "n: cordoned", status
        assert status["placement"] == {
            "nodes_evaluated": 1, "nodes_filtered": {"cordoned": 1}, "nodes_exhausted": {},
            "reasons": [{"constraint": "cordoned", "count": 1, "nodes": ["n"],
                         "detail": "cordoned"}],
            "text": "n: cordoned"}, status
        assert metrics[("llmgw_model_unplaceable", (("model", "one"),))] == 1
    finally:
        await gw.stop()


def test_a_10000_node_fleet_s_health_stays_small() -> None:
    """A model's health (GET /admin/models' `status.health`) names the
    nodes its verdict names, each with its reason, not every node of the
    fleet: one reason per node was ~0.5 MB per waiting model there."""
    nodes = [gpu_node(f"node-{i:05d}") for i in range(10_000)]
    confs = {f"node-{i:05d}": s.NodeConf(cordoned=True) for i in range(0, 10_000, 4)}
    got = refused(nodes, model(), confs=confs, replicas={
        f"r{i}": s.Replica(id=f"r{i}", model="x", node=f"node-{i:05d}", gpus=[0],
                           weights="org/x") for i in range(10_000) if i % 4})
    health = model_health(model(), [], got).as_dict()
    assert len(json.dumps(health)) < 2_000, len(json.dumps(health))
    assert health["reasons"]["node-00000"] == "cordoned"
    assert health["reasons"]["node-00001"] == "needs 1 free GPUs, has 0 of 1"
    assert len(health["reasons"]) == 10
