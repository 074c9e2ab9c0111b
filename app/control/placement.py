"""Placement: where one more replica of a model goes. A pure function, no I/O.

`place()` takes the model and the fleet and returns a `Fit` or a `NoFit`
whose reasons say why each node was refused, in the manner of Nomad's
scheduler: feasibility -> fit -> score -> pick. The reconcile plan that
calls it lives in plan.py.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from app.control import state as s


@dataclass(frozen=True)
class Fit:
    node: str
    gpus: list[int]


@dataclass(frozen=True)
class NoFit:
    reasons: dict[str, str]

    def __str__(self) -> str:
        if not self.reasons:
            return "no nodes"
        return "; ".join(f"{n}: {r}" for n, r in sorted(self.reasons.items()))


def used_gpus(replicas: Mapping[str, s.Replica]) -> dict[str, set[int]]:
    """GPUs taken per node. Draining replicas still hold theirs until stopped."""
    used: dict[str, set[int]] = {}
    for r in replicas.values():
        used.setdefault(r.node, set()).update(r.gpus)
    return used


def place(
    name: str,
    spec: s.ModelSpec,
    nodes: Mapping[str, s.NodeInfo],
    replicas: Mapping[str, s.Replica],
) -> Fit | NoFit:
    """Picks a node (and GPUs) for one more replica of `name`.

    It runs the spec's first profile; choosing among profiles comes with
    placement by priority and pool. An external model has none: never placed.
    """
    profiles = spec.profile_list
    if not profiles:
        return NoFit({})
    prof = profiles[0]
    used = used_gpus(replicas)
    same_model: dict[str, int] = {}
    total: dict[str, int] = {}
    for r in replicas.values():
        total[r.node] = total.get(r.node, 0) + 1
        if r.model == name:
            same_model[r.node] = same_model.get(r.node, 0) + 1

    reasons: dict[str, str] = {}
    candidates: list[tuple[tuple[int, int, int, str], Fit]] = []
    for node in nodes.values():
        if prof.engine not in node.engines:
            reasons[node.name] = f"engine {prof.engine} not available"
            continue
        if prof.engine == "llamacpp":
            if not node.cpu_only:
                reasons[node.name] = "llamacpp replicas go to CPU nodes"
                continue
            fit = Fit(node.name, [])
            free = 0
        else:
            free_ids = [g.index for g in node.gpus if g.index not in used.get(node.name, set())]
            if len(free_ids) < prof.gpu_count:
                reasons[node.name] = (
                    f"needs {prof.gpu_count} free GPUs, has {len(free_ids)} of {len(node.gpus)}"
                )
                continue
            fit = Fit(node.name, sorted(free_ids)[: prof.gpu_count])
            free = len(free_ids)
        # Spread replicas of one model first, then fill the emptiest node, so
        # that losing a node loses as few replicas of any model as possible.
        score = (same_model.get(node.name, 0), total.get(node.name, 0), -free, node.name)
        candidates.append((score, fit))
    if not candidates:
        return NoFit(reasons)
    return min(candidates, key=lambda c: c[0])[1]
