"""The reconcile plan: the leader's whole pass as a pure function, no I/O.

`plan()` takes the whole desired and observed state and returns what to
write; the reconciler applies it. Being pure, it is tested by calling it.
Where each new replica goes is `placement.place()`'s decision.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

from app.control import state as s
from app.control.agentversion import Window
from app.control.displace import displace
from app.control.gpuhealth import on_sick_gpu, sick_by_node
from app.control.placement import Fit, NoFit, Placer, place

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
    # Why a drained replica goes, where its model's status should say so.
    drain_reasons: dict[str, str] = field(default_factory=dict)

    @property
    def empty(self) -> bool:
        return not (self.create or self.drain or self.delete)


def _matches(spec: s.StoredModel, r: s.Replica, secret_id: str, unrecorded: str) -> bool:
    """Whether replica `r` still runs what the spec asks for: the engine,
    GPUs and flags of the profile it was placed with (by name; a replica of
    an unnamed or renamed profile is held to the first, so renaming the only
    profile restarts no engine), with a key of the fleet's secret
    (`secret_id`; `unrecorded` is what a replica recording none is of, see
    keys.replica_secret_id). A model turned external has no replicas."""
    profiles = spec.profile_list
    if not profiles or (r.secret or unrecorded) != secret_id:
        return False
    prof = next((p for p in profiles if p.name == r.profile), profiles[0])
    return (r.weights, r.weights_revision, r.engine, len(r.gpus), r.engine_args) == (
        spec.model, spec.revision, prof.engine, prof.gpu_count, prof.engine_flags)


def _place_any(placer: Placer, name: str, spec: s.StoredModel
               ) -> tuple[Fit | NoFit, s.Profile]:
    """The first of the model's profiles, in the order given, that fits
    somewhere: an operator lists the preferred way first (an H100 pool, then
    an A10 one). When none fits, every node's reason names each profile's."""
    profiles = spec.profile_list
    refusals: list[tuple[s.Profile, NoFit]] = []
    for prof in profiles:
        fit = placer.place(name, spec, profile=prof)
        if not isinstance(fit, NoFit):
            return fit, prof
        refusals.append((prof, fit))
    if len(refusals) == 1:
        return refusals[0][1], profiles[0]
    reasons: dict[str, str] = {}
    for prof, nofit in refusals:
        for node, why in nofit.reasons.items():
            reasons[node] = f"{reasons[node]}; " if node in reasons else ""
            reasons[node] += f"{prof.name}: {why}"
    return NoFit(reasons), profiles[0]


def wanted(spec: s.ModelSpec, last_use: float | None, now: float, idle_slack: float = 0.0,
           target: int | None = None) -> int:
    """Replicas a model should have.

    The floor: `replicas.min` when above 0. A model with min 0 (and max
    above 0 and an idle timeout) gets one replica while it has been used
    within its idle timeout, plus `idle_slack` (how late the leader may hear
    of a use), and none after: idle stop. A min-0 spec without an idle
    timeout (stored before that rule) keeps meaning what it did: nothing
    placed.

    `target` is the count load-based scaling decided (app/control/
    scaling.py): it moves a model above its floor, never past `replicas.max`,
    and never wakes an idle model.
    """
    rng = spec.replica_range
    if rng.min > 0:
        floor = rng.min
    elif rng.max == 0 or spec.idle_timeout is None or last_use is None:
        floor = 0
    else:
        floor = 1 if now - last_use < spec.idle_timeout + idle_slack else 0
    if floor == 0 or target is None:
        return floor
    return max(floor, min(target, rng.max))


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
    nodeconfs: Mapping[str, s.NodeConf] | None = None,
    quotas: Mapping[str, s.Quota] | None = None,
    agent_window: Window | None = None,
    failed: Collection[str] = (),
    targets: Mapping[str, int] | None = None,
    loads: Mapping[str, float] | None = None,
    secret_id: str = "",
    unrecorded_secret_id: str = "",
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
    `replicas.min` 0 (see `wanted()`). `targets` (model -> replicas) is
    what load-based scaling decided (`wanted()` keeps it within the spec's
    range); a surplus drains the replicas serving nothing first, then the
    least loaded by `loads` (replica -> engine load; one left out counts as
    the busiest, unknown never being idle).

    `failed` names replicas their agent gave up on (they kept dying) and
    whose retry backoff is over (the reconciler keeps it): each is drained
    and its replacement placed on another node when one can take it.

    `secret_id` is the id of the shared secret new replicas are placed
    under (keys.SecretRing.fleet_secret_id); a replica of another secret
    (one recording none counts as `unrecorded_secret_id`) rolls like one of
    a changed spec, new before old, so a rotation of the secret fails no
    request (docs/architecture.md, Security: Rotating the shared secret).

    `nodeconfs` and `quotas` go to place() (cordons, pools, quota scopes).
    A replica on a node being drained, or on a GPU its agent reports sick
    and no admin has cleared (gpuhealth.py), rolls like one of a changed
    spec: its replacement goes elsewhere first. Models are served by priority (their
    first profile's), highest first: one whose minimum finds no room may
    displace replicas of lower-priority models above their own minimum
    (placement.displace()); those drain, and the room is taken once they stop.
    """
    absent = absent_for or {}
    confs = nodeconfs or {}
    fitting: dict[str, Any] = {"nodeconfs": confs, "quotas": quotas or {}, "models": models,
                            "agent_versions": agent_window}
    phases = statuses or {}
    counts = inflight or {}
    used = last_used or {}
    scaled = targets or {}
    load = loads or {}
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

    def by_priority(item: tuple[str, s.StoredModel]) -> tuple[int, str]:
        profiles = item[1].profile_list
        return (-(profiles[0].priority if profiles else 0), item[0])

    sick = sick_by_node(nodes, confs)

    def moving(rid: str) -> bool:
        # On a drained node, or on a GPU fallen sick (gpuhealth.py): its
        # replacement goes elsewhere first, as for a changed spec.
        conf = confs.get(live[rid].node)
        return (conf is not None and conf.draining) or bool(on_sick_gpu(live[rid], sick))

    # Indexes built once, not per model (docs/architecture.md, Scale): the
    # replicas by model (a model's own are added to `live` only while it is
    # planned; others' only change their draining_since), and the fleet's
    # fits, kept up to date as replicas are placed.
    by_model: dict[str, list[str]] = {}
    for rid, r in live.items():
        by_model.setdefault(r.model, []).append(rid)
    placer = Placer(nodes, live, **fitting)

    for name, spec in sorted(models.items(), key=by_priority):
        if spec.model is None or not spec.profile_list:
            continue  # external: served by its provider, nothing to place
        mine = sorted(rid for rid in by_model.get(name, ())
                      if live[rid].draining_since is None)
        want = wanted(spec, used.get(name), now, idle_slack, scaled.get(name))
        # Ready ones first, then the busiest, so that a surplus drops those
        # that serve nothing, then the least loaded (their drains end first).
        by_use = sorted(mine, key=lambda rid: (
            not ready(rid), -load.get(rid, math.inf), rid))
        current = [rid for rid in by_use
                   if _matches(spec, live[rid], secret_id, unrecorded_secret_id)
                   and not moving(rid)
                   and rid not in failed]
        # Where this model kept dying: elsewhere first, if anywhere else fits.
        avoid = {live[rid].node for rid in mine if rid in failed}
        stale = [rid for rid in by_use if rid not in current]
        out.drain += current[want:]
        current = current[:want]
        # Old replicas stand in, ready ones only, for as many new ones as
        # are not ready yet.
        short = max(0, want - sum(map(ready, current)))
        keep = [rid for rid in stale if ready(rid)][:short]
        out.drain += [rid for rid in stale if rid not in keep]
        for rid in stale:
            if rid not in keep and (why := on_sick_gpu(live[rid], sick)):
                out.drain_reasons[rid] = why
        for i in range(want - len(current)):
            fit: Fit | NoFit = NoFit({})
            prof = spec.profile_list[0]
            if avoid:
                elsewhere = {n: info for n, info in nodes.items() if n not in avoid}
                fit, prof = _place_any(Placer(elsewhere, live, **fitting), name, spec)
            if isinstance(fit, NoFit):
                fit, prof = _place_any(placer, name, spec)
            if isinstance(fit, NoFit):
                coming = [rid for rid in current if not ready(rid)] + [
                    r.id for r in out.create if r.model == name]
                _no_room(out, name, spec, nodes, live, keep, coming, fit, fitting)
                if name in out.unplaced and len(current) + i < spec.replica_range.min:
                    _displace(out, name, spec, models, nodes, live, now, fitting)
                break
            rep = s.Replica(
                id=replica_id(name, new_suffix()), model=name, node=fit.node,
                gpus=fit.gpus, engine=prof.engine, weights=spec.model,
                weights_revision=spec.revision, profile=prof.name,
                engine_args=prof.engine_flags, secret=secret_id,
            )
            live[rep.id] = rep
            placer.add(rep)
            out.create.append(rep)
    return out


def _displace(out: Plan, name: str, spec: s.StoredModel,
              models: Mapping[str, s.StoredModel], nodes: Mapping[str, s.NodeInfo],
              live: dict[str, s.Replica], now: float, fitting: dict[str, Any]) -> None:
    """Room for a replica of `name`'s minimum, made by draining replicas of
    lower-priority models above their own minimum (placement.displace())."""
    # This pass's drains count as leaving, or the same room is picked twice.
    view = {rid: r.model_copy(update={"draining_since": now})
            if rid in out.drain and r.draining_since is None else r
            for rid, r in live.items()}
    d = displace(name, spec, models, nodes, view, nodeconfs=fitting["nodeconfs"],
                 quotas=fitting["quotas"])
    if d is None:
        return
    for rid in d.victims:
        out.drain.append(rid)
        live[rid] = view[rid].model_copy(update={"draining_since": now})
        out.reasons[live[rid].model] = f"{rid} displaced: {d.why.get(rid, '')}"
        out.drain_reasons[rid] = d.why.get(rid, "displaced by a higher-priority model")
    stopping = d.victims or sorted(rid for rid, r in view.items() if r.node == d.node
                                   and r.draining_since is not None)
    out.unplaced[name] += (f"; waiting for {', '.join(stopping)} to stop on {d.node}"
                           if stopping else "")


def _no_room(out: Plan, name: str, spec: s.StoredModel, nodes: Mapping[str, s.NodeInfo],
             live: Mapping[str, s.Replica], keep: list[str], coming: list[str],
             fit: NoFit, fitting: dict[str, Any]) -> None:
    """No node has room for a replica of the new spec: wait for what is on
    its way, else fall back to drain first, one old replica at a time, when
    that makes room."""
    leaving = sorted(rid for rid, r in live.items() if r.model == name
                     and (r.draining_since is not None or rid in out.drain))
    if leaving:
        # Their GPUs come free once they stop: one at a time, never two.
        why = f"no room for a new replica ({fit}): waiting for {', '.join(leaving)} to stop"
        # After a displacement, say both: why it went, and what it waits for.
        out.reasons[name] = f"{out.reasons[name]}; {why}" if name in out.reasons else why
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
        others = {k: v for k, v in live.items() if k != rid}
        if not isinstance(place(name, spec, nodes, others, **fitting), NoFit):
            keep.remove(rid)
            out.drain.append(rid)
            out.reasons[name] = (f"no room for a new replica beside the old ones ({fit}): "
                                 f"draining {rid} first, so {name} runs one replica short "
                                 "until its replacement is ready")
            return
    out.unplaced[name] = str(fit)
    out.reasons[name] = (f"no room for the new spec even in place of an old replica "
                         f"({fit}): the old replicas keep serving")
