"""The reconcile plan: the leader's whole pass as a pure function, no I/O.

`plan()` takes the whole desired and observed state and returns what to
write; the reconciler applies it. Being pure, it is tested by calling it.
Where each new replica goes is `placement.place()`'s decision.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from app.control import state as s
from app.control.placement import NoFit, place

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
