"""Sick GPUs in placement and the plan (app/control/gpuhealth.py), pure:
tested by calling them."""

from __future__ import annotations

import pytest

from app.control import state as s
from app.control.gpuhealth import NoSuchGpu, cleared, sick_gpus
from app.control.placement.placer import place
from app.control.placement.verdict import Fit, NoFit
from tests.test_placement import model, run_plan

XID = "XID 79: GPU has fallen off the bus (at 2026-11-18T11:06:40Z)"


def node(name: str, gpus: int, sick: dict[int, str] | None = None) -> s.NodeInfo:
    bad = sick or {}
    return s.NodeInfo(name=name, engines=["vllm"], gpus=[
        s.GpuInfo(index=i, health="unhealthy" if i in bad else "ok",
                  health_reason=bad.get(i, "")) for i in range(gpus)])


def replica(rid: str, node_: str, gpu: int) -> s.Replica:
    return s.Replica(id=rid, model="m", node=node_, gpus=[gpu], weights="org/m")


def test_a_sick_gpu_is_not_placed_on_and_the_refusal_says_so() -> None:
    spec = model("m", gpus=1)
    assert place("m", spec, {"n1": node("n1", 2, {0: XID})}, {}) == Fit("n1", [1])
    nofit = place("m", spec, {"n1": node("n1", 1, {0: XID})}, {})
    assert isinstance(nofit, NoFit)
    assert nofit.texts() == {"n1": "needs 1 free GPUs, has 0 of 1; GPU 0 unhealthy"}


def test_a_cleared_gpu_is_placed_on_until_it_reports_another_fault() -> None:
    sick = node("n1", 1, {0: XID})
    conf = cleared(s.NodeConf(), sick, "n1", 0)
    assert conf.gpu_cleared == {0: XID}
    assert sick_gpus(sick, conf) == {}
    assert place("m", model("m", gpus=1), {"n1": sick}, {}, nodeconfs={"n1": conf}) == Fit(
        "n1", [0])
    again = node("n1", 1, {0: "3 uncorrected ECC errors since the GPU's last reset"})
    assert sick_gpus(again, conf) == {0: "3 uncorrected ECC errors since the GPU's last reset"}
    assert isinstance(place("m", model("m", gpus=1), {"n1": again}, {},
                            nodeconfs={"n1": conf}), NoFit)


def test_clearing_a_healthy_gpu_drops_its_entry_and_an_unknown_one_is_refused() -> None:
    conf = s.NodeConf(gpu_cleared={0: XID, 7: "gone"})
    assert cleared(conf, node("n1", 2), "n1", 0).gpu_cleared == {}  # 7: no such GPU now
    with pytest.raises(NoSuchGpu, match="reports no GPU 5"):
        cleared(conf, node("n1", 2), "n1", 5)
    with pytest.raises(NoSuchGpu, match="not heard from"):
        cleared(conf, None, "n1", 0)


def test_the_replica_on_a_sick_gpu_moves_new_first_when_it_still_serves() -> None:
    spec = model("m", gpus=1)
    reps = {"m-1": replica("m-1", "n1", 0)}
    nodes = [node("n1", 2, {0: XID}), node("n2", 1)]
    p = run_plan([spec], nodes, reps, ready=("m-1",))
    # Its replacement goes to a healthy GPU (the spread prefers n2, which
    # has no replica of m); the old one serves until that one is ready.
    assert [(r.node, r.gpus) for r in p.create] == [("n2", [0])]
    assert p.drain == []
    new = p.create[0]
    p2 = run_plan([spec], nodes, {**reps, new.id: new}, ready=("m-1", new.id))
    assert p2.drain == ["m-1"] and p2.create == []
    assert p2.drain_reasons == {"m-1": f"GPU 0 of n1 is unhealthy: {XID}"}


def test_a_replica_on_a_sick_gpu_that_serves_nothing_goes_at_once() -> None:
    reps = {"m-1": replica("m-1", "n1", 0)}
    p = run_plan([model("m", gpus=1)], [node("n1", 2, {0: XID})], reps)
    assert [(r.node, r.gpus) for r in p.create] == [("n1", [1])]
    assert p.drain == ["m-1"]


def test_a_cleared_gpu_keeps_its_replica() -> None:
    sick = node("n1", 1, {0: XID})
    conf = cleared(s.NodeConf(), sick, "n1", 0)
    p = run_plan([model("m", gpus=1)], [sick], {"m-1": replica("m-1", "n1", 0)},
                 ready=("m-1",), nodeconfs={"n1": conf})
    assert p.empty


def test_a_conf_refuses_an_oversized_cleared_reason() -> None:
    with pytest.raises(ValueError, match="longer than"):
        s.NodeConf(gpu_cleared={0: "x" * 5000})
