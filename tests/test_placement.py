"""Placement and the reconcile plan are pure: tested by calling them."""

from __future__ import annotations

import itertools

from app.control import state as s
from app.control.placement import Fit, NoFit, place
from app.control.plan import Plan, plan


def gpu_node(name: str, gpus: int) -> s.NodeInfo:
    return s.NodeInfo(name=name, gpus=[s.GpuInfo(index=i) for i in range(gpus)],
                      engines=["vllm"])


def cpu_node(name: str) -> s.NodeInfo:
    return s.NodeInfo(name=name, engines=["llamacpp"])


def model(name: str, **kw: object) -> s.StoredModel:
    return s.StoredModel(name=name, **{"model": f"org/{name}", **kw})  # type: ignore[arg-type]


def suffixes() -> itertools.count[int]:
    return itertools.count(1)


def run_plan(models: list[s.StoredModel], nodes: list[s.NodeInfo],
             replicas: dict[str, s.Replica], now: float = 100.0,
             absent_for: dict[str, float] | None = None, node_grace: float = 0.0) -> Plan:
    counter = suffixes()
    return plan({m.name: m for m in models}, {n.name: n for n in nodes}, replicas,
                now=now, drain_seconds=2.0, new_suffix=lambda: f"{next(counter):04d}",
                absent_for=absent_for, node_grace=node_grace)


def test_places_min_replicas_spread_over_nodes() -> None:
    p = run_plan([model("m", gpus=1, replicas={"min": 2, "max": 2})],
                 [gpu_node("n1", 2), gpu_node("n2", 2)], {})
    assert [(r.node, r.gpus) for r in p.create] == [("n1", [0]), ("n2", [0])]


def test_fills_gpus_without_overlap_and_says_why_it_cannot() -> None:
    nodes = {"n1": gpu_node("n1", 2)}
    spec = model("m", gpus=2)
    fit = place("m", spec, nodes, {})
    assert fit == Fit("n1", [0, 1])
    taken = {"r1": s.Replica(id="r1", model="x", node="n1", gpus=[1], weights="w")}
    nofit = place("m", spec, nodes, taken)
    assert isinstance(nofit, NoFit)
    assert nofit.reasons == {"n1": "needs 2 free GPUs, has 1 of 2"}


def test_llamacpp_goes_to_cpu_nodes_only() -> None:
    nodes = {"g": s.NodeInfo(name="g", gpus=[s.GpuInfo(index=0)], engines=["vllm", "llamacpp"]),
             "c": cpu_node("c")}
    fit = place("m", model("m", engine="llamacpp"), nodes, {})
    assert fit == Fit("c", [])
    nofit = place("m", model("m", engine="llamacpp"), {"g": nodes["g"]}, {})
    assert isinstance(nofit, NoFit) and "CPU nodes" in nofit.reasons["g"]


def test_deleted_model_drains_then_deletes_after_the_drain_period() -> None:
    rep = s.Replica(id="r1", model="gone", node="n1", gpus=[0], weights="org/gone")
    p = run_plan([], [gpu_node("n1", 1)], {"r1": rep})
    assert p.drain == ["r1"] and p.delete == []
    draining = rep.model_copy(update={"draining_since": 99.0})
    assert run_plan([], [gpu_node("n1", 1)], {"r1": draining}, now=100.0).delete == []
    assert run_plan([], [gpu_node("n1", 1)], {"r1": draining}, now=101.5).delete == ["r1"]


def test_replicas_of_a_vanished_node_are_deleted_and_replaced_once_its_grace_is_over() -> None:
    rep = s.Replica(id="r1", model="m", node="dead", gpus=[0], weights="org/m")
    # Within the grace the replica stays, counts for its model, and holds its GPU.
    kept = run_plan([model("m")], [gpu_node("n2", 1)], {"r1": rep},
                    absent_for={"dead": 9.9}, node_grace=10)
    assert kept.empty and kept.unplaced == {}
    p = run_plan([model("m")], [gpu_node("n2", 1)], {"r1": rep},
                 absent_for={"dead": 10.0}, node_grace=10)
    assert p.delete == ["r1"]
    assert [r.node for r in p.create] == ["n2"]
    # With no grace (the default), at once.
    assert run_plan([model("m")], [gpu_node("n2", 1)], {"r1": rep}).delete == ["r1"]


def test_a_kept_replica_of_an_absent_node_is_still_drained_when_its_model_goes() -> None:
    rep = s.Replica(id="r1", model="m", node="away", gpus=[0], weights="org/m")
    p = run_plan([], [], {"r1": rep}, absent_for={"away": 1.0}, node_grace=10)
    assert p.drain == ["r1"] and p.delete == []


def test_changed_spec_replaces_the_replica() -> None:
    rep = s.Replica(id="r1", model="m", node="n1", gpus=[0], weights="org/old")
    p = run_plan([model("m")], [gpu_node("n1", 2)], {"r1": rep})
    assert p.drain == ["r1"]
    assert [(r.node, r.gpus) for r in p.create] == [("n1", [1])]
    # A new revision of the same weights is a change too, and carried to the replica.
    same = rep.model_copy(update={"weights": "org/m"})
    p = run_plan([model("m", revision="v2")], [gpu_node("n1", 2)], {"r1": same})
    assert p.drain == ["r1"] and [r.weights_revision for r in p.create] == ["v2"]


def test_steady_state_plans_nothing() -> None:
    rep = s.Replica(id="r1", model="m", node="n1", gpus=[0], weights="org/m")
    assert run_plan([model("m")], [gpu_node("n1", 1)], {"r1": rep}).empty
