"""The reconcile plan: the leader's whole pass as a pure function, no I/O.

`plan()` takes the whole desired and observed state and returns what to
write; the reconciler applies it. Being pure, it is tested by calling it.
It reads as the list of its phases, each a function of
app/control/plan_phases.py (what is gone, what is orphaned, the order
models are served in, which replicas still run their spec, what stays)
and app/control/plan_place.py (placing what is missing). Where each new
replica goes is `placement.place()`'s decision.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from typing import Any

from app.control import state as s
from app.control.agentversion import Window
from app.control.gpuhealth import on_sick_gpu, sick_by_node
from app.control.placement import Placer
from app.control.plan_phases import (
    Plan,
    placing_order,
    sort_out,
    sweep,
    trim,
)
from app.control.plan_place import Fleet, place_missing, say_waits
from app.wire.adapters import lora_bases

__all__ = ["Plan", "plan", "wanted"]


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
    meanwhile (app/gateway/publish.py).

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
    confs, used, scaled = nodeconfs or {}, last_used or {}, targets or {}
    fitting: dict[str, Any] = {"nodeconfs": confs, "quotas": quotas or {}, "models": models,
                               "agent_versions": agent_window}
    out = Plan()
    swept = sweep(replicas, nodes, absent_for=absent_for or {}, node_grace=node_grace,
                  inflight=inflight or {}, now=now, drain_seconds=drain_seconds,
                  statuses=statuses or {}, models=models)
    out.delete += swept.delete
    live = swept.live
    ready = swept.ready
    out.drain += swept.orphans
    sick = sick_by_node(nodes, confs)

    # Indexes built once, not per model (docs/architecture.md, Scale): the
    # replicas by model (a model's own are added to `live` only while it is
    # planned; others' only change their draining_since), and the fleet's
    # fits, kept up to date as replicas are placed.
    by_model = swept.by_model
    bases = lora_bases(models)  # once a pass: adapters_of() per replica scanned the catalog
    fleet = Fleet(models, nodes, live, Placer(nodes, live, **fitting), fitting, now, bases,
                  by_model=by_model)

    for name, spec in placing_order(models):
        want = wanted(spec, used.get(name), now, idle_slack, scaled.get(name))
        mine = sort_out(spec, by_model.get(name, []), live, ready=ready, loads=loads or {},
                        nodeconfs=confs, failed=failed, secret_id=secret_id,
                        unrecorded_secret_id=unrecorded_secret_id, sick=sick,
                        lora=name in bases)
        kept = trim(mine, want, ready)
        out.drain += kept.drain
        for rid in mine.stale:
            if rid not in kept.keep and (why := on_sick_gpu(live[rid], sick)):
                out.drain_reasons[rid] = why
        place_missing(out, fleet, name, spec, want, kept, mine.avoid, ready,
                      new_suffix=new_suffix, secret_id=secret_id)
    say_waits(out, fleet)
    return out
