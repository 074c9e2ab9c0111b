"""Placement and the reconcile plan are pure: tested by calling them."""

from __future__ import annotations

import itertools

from app.control import state as s
from app.control.placement.placer import place
from app.control.placement.verdict import Fit, NoFit
from app.control.plan.phases import Plan
from app.control.plan.planner import PlanInput, PlanPolicy, plan, wanted


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
             absent_for: dict[str, float] | None = None, node_grace: float = 0.0,
             ready: tuple[str, ...] = (), inflight: dict[str, int] | None = None,
             last_used: dict[str, float] | None = None, idle_slack: float = 0.0,
             nodeconfs: dict[str, s.NodeConf] | None = None,
             quotas: dict[str, s.Quota] | None = None,
             targets: dict[str, int] | None = None,
             loads: dict[str, float] | None = None) -> Plan:
    counter = suffixes()
    statuses = {rid: s.ReplicaStatus(id=rid, node=replicas[rid].node, phase="ready")
                for rid in ready}
    return plan(PlanInput(
            {m.name: m for m in models}, {n.name: n for n in nodes}, replicas, now=now,
            absent_for=absent_for or {}, statuses=statuses, inflight=inflight or {},
            last_used=last_used or {}, nodeconfs=nodeconfs or {}, quotas=quotas or {},
            targets=targets or {}, loads=loads or {}),
            PlanPolicy(drain_seconds=2.0, new_suffix=lambda: f"{next(counter):04d}",
                       node_grace=node_grace, idle_slack=idle_slack))


def old_replica(rid: str, gpu: int = 0, node: str = "n1") -> s.Replica:
    """A replica of model "m" on weights the spec no longer names."""
    return s.Replica(id=rid, model="m", node=node, gpus=[gpu], weights="org/old")


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
    assert nofit.texts() == {"n1": "needs 2 free GPUs, has 1 of 2"}


def test_llamacpp_goes_to_cpu_nodes_only() -> None:
    nodes = {"g": s.NodeInfo(name="g", gpus=[s.GpuInfo(index=0)], engines=["vllm", "llamacpp"]),
             "c": cpu_node("c")}
    fit = place("m", model("m", engine="llamacpp"), nodes, {})
    assert fit == Fit("c", [])
    nofit = place("m", model("m", engine="llamacpp"), {"g": nodes["g"]}, {})
    assert isinstance(nofit, NoFit) and "CPU nodes" in nofit.texts()["g"]


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


# --- rollout order on a spec change -------------------------------------------------


def test_a_spec_change_places_the_replacement_before_draining_the_old_one() -> None:
    nodes = [gpu_node("n1", 2)]
    reps = {"r1": old_replica("r1")}
    p = run_plan([model("m")], nodes, reps, ready=("r1",))
    # The old one keeps serving while the new one loads.
    assert p.drain == [] and [(r.node, r.gpus, r.weights) for r in p.create] == [
        ("n1", [1], "org/m")]
    new = p.create[0]
    reps[new.id] = new
    assert run_plan([model("m")], nodes, reps, ready=("r1",)).empty  # new one still loading
    p = run_plan([model("m")], nodes, reps, ready=("r1", new.id))
    assert p.drain == ["r1"] and p.create == []


def test_an_old_replica_that_serves_nothing_is_drained_at_once() -> None:
    p = run_plan([model("m")], [gpu_node("n1", 2)], {"r1": old_replica("r1")})
    assert p.drain == ["r1"] and len(p.create) == 1


def test_no_room_for_a_surge_replica_falls_back_to_drain_first_and_says_so() -> None:
    nodes = [gpu_node("n1", 1)]
    reps = {"r1": old_replica("r1")}
    p = run_plan([model("m")], nodes, reps, ready=("r1",))
    assert p.drain == ["r1"] and p.create == [] and p.unplaced == {}
    assert "draining r1 first" in p.reasons["m"]
    # While it drains it holds its GPU: nothing placed, nothing else drained.
    reps["r1"] = reps["r1"].model_copy(update={"draining_since": 99.5})
    p = run_plan([model("m")], nodes, reps, ready=("r1",))
    assert p.empty and "waiting for r1 to stop" in p.reasons["m"]
    # Gone: its replacement takes the GPU.
    p = run_plan([model("m")], nodes, {})
    assert [r.gpus for r in p.create] == [[0]]


def test_a_spec_that_fits_nowhere_leaves_the_old_replica_serving() -> None:
    p = run_plan([model("m", gpus=2)], [gpu_node("n1", 1)], {"r1": old_replica("r1")},
                 ready=("r1",))
    assert p.empty
    assert p.unplaced == {"m": "n1: needs 2 free GPUs, has 0 of 1"}
    assert "keep serving" in p.reasons["m"]


def test_two_replicas_roll_one_at_a_time_when_there_is_room_for_one_more() -> None:
    nodes = [gpu_node("n1", 3)]
    spec = model("m", replicas={"min": 2, "max": 2})
    reps = {"r1": old_replica("r1", 0), "r2": old_replica("r2", 1)}
    p = run_plan([spec], nodes, reps, ready=("r1", "r2"))
    # One surge replica; no old one drained while it loads.
    assert [r.gpus for r in p.create] == [[2]] and p.drain == []
    assert "waiting for" in p.reasons["m"]
    new = p.create[0]
    reps[new.id] = new
    p = run_plan([spec], nodes, reps, ready=("r1", "r2", new.id))
    assert p.drain == ["r2"] and p.create == []  # one old one stands in for the missing new


# --- drains wait for the work ---------------------------------------------------------


def test_a_draining_replica_goes_when_nothing_is_in_flight_or_at_the_cap() -> None:
    rep = s.Replica(id="r1", model="gone", node="n1", gpus=[0], weights="org/gone",
                    draining_since=99.0)
    nodes = [gpu_node("n1", 1)]
    assert run_plan([], nodes, {"r1": rep}, inflight={"r1": 0}).delete == ["r1"]
    assert run_plan([], nodes, {"r1": rep}, inflight={"r1": 2}).delete == []
    # Not known (a gateway has not reported since the drain): waits too...
    assert run_plan([], nodes, {"r1": rep}, inflight={}).delete == []
    # ...until the cap (drain_seconds, 2 s here), whatever is in flight.
    assert run_plan([], nodes, {"r1": rep}, now=101.0, inflight={"r1": 2}).delete == ["r1"]


# --- idle stop --------------------------------------------------------------------------


def test_a_min_zero_model_runs_one_replica_while_used_and_none_after_its_idle_timeout() -> None:
    spec = model("m", replicas={"min": 0, "max": 2}, idle_timeout=60)
    nodes = [gpu_node("n1", 1)]
    assert wanted(spec, None, now=100.0) == 0  # never used: nothing placed
    assert run_plan([spec], nodes, {}).empty
    p = run_plan([spec], nodes, {}, last_used={"m": 50.0})
    assert [r.model for r in p.create] == ["m"]
    rep = p.create[0]
    assert run_plan([spec], nodes, {rep.id: rep}, now=109.9, last_used={"m": 50.0}).empty
    assert run_plan([spec], nodes, {rep.id: rep}, now=110.0,
                    last_used={"m": 50.0}).drain == [rep.id]
    # The slack (how late a use may reach the leader) comes on top.
    assert run_plan([spec], nodes, {rep.id: rep}, now=110.0, last_used={"m": 50.0},
                    idle_slack=5).empty
    # min above 0 ignores use; max 0, or no idle timeout (an old spec): nothing placed.
    assert wanted(model("m", replicas={"min": 1, "max": 2}), None, now=100.0) == 1
    assert wanted(model("m", replicas={"min": 0, "max": 0}, idle_timeout=60), 99.0,
                  now=100.0) == 0
    assert wanted(model("m", replicas={"min": 0, "max": 1}), 99.0, now=100.0) == 0


# --- load-based scaling: the count is decided by the reconciler (scaling.py) ------------


def test_a_scaling_target_stays_within_the_range_and_never_wakes_an_idle_model() -> None:
    spec = model("m", replicas={"min": 1, "max": 3})
    assert wanted(spec, None, now=100.0, target=2) == 2
    assert wanted(spec, None, now=100.0, target=9) == 3  # never past max
    assert wanted(spec, None, now=100.0, target=0) == 1  # never below min
    idle = model("m", replicas={"min": 0, "max": 3}, idle_timeout=60)
    assert wanted(idle, 50.0, now=100.0, target=3) == 3  # in use: scales
    assert wanted(idle, 30.0, now=100.0, target=3) == 0  # idle: stops, whatever the load
    assert wanted(idle, None, now=100.0, target=3) == 0  # never used: nothing placed


def test_a_scaled_model_places_up_to_its_target_and_drains_the_least_loaded_surplus() -> None:
    spec = model("m", replicas={"min": 1, "max": 4})
    nodes = [gpu_node("n1", 4)]
    p = run_plan([spec], nodes, {}, targets={"m": 3})
    assert len(p.create) == 3 and p.drain == []
    reps = {f"r{i}": s.Replica(id=f"r{i}", model="m", node="n1", gpus=[i], weights="org/m")
            for i in range(4)}
    ready = ("r0", "r1", "r2")
    # r3 serves nothing (not ready): it goes first; then the least loaded.
    assert run_plan([spec], nodes, reps, ready=ready, targets={"m": 3},
                    loads={"r0": 5, "r1": 1, "r2": 3}).drain == ["r3"]
    assert run_plan([spec], nodes, reps, ready=(*ready, "r3"), targets={"m": 2},
                    loads={"r0": 5, "r1": 1, "r2": 3, "r3": 2}).drain == ["r3", "r1"]
    # A replica whose load no gateway reported counts as the busiest.
    assert run_plan([spec], nodes, reps, ready=(*ready, "r3"), targets={"m": 3},
                    loads={"r1": 4, "r2": 3, "r3": 6}).drain == ["r2"]
    assert run_plan([spec], nodes, reps, ready=(*ready, "r3"), targets={"m": 4},
                    loads={}).empty


def test_the_plan_honours_cordons_and_moves_replicas_off_a_draining_node() -> None:
    nodes = [gpu_node("n1", 1), gpu_node("n2", 1)]
    p = run_plan([model("m")], nodes, {}, nodeconfs={"n1": s.NodeConf(cordoned=True)})
    assert [(r.node, r.gpus) for r in p.create] == [("n2", [0])]
    # Draining n1: its replica rolls to n2 first, and leaves once that is ready.
    rep = s.Replica(id="r1", model="m", node="n1", gpus=[0], weights="org/m")
    drain = {"n1": s.NodeConf(cordoned=True, draining=True)}
    p = run_plan([model("m")], nodes, {"r1": rep}, ready=("r1",), nodeconfs=drain)
    assert [r.node for r in p.create] == ["n2"] and p.drain == []
    new = p.create[0]
    p = run_plan([model("m")], nodes, {"r1": rep, new.id: new}, ready=("r1", new.id),
                 nodeconfs=drain)
    assert p.drain == ["r1"] and p.create == []
    # A cordon alone moves nothing.
    p = run_plan([model("m")], nodes, {"r1": rep}, ready=("r1",),
                 nodeconfs={"n1": s.NodeConf(cordoned=True)})
    assert p.empty


def test_a_higher_priority_minimum_displaces_a_lower_priority_replica_above_its_own() -> None:
    nodes = [gpu_node("n1", 1)]
    low = model("lo", replicas={"min": 0, "max": 1}, idle_timeout=600)
    high = model("hi", profiles=[{"engine": "vllm", "gpus": 1, "priority": 10}])
    lo_rep = s.Replica(id="lo-1", model="lo", node="n1", gpus=[0], weights="org/lo")
    p = run_plan([low, high], nodes, {"lo-1": lo_rep}, ready=("lo-1",),
                 last_used={"lo": 99.0})
    assert p.drain == ["lo-1"] and p.create == []
    assert "waiting for lo-1 to stop on n1" in p.unplaced["hi"]
    assert "displaced" in p.reasons["lo"]
    # Never below the lower model's own minimum.
    firm = model("lo", replicas={"min": 1, "max": 1})
    p = run_plan([firm, high], nodes, {"lo-1": lo_rep}, ready=("lo-1",))
    assert p.drain == [] and "hi" in p.unplaced


def test_a_replica_its_agent_gave_up_on_is_placed_again_elsewhere() -> None:
    nodes = [gpu_node("n1", 2), gpu_node("n2", 1)]
    rep = s.Replica(id="r1", model="m", node="n1", gpus=[0], weights="org/m")
    p = run_plan([model("m")], nodes, {"r1": rep})
    assert p.empty  # failed but not given up (or still backing off): the agent's to restart
    p = plan(PlanInput(
            {"m": model("m")}, {n.name: n for n in nodes}, {"r1": rep}, now=100.0, failed={"r1"}),
            PlanPolicy(drain_seconds=2.0, new_suffix=lambda: "0001"))
    assert p.drain == ["r1"] and [(r.node, r.gpus) for r in p.create] == [("n2", [0])]
    # Nowhere else to go: the same node again, beside it (its GPU is still held).
    p = plan(PlanInput(
            {"m": model("m")}, {"n1": nodes[0]}, {"r1": rep}, now=100.0, failed={"r1"}),
            PlanPolicy(drain_seconds=2.0, new_suffix=lambda: "0001"))
    assert p.drain == ["r1"] and [(r.node, r.gpus) for r in p.create] == [("n1", [1])]


def test_the_first_profile_that_fits_is_placed_and_kept() -> None:
    h100 = s.NodeInfo(name="h1", gpus=[s.GpuInfo(index=0, memory_mib=81559)], engines=["vllm"])
    a10 = s.NodeInfo(name="a1", gpus=[s.GpuInfo(index=i, memory_mib=23028) for i in range(2)],
                     engines=["vllm"])
    spec = model("m", replicas={"min": 2, "max": 2}, profiles=[
        {"name": "big", "gpus": 1, "gpu_memory_gib": 70, "engine_args": ["--enforce-eager"]},
        {"name": "small", "gpus": 2, "gpu_memory_gib": 20}])
    p = run_plan([spec], [h100, a10], {})
    # The preferred profile where it fits (the H100), the next one elsewhere.
    assert sorted((r.node, r.profile, len(r.gpus), tuple(r.engine_args)) for r in p.create) == [
        ("a1", "small", 2, ()), ("h1", "big", 1, ("--enforce-eager",))]
    # Each replica is held to the profile it was placed with: nothing rolls.
    placed = {r.id: r for r in p.create}
    assert run_plan([spec], [h100, a10], placed, ready=tuple(placed)).empty
    # No profile fits: each node says why, per profile.
    p = run_plan([spec], [a10], {"x": s.Replica(id="x", model="other", node="a1", gpus=[0],
                                                weights="w")})
    assert "big:" in p.unplaced["m"] and "small:" in p.unplaced["m"]
