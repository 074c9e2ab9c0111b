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
    # Why a model's missing replica cannot be placed (place()'s NoFit).
    unplaced: dict[str, str] = field(default_factory=dict)
    # Rollout decisions worth a log line: a drain-first fallback, a wait.
    reasons: dict[str, str] = field(default_factory=dict)

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


def wanted(spec: s.ModelSpec, last_use: float | None, now: float, idle_slack: float = 0.0) -> int:
    """Replicas a model should have, before load-based scaling (not built yet).

    `replicas.min` when above 0. A model with min 0 (and max above 0 and an
    idle timeout) gets one replica while it has been used within its idle
    timeout, plus `idle_slack` (how late the leader may hear of a use), and
    none after: idle stop. A min-0 spec without an idle timeout (stored
    before that rule) keeps meaning what it did: nothing placed.
    """
    rng = spec.replica_range
    if rng.min > 0:
        return rng.min
    if rng.max == 0 or spec.idle_timeout is None or last_use is None:
        return 0
    return 1 if now - last_use < spec.idle_timeout + idle_slack else 0


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
    statuses: Mapping[str, s.ReplicaStatus] | None = None,
    inflight: Mapping[str, int] | None = None,
    last_used: Mapping[str, float] | None = None,
    idle_slack: float = 0.0,
) -> Plan:
    """One level-based pass: compares desired counts with `replicas/`.

    `absent_for` says, per node that has replicas but no `nodes/` key, for
    how many seconds the caller has counted it absent (a node it does not
    name counts 0 s). Its replicas are kept, holding their GPUs and counting
    towards their model's replicas, until that reaches `node_grace`: a
    restarting agent or a handover must not reload every model
    (docs/architecture.md, Placement). The router does not route to them
    meanwhile (app/publish.py).

    A spec change rolls (docs/architecture.md, Reconciler): the replacement
    is placed first, and an old replica is drained only once enough
    replicas of the new spec are ready (`statuses`) to stand in for it; an
    old replica that is not ready serves nothing and goes at once. When no
    node has room for the extra replica, the plan waits for a replacement
    already loading, else drains one old replica first (the model runs
    short until its replacement is ready); `reasons` says which. When even
    that would not make room, the old replicas keep serving and `unplaced`
    says why.

    A draining replica is deleted once `inflight` (summed over every
    gateway that has let go of it; usage.drain_inflight) says 0, or after
    `drain_seconds`, the cap, whatever it says. One that `inflight` does not
    name waits for the cap.

    `last_used` (model -> unix time) drives idle stop for models with
    `replicas.min` 0 (see `wanted()`).
    """
    absent = absent_for or {}
    phases = statuses or {}
    counts = inflight or {}
    used = last_used or {}
    out = Plan()
    live: dict[str, s.Replica] = {}
    for rid, r in replicas.items():
        if r.node not in nodes and absent.get(r.node, 0.0) >= node_grace:
            # Gone past its grace: nothing there to drain, nothing routes to it.
            out.delete.append(rid)
            continue
        live[rid] = r
        if r.draining_since is not None and (
                counts.get(rid) == 0 or now - r.draining_since >= drain_seconds):
            out.delete.append(rid)

    def ready(rid: str) -> bool:
        # As the router sees it: reported ready, on a node heard from.
        st = phases.get(rid)
        return st is not None and st.phase == "ready" and live[rid].node in nodes

    for rid, r in sorted(live.items()):
        owner = models.get(r.model)
        if r.draining_since is None and (owner is None or owner.model is None
                                         or not owner.profile_list):
            out.drain.append(rid)  # its model was deleted or turned external

    for name, spec in sorted(models.items()):
        if spec.model is None or not spec.profile_list:
            continue  # external: served by its provider, nothing to place
        mine = sorted(rid for rid, r in live.items()
                      if r.model == name and r.draining_since is None)
        want = wanted(spec, used.get(name), now, idle_slack)
        # Ready ones first, so that a surplus drops those that serve nothing.
        by_use = sorted(mine, key=lambda rid: (not ready(rid), rid))
        current = [rid for rid in by_use if _matches(spec, live[rid])]
        stale = [rid for rid in by_use if rid not in current]
        out.drain += current[want:]
        current = current[:want]
        # Old replicas stand in, ready ones only, for as many new ones as
        # are not ready yet.
        short = max(0, want - sum(map(ready, current)))
        keep = [rid for rid in stale if ready(rid)][:short]
        out.drain += [rid for rid in stale if rid not in keep]
        for _ in range(want - len(current)):
            fit = place(name, spec, nodes, live)
            if isinstance(fit, NoFit):
                coming = [rid for rid in current if not ready(rid)] + [
                    r.id for r in out.create if r.model == name]
                _no_room(out, name, spec, nodes, live, keep, coming, fit)
                break
            prof = spec.profile_list[0]
            rep = s.Replica(
                id=replica_id(name, new_suffix()), model=name, node=fit.node,
                gpus=fit.gpus, engine=prof.engine, weights=spec.model,
                weights_revision=spec.revision, profile=prof.name,
                engine_args=list(prof.engine_args),
            )
            live[rep.id] = rep
            out.create.append(rep)
    return out


def _no_room(out: Plan, name: str, spec: s.StoredModel, nodes: Mapping[str, s.NodeInfo],
             live: Mapping[str, s.Replica], keep: list[str], coming: list[str],
             fit: NoFit) -> None:
    """No node has room for a replica of the new spec: wait for what is on
    its way, else fall back to drain first, one old replica at a time, when
    that makes room."""
    leaving = sorted(rid for rid, r in live.items() if r.model == name
                     and (r.draining_since is not None or rid in out.drain))
    if leaving:
        # Their GPUs come free once they stop: one at a time, never two.
        out.reasons[name] = (f"no room for a new replica ({fit}): waiting for "
                             f"{', '.join(leaving)} to stop")
        return
    if not keep:
        out.unplaced[name] = str(fit)
        return
    if coming:
        # A replacement is on its way: once it is ready an old replica
        # drains and frees room for the next one, with no gap.
        out.reasons[name] = (f"no room for another new replica ({fit}): waiting for "
                             f"{', '.join(coming)} to be ready")
        return
    for rid in reversed(keep):
        if not isinstance(place(name, spec, nodes, {k: v for k, v in live.items() if k != rid}),
                          NoFit):
            keep.remove(rid)
            out.drain.append(rid)
            out.reasons[name] = (f"no room for a new replica beside the old ones ({fit}): "
                                 f"draining {rid} first, so {name} runs one replica short "
                                 "until its replacement is ready")
            return
    out.unplaced[name] = str(fit)
    out.reasons[name] = (f"no room for the new spec even in place of an old replica "
                         f"({fit}): the old replicas keep serving")
