"""bench/control_scale.py's full fleet: every GPU taken, the usual state of
a GPU fleet. Two passes: models waiting for room (1% of the catalog more
than fits), and a rollout of every model at once (a rotated shared secret
makes every replica stale, and no node has room for a replacement beside
the old replica: each model drains one first).

Before (2026-12-02): each waiting model scanned every node for its reasons
and each rolling model asked placement over the whole fleet once per old
replica: a 1,000-node pass of the rollout took 8.1 s of CPU, and it grew
with the square of the fleet.
"""

from __future__ import annotations

import itertools
import time

from app.control import state as s
from app.control.plan.phases import Plan
from app.control.plan.planner import PlanInput, PlanPolicy, plan

GPUS_PER_REPLICA = 4


def full(fleet_of: object, node_count: int, waiting: int) -> tuple[
        dict[str, s.StoredModel], dict[str, s.NodeInfo], dict[str, s.Replica],
        dict[str, s.ReplicaStatus], dict[str, float]]:
    """`node_count` nodes x 8 GPUs, every GPU held by a replica of 4 GPUs
    (node_count / 2 models x 4 replicas), and `waiting` models of one
    4-GPU replica placed nowhere. `fleet_of` is control_fleet.fleet."""
    f = fleet_of(node_count, node_count // 2, 4)  # type: ignore[operator]
    models = {name: s.StoredModel.model_validate(spec.model_dump() | {"gpus": GPUS_PER_REPLICA})
              for name, spec in f.models.items()}
    used: dict[str, int] = {}
    replicas = {}
    for rid, r in f.replicas.items():
        first = used.get(r.node, 0)
        used[r.node] = first + GPUS_PER_REPLICA
        replicas[rid] = r.model_copy(update={"gpus": list(range(first, first + GPUS_PER_REPLICA))})
    for w in range(waiting):
        name = f"org/waiting-{w:04d}"
        models[name] = s.StoredModel.model_validate({
            "name": name, "model": f"org/waiting-weights-{w:04d}", "gpus": GPUS_PER_REPLICA})
    return models, f.nodes, replicas, f.statuses, f.loads


def timed(models: dict[str, s.StoredModel], nodes: dict[str, s.NodeInfo],
          replicas: dict[str, s.Replica], statuses: dict[str, s.ReplicaStatus],
          loads: dict[str, float], now: float, secret_id: str) -> tuple[float, float, Plan]:
    counter = itertools.count()
    start, cpu = time.perf_counter(), time.thread_time()
    p = plan(PlanInput(
            models, nodes, replicas, now=now, statuses=statuses, loads=loads,
            secret_id=secret_id),
            PlanPolicy(drain_seconds=60.0, new_suffix=lambda: f"new{next(counter):05d}"))
    return (time.perf_counter() - start) * 1000, (time.thread_time() - cpu) * 1000, p


def full_passes(fleet_of: object, node_count: int, now: float) -> list[str]:
    """The two passes' lines for RESULTS.md, each checked for what it must decide."""
    waiting = max(1, node_count // 200)  # 1% of the node_count / 2 models
    models, nodes, replicas, statuses, loads = full(fleet_of, node_count, waiting)
    wall, cpu, p = timed(models, nodes, replicas, statuses, loads, now, "")
    if p.create or p.drain or len(p.unplaced) != waiting:
        raise SystemExit(f"full fleet: unexpected plan {len(p.create)} creates, "
                         f"{len(p.drain)} drains, {len(p.unplaced)} unplaced")
    longest = max(len(why) for why in p.unplaced.values())
    lines = [f"full fleet, {node_count:,} nodes x 8 GPUs all taken, {waiting} models waiting "
             f"for room: {wall:.0f} ms (CPU {cpu:.0f}); each one's reason {longest} chars"]
    wall, cpu, p = timed(models, nodes, replicas, statuses, loads, now, "rotated")
    rolling = len(models) - waiting
    if p.create or len(p.drain) != rolling:
        raise SystemExit(f"full fleet rollout: {len(p.create)} creates, {len(p.drain)} "
                         f"drains (want 0 and {rolling})")
    lines.append(f"full fleet, {node_count:,} nodes, every one of {rolling:,} models rolling "
                 f"(a rotated secret), one replica each drained first: {wall:.0f} ms "
                 f"(CPU {cpu:.0f})")
    return lines
