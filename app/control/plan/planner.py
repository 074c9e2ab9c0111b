"""The reconcile plan: the leader's whole pass as a pure function, no I/O.

`plan()` takes the whole desired and observed state (`PlanInput`) and the
leader's settings (`PlanPolicy`) and returns what to write; the reconciler
applies it. Being pure, it is tested by calling it. It reads as the list
of its phases, each a function of phases.py (what is gone, what is
orphaned, the order models are served in, which replicas still run their
spec, what stays) and placing.py (placing what is missing). Where each new
replica goes is placement's decision (app/control/placement/).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field

from app.control import state as s
from app.control.gpuhealth import on_sick_gpu, sick_by_node
from app.control.placement.agentversion import Window
from app.control.plan.phases import (
    Owned,
    Plan,
    Sweep,
    placing_order,
    sort_out,
    sweep,
    trim,
)
from app.control.plan.placing import Fitting, Fleet, Placing, place_missing, say_waits
from app.wire.adapters import lora_bases


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


@dataclass(frozen=True)
class PlanInput:
    """The state one pass reads, as the leader took it from its mirror
    and its own counts (app/control/reconciler.py).

    `absent_for` says, per node that has replicas but no `nodes/` key, for
    how many seconds the caller has counted it absent (a node it does not
    name counts 0 s). `statuses`: replica -> status. `inflight`: per
    draining replica, requests in flight summed over every gateway that
    has let go of it (usage.drain_inflight); one it does not name waits for
    the drain cap. `last_used`: model -> unix time of its last use.
    `nodeconfs` and `quotas` go to placement (cordons, pools, quota
    scopes). `failed`: replicas their agent gave up on whose retry backoff
    is over. `targets`: model -> replicas load-based scaling decided.
    `loads`: replica -> engine load. `secret_id`: the shared secret new
    replicas are placed under (keys.SecretRing.fleet_secret_id);
    `unrecorded_secret_id`: what a replica recording none counts as.
    """

    models: Mapping[str, s.StoredModel]
    nodes: Mapping[str, s.NodeInfo]
    replicas: Mapping[str, s.Replica]
    now: float
    absent_for: Mapping[str, float] = field(default_factory=dict)
    statuses: Mapping[str, s.ReplicaStatus] = field(default_factory=dict)
    inflight: Mapping[str, int] = field(default_factory=dict)
    last_used: Mapping[str, float] = field(default_factory=dict)
    nodeconfs: Mapping[str, s.NodeConf] = field(default_factory=dict)
    quotas: Mapping[str, s.Quota] = field(default_factory=dict)
    failed: Collection[str] = ()
    targets: Mapping[str, int] = field(default_factory=dict)
    loads: Mapping[str, float] = field(default_factory=dict)
    secret_id: str = ""
    unrecorded_secret_id: str = ""


@dataclass(frozen=True)
class PlanPolicy:
    """The leader's settings a pass applies: the drain cap, how new replica
    ids end, the node grace, how late a use can reach the leader
    (`idle_slack`, see `wanted()`), and the agent versions new replicas go
    to (None: this gateway's default window)."""

    drain_seconds: float
    new_suffix: Callable[[], str]
    node_grace: float = 0.0
    idle_slack: float = 0.0
    agent_window: Window | None = None


def plan(state: PlanInput, policy: PlanPolicy) -> Plan:
    """One level-based pass: compares desired counts with `replicas/`.

    A node absent (`state.absent_for`) keeps its replicas, holding their
    GPUs and counting towards their model's replicas, until that reaches
    `policy.node_grace`: a restarting agent or a handover must not reload
    every model (docs/design/placement.md). The router does not
    route to them meanwhile (app/gateway/publish.py).

    A spec change rolls (docs/design/control-plane.md, "Rollout order"): the replacement
    is placed first, and an old replica is drained only once enough
    replicas of the new spec are ready (`statuses`) to stand in for it; an
    old replica that is not ready serves nothing and goes at once. When no
    node has room for the extra replica, the plan waits for a replacement
    already loading, else drains one old replica first (the model runs
    short until its replacement is ready); `reasons` says which. When even
    that would not make room, the old replicas keep serving and `unplaced`
    says why.

    A draining replica is deleted once `inflight` says 0, or after
    `drain_seconds`, the cap, whatever it says.

    `last_used` drives idle stop for models with `replicas.min` 0 (see
    `wanted()`). `targets` is what load-based scaling decided (`wanted()`
    keeps it within the spec's range); a surplus drains the replicas
    serving nothing first, then the least loaded by `loads` (one left out
    counts as the busiest, unknown never being idle).

    Each of `failed` is drained and its replacement placed on another node
    when one can take it. A replica of another secret than `secret_id`
    rolls like one of a changed spec, new before old, so a rotation of the
    secret fails no request (docs/design/security-operations.md, "Rotating the shared secret").

    A replica on a node being drained, or on a GPU its agent reports sick
    and no admin has cleared (gpuhealth.py), rolls like one of a changed
    spec: its replacement goes elsewhere first. Models are served by
    priority (their first profile's), highest first: one whose minimum
    finds no room may displace replicas of lower-priority models above
    their own minimum (placement/displace.py); those drain, and the room
    is taken once they stop.
    """
    models, nodes, now = state.models, state.nodes, state.now
    fitting = Fitting(state.nodeconfs, state.quotas, models, policy.agent_window)
    out = Plan()
    swept = sweep(state.replicas, nodes, Sweep(
        absent_for=state.absent_for, node_grace=policy.node_grace, inflight=state.inflight,
        now=now, drain_seconds=policy.drain_seconds, statuses=state.statuses, models=models))
    out.delete += swept.delete
    live, ready = swept.live, swept.ready
    out.drain += swept.orphans
    sick = sick_by_node(nodes, state.nodeconfs)
    owned = Owned(live=live, ready=ready, loads=state.loads, nodeconfs=state.nodeconfs,
                  failed=state.failed, secret_id=state.secret_id,
                  unrecorded_secret_id=state.unrecorded_secret_id, sick=sick)

    # Indexes built once, not per model (docs/design/scale.md): the
    # replicas by model (a model's own are added to `live` only while it is
    # planned; others' only change their draining_since), and the fleet's
    # fits, kept up to date as replicas are placed.
    by_model = swept.by_model
    bases = lora_bases(models)  # once a pass: adapters_of() per replica scanned the catalog
    fleet = Fleet(models, nodes, live, fitting.placer(nodes, live), fitting, now, bases,
                  by_model=by_model)

    for name, spec in placing_order(models):
        want = wanted(spec, state.last_used.get(name), now, policy.idle_slack,
                      state.targets.get(name))
        mine = sort_out(spec, by_model.get(name, []), owned, lora=name in bases)
        kept = trim(mine, want, ready)
        out.drain += kept.drain
        for rid in mine.stale:
            if rid not in kept.keep and (why := on_sick_gpu(live[rid], sick)):
                out.drain_reasons[rid] = why
        place_missing(out, fleet, Placing(name, spec, want, kept, mine.avoid, ready),
                      new_suffix=policy.new_suffix, secret_id=state.secret_id)
    say_waits(out, fleet)
    return out
