"""A full fleet (every GPU taken: the usual state of a GPU fleet) must cost
the leader's pass work linear in its size, whatever waits for room: a
rollout (a changed spec or a rotated secret makes every replica stale) and
models that find no room. Work is counted in Python function calls, which
a pass makes the same number of every time: no clock, nothing timed.

Before: each model rolling on a full fleet asked placement again over the
whole fleet once per old replica (a 1,000-node fleet's pass took 8 s, a
10,000-node one was quadratic past minutes), and each model left unplaced
carried every node's reason, one by one, into its status and the router's
answer (43 KB of text per model at 1,000 nodes).
"""

from __future__ import annotations

import itertools

from app.control import state as s
from app.control.keys import SecretRing
from app.control.mirror import Mirror
from app.control.placement.verdict import Constraint, NoFit, Refusal
from app.control.plan.phases import Plan
from app.control.plan.planner import PlanInput, PlanPolicy, plan
from app.gateway.publish import Publisher
from app.router.table import RouteTable
from app.store.base import Event, WatchBatch
from tests.support.work import calls

NOW = 1_800_000_000.0


def full_fleet(nodes: int, waiting: int = 0
               ) -> tuple[dict[str, s.StoredModel], dict[str, s.NodeInfo],
                          dict[str, s.Replica], dict[str, s.ReplicaStatus]]:
    """`nodes` nodes of 2 GPUs, each running one ready 2-GPU replica of its
    own model; plus `waiting` models of one 2-GPU replica placed nowhere."""
    models: dict[str, s.StoredModel] = {}
    infos: dict[str, s.NodeInfo] = {}
    replicas: dict[str, s.Replica] = {}
    statuses: dict[str, s.ReplicaStatus] = {}
    for n in range(nodes):
        node, name, rid = f"node-{n:05d}", f"m{n:05d}", f"m{n:05d}-r"
        infos[node] = s.NodeInfo(name=node, engines=["vllm"], gpus=[
            s.GpuInfo(index=g, memory_mib=80_000) for g in range(2)])
        models[name] = s.StoredModel.model_validate(
            {"name": name, "model": f"org/{name}", "gpus": 2})
        replicas[rid] = s.Replica(id=rid, model=name, node=node, gpus=[0, 1], engine="vllm",
                                  weights=f"org/{name}", profile="default")
        statuses[rid] = s.ReplicaStatus(id=rid, node=node, phase="ready",
                                        url=f"http://10.0.0.{n % 250}:8000")
    for w in range(waiting):
        name = f"w{w:05d}"
        models[name] = s.StoredModel.model_validate(
            {"name": name, "model": f"org/{name}", "gpus": 2})
    return models, infos, replicas, statuses


def one_pass(nodes: int, waiting: int = 0, secret_id: str = "") -> tuple[int, Plan]:
    models, infos, replicas, statuses = full_fleet(nodes, waiting)
    suffix = itertools.count()
    return calls(lambda: plan(PlanInput(
            models, infos, replicas, now=NOW, statuses=statuses, secret_id=secret_id),
            PlanPolicy(drain_seconds=60.0, new_suffix=lambda: f"new{next(suffix)}")))


def test_a_rollout_on_a_full_fleet_drains_first_at_a_cost_linear_in_the_fleet() -> None:
    # A rotated secret: every replica is of the old one, and no node has
    # room for a new replica beside it.
    small, p = one_pass(60, secret_id="new")
    assert not p.create and len(p.drain) == 60 and not p.unplaced
    assert "draining m00007-r first" in p.reasons["m00007"]
    large, _ = one_pass(120, secret_id="new")
    # Twice the fleet, twice the work (was four times: placement over the
    # whole fleet once per model).
    assert large / small < 2.4, (small, large)


def test_models_waiting_for_room_cost_a_pass_work_linear_in_the_fleet() -> None:
    small, p = one_pass(60, waiting=15)
    assert len(p.unplaced) == 15 and not p.create and not p.drain
    large, _ = one_pass(120, waiting=30)
    assert large / small < 2.4, (small, large)


def test_why_a_model_is_not_placed_stays_short_on_a_large_fleet() -> None:
    _, p = one_pass(500, waiting=1)
    why = p.unplaced["w00000"]
    # Each reason once, with how many nodes gave it and a few of them.
    assert why.startswith("500 nodes: needs 2 free GPUs, has 0 of 2 "), why
    assert "node-00000" in why and len(why) < 300, why


def test_distinct_reasons_are_each_said_with_their_nodes() -> None:
    cordoned = Refusal(Constraint.CORDONED, "cordoned")
    draining = Refusal(Constraint.DRAINING, "draining")
    reasons = {"b": cordoned, "a": draining, "c": cordoned}
    assert str(NoFit.of(reasons)) == "a: draining; b, c: cordoned"
    many = {f"n{i:03d}": cordoned for i in range(40)} | {"x": draining}
    said = str(NoFit.of(many))
    assert said == ("40 nodes: cordoned (n000, n001, n002, n003, n004 and 35 more); "
                    "x: draining"), said


def published(nodes: int, waiting: int) -> tuple[int, RouteTable]:
    """A gateway's publish of a full fleet with `waiting` models placed
    nowhere, the mirror loaded from events as the watch brings them."""
    models, infos, replicas, statuses = full_fleet(nodes, waiting)
    events = [Event("put", s.MODELS + k, v.model_dump_json().encode(), 1, create_revision=1)
              for k, v in models.items()]
    events += [Event("put", s.NODES + k, v.model_dump_json().encode(), 1, create_revision=1)
               for k, v in infos.items()]
    events += [Event("put", s.REPLICAS + k, v.model_dump_json().encode(), 1,
                     create_revision=1) for k, v in replicas.items()]
    events += [Event("put", s.STATUS + k, v.model_dump_json().encode(), 1, create_revision=1)
               for k, v in statuses.items()]
    mirror = Mirror(None)  # type: ignore[arg-type]  # apply() touches no store
    assert mirror.apply(WatchBatch(events, 1))
    table = RouteTable()
    publisher = Publisher(mirror, table, SecretRing("full-fleet-secret-0123456789"))
    count, _ = calls(publisher.publish)
    return count, table


def test_a_gateway_says_why_waiting_models_are_not_placed_at_a_cost_linear_in_the_fleet(
        ) -> None:
    # Each model with no replica gets the leader's reason, worked out on the
    # gateway's event loop: once per publish, not once per waiting model.
    small, table = published(60, 15)
    why = table.unavailable("w00003") or ""
    assert why.startswith("no replica is placed: 60 nodes: needs 2 free GPUs"), why[:200]
    assert table.endpoints("m00003")
    large, _ = published(120, 30)
    assert large / small < 2.4, (small, large)


def test_a_model_with_no_room_says_which_draining_replicas_it_waits_for() -> None:
    # Nothing draining: nothing to wait for but room.
    _, p = one_pass(3, waiting=1)
    assert p.unplaced["w00000"] == (
        "node-00000, node-00001, node-00002: needs 2 free GPUs, has 0 of 2")
    # A rollout drains each model's replica first: the waiting model (of
    # the same priority, so it displaces nothing) waits for the first node's.
    _, p = one_pass(3, waiting=1, secret_id="new")
    assert sorted(p.drain) == ["m00000-r", "m00001-r", "m00002-r"]
    assert p.unplaced["w00000"].endswith("; waiting for m00000-r to stop on node-00000")
