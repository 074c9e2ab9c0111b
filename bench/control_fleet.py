"""The synthetic fleet bench/control_scale.py and its parts measure: 5,000
models x 4 replicas of one GPU each, spread round robin over `node_count`
nodes of 8 GPUs, every replica ready; built from the control plane's own
types (app/control/state.py), as the mirror holds them."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from control_etcd import inventory

from app.control import state as s

MODELS = 5000
REPLICAS_PER_MODEL = 4


@dataclass
class Fleet:
    models: dict[str, s.StoredModel]
    nodes: dict[str, s.NodeInfo]
    replicas: dict[str, s.Replica]
    statuses: dict[str, s.ReplicaStatus]
    loads: dict[str, float]


def fleet(node_count: int, model_count: int = MODELS,
          per_model: int = REPLICAS_PER_MODEL) -> Fleet:
    """Every model's replicas spread round robin, one GPU each, all ready."""
    models = {
        f"org/model-{m:04d}": s.StoredModel.model_validate({
            "name": f"org/model-{m:04d}", "model": f"org/weights-{m:04d}", "gpus": 1,
            "replicas": {"min": per_model, "max": per_model},
            "aliases": [f"alias-{m:04d}"]})
        for m in range(model_count)}
    nodes = {
        f"node-{n:05d}": s.NodeInfo.model_validate(
            inventory(f"node-{n:05d}") | {"address": f"10.{n // 250}.{n % 250}.1"})
        for n in range(node_count)}
    names = sorted(nodes)
    used: dict[str, int] = {}
    replicas: dict[str, s.Replica] = {}
    statuses: dict[str, s.ReplicaStatus] = {}
    loads: dict[str, float] = {}
    slot = itertools.count()
    for m, (name, spec) in enumerate(sorted(models.items())):
        for i in range(per_model):
            node = names[next(slot) % node_count]
            gpu = used.get(node, 0)
            used[node] = gpu + 1
            rid = f"model-{m:04d}-{i:04x}"
            prof = spec.profile_list[0]
            replicas[rid] = s.Replica(
                id=rid, model=name, node=node, gpus=[gpu], engine=prof.engine,
                weights=spec.model or "", weights_revision=spec.revision, profile=prof.name,
                engine_args=list(prof.engine_args))
            statuses[rid] = s.ReplicaStatus(
                id=rid, node=node, phase="ready", url=f"http://{nodes[node].address}:8000")
            loads[rid] = float((m * 7 + i) % 16)
    return Fleet(models, nodes, replicas, statuses, loads)
