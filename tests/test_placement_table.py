"""Placement on realistic fleets, table-driven: each row a fleet, a model and
the GPUs chosen or every node's reason (docs/design/placement.md).
Pure functions, so each row is one call."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest

from app.control import state as s
from app.control.placement.displace import Displacement, displace
from app.control.placement.fleet import model_health, quota_report, quota_use
from app.control.placement.placer import place
from app.control.placement.verdict import Constraint, Fit, NoFit, Refusal

H100 = 81559  # MiB nvidia-smi reports for an H100 80GB
L40S = 46068
A10 = 23028


def node(name: str, *mib: int, engines: tuple[str, ...] = ("vllm",)) -> s.NodeInfo:
    return s.NodeInfo(name=name, engines=list(engines),  # type: ignore[arg-type]
                      gpus=[s.GpuInfo(index=i, memory_mib=m) for i, m in enumerate(mib)])


def h100x8(name: str) -> s.NodeInfo:
    return node(name, *[H100] * 8)


def cpu(name: str) -> s.NodeInfo:
    return node(name, engines=("llamacpp",))


def spec(quota: str | None = None, mn: int = 1, **profile: Any) -> s.StoredModel:
    return s.StoredModel(name="m", model="org/m", profiles=[s.Profile(**profile)],
                         replicas=s.ReplicaRange(min=mn, max=max(mn, 1)), quota=quota)


def rep(rid: str, model: str, on: str, gpus: list[int], draining: bool = False,
        profile: str = "default") -> s.Replica:
    return s.Replica(id=rid, model=model, node=on, gpus=gpus, weights=f"org/{model}",
                     profile=profile, draining_since=1.0 if draining else None)


@dataclass
class Row:
    nodes: list[s.NodeInfo]
    model: s.StoredModel
    want: Fit | dict[str, str]  # the fit, or NoFit's reasons
    replicas: list[s.Replica] = field(default_factory=list)
    confs: dict[str, s.NodeConf] = field(default_factory=dict)
    quotas: dict[str, s.Quota] = field(default_factory=dict)
    others: dict[str, s.StoredModel] = field(default_factory=dict)


FULL = [rep(f"x{i}", "x", "h1", [i]) for i in range(8)]

ROWS: dict[str, Row] = {
    "one GPU on an empty 8xH100 fleet: the first GPU of the first node": Row(
        [h100x8("h1"), h100x8("h2")], spec(gpus=1), Fit("h1", [0])),
    "tensor-parallel 4 skips a node with 2 GPUs left": Row(
        [h100x8("h1"), h100x8("h2")], spec(gpus=4), Fit("h2", [0, 1, 2, 3]),
        replicas=[rep(f"x{i}", "x", "h1", [i]) for i in range(6)]
        + [rep("y0", "y", "h2", [4])]),
    "a full node says how full": Row(
        [h100x8("h1")], spec(gpus=1), {"h1": "needs 1 free GPUs, has 0 of 8"}, replicas=FULL),
    "never two replicas on one GPU, draining ones still hold theirs": Row(
        [node("n", H100, H100)], spec(gpus=1), Fit("n", [1]),
        replicas=[rep("old", "x", "n", [0], draining=True)]),
    "memory: 70 GiB per GPU refuses 48 GiB GPUs, naming them": Row(
        [node("l40s", L40S, L40S), node("h", H100)], spec(gpus=2, gpu_memory_gib=70),
        {"l40s": "needs 2 GPUs with 70 GiB free, has 0 (GPU 0: 45 GiB, GPU 1: 45 GiB)",
         "h": "needs 2 free GPUs, has 1 of 1"}),
    "memory: the smallest GPUs that fit, the large kept for large models": Row(
        [node("mixed", A10, H100, L40S, H100)], spec(gpus=1, gpu_memory_gib=40),
        Fit("mixed", [2])),
    "memory: two of them, smallest first": Row(
        [node("mixed", A10, H100, L40S, H100)], spec(gpus=2, gpu_memory_gib=40),
        Fit("mixed", [1, 2])),
    "memory: without a need, the lowest ids": Row(
        [node("mixed", A10, H100, L40S, H100)], spec(gpus=2), Fit("mixed", [0, 1])),
    "memory: unknown (0) is not refused": Row(
        [node("old-agent", 0, 0)], spec(gpus=1, gpu_memory_gib=70), Fit("old-agent", [0])),
    "spread: a model's second replica goes to another node": Row(
        [h100x8("h1"), h100x8("h2")], spec(gpus=1), Fit("h2", [0]),
        replicas=[rep("m1", "m", "h1", [0])]),
    "spread beats a node's fewer replicas": Row(
        [h100x8("h1"), h100x8("h2")], spec(gpus=1), Fit("h2", [2]),
        replicas=[rep("m1", "m", "h1", [0]), rep("x1", "x", "h2", [0]),
                  rep("y1", "y", "h2", [1])]),
    "spread beats free GPUs": Row(
        [h100x8("h1"), node("small", H100)], spec(gpus=1), Fit("small", [0]),
        replicas=[rep("m1", "m", "h1", [0])]),
    "CPU nodes: llama.cpp goes there, not to GPU nodes": Row(
        [node("g", H100, engines=("vllm", "llamacpp")), cpu("c1")],
        spec(engine="llamacpp"), Fit("c1", [])),
    "CPU nodes: vLLM is refused there": Row(
        [cpu("c1")], spec(gpus=1), {"c1": "engine vllm not available"}),
    "cordoned and draining nodes are skipped": Row(
        [h100x8("h1"), h100x8("h2"), h100x8("h3")], spec(gpus=1), Fit("h3", [0]),
        confs={"h1": s.NodeConf(cordoned=True),
               "h2": s.NodeConf(cordoned=True, draining=True)}),
    "every node cordoned: each says so": Row(
        [h100x8("h1"), h100x8("h2")], spec(gpus=1), {"h1": "cordoned", "h2": "draining"},
        confs={"h1": s.NodeConf(cordoned=True),
               "h2": s.NodeConf(cordoned=True, draining=True)}),
    "pools: a default profile stays out of another pool": Row(
        [h100x8("research"), node("l", L40S)], spec(gpus=1), Fit("l", [0]),
        confs={"research": s.NodeConf(pool="research")}),
    "pools: a pool's profile goes only to its nodes": Row(
        [h100x8("h1"), node("l", L40S)], spec(gpus=1, pool="research"),
        {"h1": "in pool default, the profile wants pool research",
         "l": "in pool default, the profile wants pool research"}),
    "pools: a pool's profile finds its node": Row(
        [h100x8("h1"), h100x8("r1")], spec(gpus=1, pool="research"), Fit("r1", [0]),
        confs={"r1": s.NodeConf(pool="research")}),
    "quota: a full scope refuses where the GPUs would fit, other reasons stay": Row(
        [h100x8("h1"), h100x8("h2")], spec(quota="team-a", gpus=2),
        {"h1": "needs 2 free GPUs, has 0 of 8",
         "h2": "quota team-a: 7 of 8 GPUs held, needs 2 more"},
        replicas=[*FULL[:7], rep("x7", "other", "h1", [7])],
        quotas={"team-a": s.Quota(max_gpus=8)},
        others={"x": spec(quota="team-a", mn=7)}),
    "quota: draining replicas no longer count against their scope": Row(
        [h100x8("h1")], spec(quota="team-a", gpus=1), Fit("h1", [1]),
        replicas=[rep("old", "m", "h1", [0], draining=True)],
        quotas={"team-a": s.Quota(max_gpus=1)}),
    "quota: another scope's use does not count": Row(
        [h100x8("h1")], spec(quota="team-a", gpus=4), Fit("h1", [4, 5, 6, 7]),
        replicas=[rep("b", "b", "h1", [0, 1, 2, 3])], quotas={"team-a": s.Quota(max_gpus=4)},
        others={"b": spec(quota="team-b")}),
    "no nodes at all": Row([], spec(gpus=1), {}),
}


@pytest.mark.parametrize("row", ROWS.values(), ids=ROWS.keys())
def test_place(row: Row) -> None:
    got = place("m", row.model, {n.name: n for n in row.nodes},
                {r.id: r for r in row.replicas}, nodeconfs=row.confs, quotas=row.quotas,
                models={"m": row.model} | row.others)
    if isinstance(row.want, Fit):
        assert got == row.want
    else:
        assert isinstance(got, NoFit) and got.texts() == row.want


CORDONED = Refusal(Constraint.CORDONED, "cordoned")
DRAINING = Refusal(Constraint.DRAINING, "draining")


def test_nofit_reads_as_one_line_per_node() -> None:
    assert str(NoFit({})) == "no nodes"
    assert str(NoFit.of({"b": CORDONED, "a": DRAINING})) == "a: draining; b: cordoned"


# --- priorities: displacement ---------------------------------------------------------

HIGH = s.StoredModel(name="high", model="org/high", replicas=s.ReplicaRange(min=1, max=1),
                     profiles=[s.Profile(gpus=2, priority=10)])


def low(name: str, mn: int, prio: int = 0, gpus: int = 1) -> s.StoredModel:
    return s.StoredModel(name=name, model=f"org/{name}", replicas=s.ReplicaRange(min=mn, max=8),
                         profiles=[s.Profile(gpus=gpus, priority=prio)])


@dataclass
class DRow:
    nodes: list[s.NodeInfo]
    models: list[s.StoredModel]
    replicas: list[s.Replica]
    want: Displacement | None
    quotas: dict[str, s.Quota] = field(default_factory=dict)


def _why(rid: str, model: s.StoredModel, on: str) -> dict[str, str]:
    prio = model.profile_list[0].priority
    return {rid: f"displaced by high (priority 10 over {prio}), whose minimum did not fit; "
                 f"on {on}"}


L1 = low("l", mn=1)
MID = low("mid", mn=0, prio=5)
LQ = low("lq", mn=0).model_copy(update={"quota": "t"})
DROWS: dict[str, DRow] = {
    # "l" may lose one of its two (minimum 1), not both: the second GPU comes
    # from "mid", of a higher priority than "l" but lower than "high".
    "lower models above their minimum give way, lowest priority first": DRow(
        [node("n", H100, H100, H100)], [HIGH, L1, MID],
        [rep("l-1", "l", "n", [0]), rep("l-2", "l", "n", [1]), rep("mid-1", "mid", "n", [2])],
        Displacement("n", ["l-1", "mid-1"], _why("l-1", L1, "n") | _why("mid-1", MID, "n"))),
    "never below a lower model's own minimum": DRow(
        [node("n", H100, H100)], [HIGH, low("l", mn=2)],
        [rep("l-1", "l", "n", [0]), rep("l-2", "l", "n", [1])], None),
    "an equal priority is not displaced": DRow(
        [node("n", H100, H100)], [HIGH, low("l", mn=0, prio=10)],
        [rep("l-1", "l", "n", [0]), rep("l-2", "l", "n", [1])], None),
    "room already being made: wait, take no more": DRow(
        [node("n", H100, H100)], [HIGH, low("l", mn=0)],
        [rep("l-1", "l", "n", [0], draining=True), rep("l-2", "l", "n", [1], draining=True)],
        Displacement("n", [], {})),
    "the node needing the fewest victims": DRow(
        [node("a", H100, H100), node("b", H100, H100)],
        [HIGH, low("one", mn=0), low("two", mn=0, gpus=2)],
        [rep("one-1", "one", "a", [0]), rep("one-2", "one", "a", [1]),
         rep("two-1", "two", "b", [0, 1])],
        Displacement("b", ["two-1"], _why("two-1", low("two", mn=0, gpus=2), "b"))),
    "a victim a later one made needless is spared": DRow(
        [node("n", H100, H100, H100, H100)],
        [HIGH.model_copy(update={"profiles": [s.Profile(gpus=3, priority=10)]}),
         low("small", mn=0), low("big", mn=0, prio=1, gpus=3)],
        [rep("small-1", "small", "n", [0]), rep("big-1", "big", "n", [1, 2, 3])],
        Displacement("n", ["big-1"], _why("big-1", low("big", mn=0, prio=1), "n"))),
    "a full quota scope: its lower models give way, not another scope's": DRow(
        [node("n", H100, H100, H100, H100)],
        [HIGH.model_copy(update={"quota": "t"}), LQ, low("free", mn=0)],
        [rep("free-1", "free", "n", [0]), rep("lq-1", "lq", "n", [1]),
         rep("lq-2", "lq", "n", [2])],
        Displacement("n", ["lq-1", "lq-2"], _why("lq-1", LQ, "n") | _why("lq-2", LQ, "n")),
        quotas={"t": s.Quota(max_gpus=2)}),
    "cordoned nodes free nothing": DRow(
        [node("c", H100, H100)], [HIGH, low("l", mn=0)],
        [rep("l-1", "l", "c", [0]), rep("l-2", "l", "c", [1])], None),
}

@pytest.mark.parametrize("row", DROWS.values(), ids=DROWS.keys())
def test_displace(row: DRow) -> None:
    models = {m.name: m for m in row.models}
    confs = {"c": s.NodeConf(cordoned=True)}
    got = displace("high", models["high"], models, {n.name: n for n in row.nodes},
                   {r.id: r for r in row.replicas}, nodeconfs=confs, quotas=row.quotas)
    assert got == row.want


# --- health and quota use ------------------------------------------------------------

def test_health_says_ok_degraded_or_unplaceable_with_each_nodes_reason() -> None:
    two = spec(mn=2, gpus=1)
    placed = [rep("m-1", "m", "h1", [0])]
    why = NoFit.of({"h2": CORDONED})
    assert model_health(two, [*placed, rep("m-2", "m", "h2", [0])], None).state == "ok"
    degraded = model_health(two, placed, why)
    assert (degraded.state, degraded.reasons) == ("degraded", {"h2": "cordoned"})
    assert degraded.detail == "1 of 2 replicas placed; no node fits"
    gone = model_health(two, [rep("m-1", "m", "h1", [0], draining=True)], why)
    assert gone.as_dict() == {"state": "unplaceable", "reasons": {"h2": "cordoned"},
                              "detail": "0 of 2 replicas placed; no node fits"}
    assert model_health(two, [], None).state == "degraded"  # fits: the leader is placing
    shoved = model_health(spec(mn=1), placed, None, displaced={"m-9": "displaced by high"})
    assert (shoved.state, shoved.detail) == ("ok", "m-9: displaced by high")


def test_quota_use_counts_gpus_per_scope_and_reports_every_scope() -> None:
    models = {"a": spec(quota="t"), "b": spec(quota="t"), "c": spec(), "d": spec(quota="u")}
    reps = {r.id: r for r in [rep("a1", "a", "n", [0, 1]), rep("b1", "b", "n", [2]),
                              rep("b2", "b", "n", [3], draining=True), rep("c1", "c", "n", [4])]}
    assert quota_use(models, reps) == {"t": 3}
    assert quota_report(models, reps, {"t": s.Quota(max_gpus=4), "v": s.Quota(max_gpus=0)}) == [
        {"scope": "t", "max_gpus": 4, "used_gpus": 3, "models": ["a", "b"]},
        {"scope": "u", "max_gpus": None, "used_gpus": 0, "models": ["d"]},
        {"scope": "v", "max_gpus": 0, "used_gpus": 0, "models": []}]
