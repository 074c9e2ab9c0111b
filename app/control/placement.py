"""Placement and the reconcile plan: pure functions, no I/O.

`plan()` takes the whole desired and observed state and returns what to
write; the reconciler applies it. Being pure, it is tested by calling it, and
a node refused for a model says why (`NoFit.reasons`), in the manner of
Nomad's scheduler: feasibility -> fit -> score -> pick.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

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


_SLUG = re.compile(r"[^a-z0-9]+")


def replica_id(model: str, suffix: str) -> str:
    slug = _SLUG.sub("-", model.lower()).strip("-")[:40] or "model"
    return f"{slug}-{suffix}"


@dataclass
class Plan:
    create: list[s.Replica] = field(default_factory=list)
    drain: list[str] = field(default_factory=list)
    delete: list[str] = field(default_factory=list)
    unplaced: dict[str, str] = field(default_factory=dict)

    @property
    def empty(self) -> bool:
        return not (self.create or self.drain or self.delete)


def _matches(spec: s.StoredModel, r: s.Replica) -> bool:
    """Whether replica `r` still runs what the spec asks for (its first
    profile's engine, GPUs and flags; not the profile's name, whose renaming
    must not restart an engine). A model turned external has no replicas."""
    if not spec.profile_list:
        return False
    prof = spec.profile_list[0]
    return (r.weights, r.weights_revision, r.engine, len(r.gpus), r.engine_args) == (
        spec.model, spec.revision, prof.engine, prof.gpu_count, prof.engine_args)


def plan(
    models: Mapping[str, s.StoredModel],
    nodes: Mapping[str, s.NodeInfo],
    replicas: Mapping[str, s.Replica],
    *,
    now: float,
    drain_seconds: float,
    new_suffix: Callable[[], str],
    absent_for: Mapping[str, float] | None = None,
    node_grace: float = 0.0,
) -> Plan:
    """One level-based pass: compares desired counts with `replicas/`.

    `absent_for` says, per node that has replicas but no `nodes/` key, for
    how many seconds the caller has counted it absent (a node it does not
    name counts 0 s). Its replicas are kept, holding their GPUs and counting
    towards their model's replicas, until that reaches `node_grace`: a
    restarting agent or a handover must not reload every model
    (docs/architecture.md, Placement). The router does not route to them
    meanwhile (app/publish.py).
    """
    absent = absent_for or {}
    out = Plan()
    live: dict[str, s.Replica] = {}
    for rid, r in replicas.items():
        if r.node not in nodes and absent.get(r.node, 0.0) >= node_grace:
            # Gone past its grace: nothing there to drain, nothing routes to it.
            out.delete.append(rid)
        elif r.draining_since is not None:
            if now - r.draining_since >= drain_seconds:
                out.delete.append(rid)
            live[rid] = r
        elif r.model not in models or not _matches(models[r.model], r):
            out.drain.append(rid)
            live[rid] = r
        else:
            live[rid] = r

    draining = set(out.drain)
    for name, spec in sorted(models.items()):
        active = sorted(
            rid for rid, r in live.items()
            if r.model == name and r.draining_since is None and rid not in draining
        )
        if spec.model is None or not spec.profile_list:
            continue  # external: served by its provider, nothing to place
        prof = spec.profile_list[0]
        want = spec.replica_range.min
        # Surplus: drop the newest first (ids sort by suffix, which is random,
        # so this is stable rather than meaningful; load-aware choice comes
        # with autoscaling).
        for rid in active[want:]:
            out.drain.append(rid)
        for _ in range(want - len(active)):
            fit = place(name, spec, nodes, live)
            if isinstance(fit, NoFit):
                out.unplaced[name] = str(fit)
                break
            rep = s.Replica(
                id=replica_id(name, new_suffix()), model=name, node=fit.node,
                gpus=fit.gpus, engine=prof.engine, weights=spec.model,
                weights_revision=spec.revision, profile=prof.name,
                engine_args=list(prof.engine_args),
            )
            live[rep.id] = rep
            out.create.append(rep)
    return out
