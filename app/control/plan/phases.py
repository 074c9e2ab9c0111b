"""The phases of one reconcile pass, in the order `planner.plan()` runs
them, but the last (placing a model's missing replicas: placing.py).

Each takes what it reads as arguments and returns what it decided, as
`plan()` adds it to the pass's `Plan`. All pure: no I/O, no clock.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field

from app.control import state as s
from app.control.gpuhealth import on_sick_gpu
from app.wire.adapters import engine_flags


@dataclass
class Plan:
    create: list[s.Replica] = field(default_factory=list)
    drain: list[str] = field(default_factory=list)
    delete: list[str] = field(default_factory=list)
    # Why a model's missing replica cannot be placed (placement's NoFit, said).
    unplaced: dict[str, str] = field(default_factory=dict)
    # Rollout decisions worth a log line: a drain-first fallback, a wait.
    reasons: dict[str, str] = field(default_factory=dict)
    # Why a drained replica goes, where its model's status should say so.
    drain_reasons: dict[str, str] = field(default_factory=dict)

    @property
    def empty(self) -> bool:
        return not (self.create or self.drain or self.delete)


# --- 1. sweep: what is gone ---------------------------------------------------


@dataclass
class Swept:
    """What a pass's one walk of the replicas found: those the rest of the
    pass counts (`live`), those to delete (`delete`, in the order of the
    replicas given), the live ones ready as the router sees them (`ready`),
    those to drain as their model went (`orphans`, by id), and each model's
    live replicas (`by_model`, draining ones included, in `live`'s order).
    One walk, not four: at 10,000 nodes each walk of 20,000 replicas was
    10-25 ms of the pass."""

    live: dict[str, s.Replica]
    delete: list[str]
    ready: set[str] = field(default_factory=set)
    orphans: list[str] = field(default_factory=list)
    by_model: dict[str, list[str]] = field(default_factory=dict)


@dataclass(frozen=True)
class Sweep:
    """What the sweep weighs each replica against (planner.PlanInput and
    PlanPolicy say what each is)."""

    absent_for: Mapping[str, float]
    node_grace: float
    inflight: Mapping[str, int]
    now: float
    drain_seconds: float
    statuses: Mapping[str, s.ReplicaStatus] = field(default_factory=dict)
    models: Mapping[str, s.StoredModel] | None = None


def sweep(replicas: Mapping[str, s.Replica], nodes: Mapping[str, s.NodeInfo],
          how: Sweep) -> Swept:
    """Deletes the replicas of a node absent (`absent_for`) past `node_grace`,
    left out of `live`, and the draining replicas whose drain is over: none
    in flight by `inflight`, or `drain_seconds` since it began. Those stay in
    `live` for the rest of the pass, their GPUs still counted as taken.

    Ready: reported ready (`statuses`), on a node heard from. Orphans: not
    draining yet, their model deleted from `models` or turned external."""
    out = Swept({}, [])
    live, delete, ready, by_model = out.live, out.delete, out.ready, out.by_model
    sts, absent_for, node_grace = how.statuses, how.absent_for, how.node_grace
    models = how.models
    inflight, now, drain_seconds = how.inflight, how.now, how.drain_seconds
    gone: dict[str, bool] = {}  # per model, not per replica
    orphaned_ids = []
    for rid, r in replicas.items():
        node = r.node
        heard = node in nodes
        if not heard and absent_for.get(node, 0.0) >= node_grace:
            # Gone past its grace: nothing there to drain, nothing routes to it.
            delete.append(rid)
            continue
        live[rid] = r
        model = r.model
        ids = by_model.get(model)
        if ids is None:
            by_model[model] = [rid]
        else:
            ids.append(rid)
        if heard and (st := sts.get(rid)) is not None and st.phase == "ready":
            ready.add(rid)
        if r.draining_since is not None:
            if inflight.get(rid) == 0 or now - r.draining_since >= drain_seconds:
                delete.append(rid)
        elif models is not None:
            orphaned = gone.get(model)
            if orphaned is None:
                spec = models.get(model)
                orphaned = gone[model] = spec is None or not _placed(spec)
            if orphaned:
                orphaned_ids.append(rid)
    out.orphans = sorted(orphaned_ids)
    return out


# --- 2. orphans (found by the sweep): replicas whose model went --------------------


def _placed(spec: s.StoredModel) -> bool:
    """Whether the model runs on the fleet's engines (else it is external:
    served by its provider, nothing to place)."""
    return spec.model is not None and bool(spec.profile_list)


# --- 3. the models in the order they are served -----------------------------------


def placing_order(models: Mapping[str, s.StoredModel]) -> list[tuple[str, s.StoredModel]]:
    """The models with replicas to place, by priority (their first
    profile's), highest first, then by name: a higher one's minimum may
    displace a lower one's replicas, never the reverse."""
    order = []
    for name, spec in models.items():
        profiles = spec.profile_list
        if spec.model is not None and profiles:  # _placed(), reading the profiles once
            order.append((-profiles[0].priority, name, spec))
    order.sort(key=lambda item: (item[0], item[1]))
    return [(name, spec) for _, name, spec in order]


# --- 4. a model's own replicas: which still run its spec ---------------------------


# What a replica runs that its spec decides: weights, revision, engine,
# GPU count, engine flags.
_Runs = tuple[str | None, str | None, str, int, list[str]]


def _spec_runs(spec: s.StoredModel, lora: bool = False
               ) -> tuple[dict[str, _Runs], _Runs] | None:
    """What a replica of each of the spec's profiles runs, by profile name,
    and what one of an unnamed or renamed profile is held to: the first
    profile's (so renaming the only profile restarts no engine). Worked out
    once per model, not per replica. None: external, nothing runs it.
    `lora`: adapters name the model (its vLLM flags gain LoRA's, see
    docs/design/lora-adapters.md)."""
    profiles = spec.profile_list
    if not profiles:
        return None
    runs: dict[str, _Runs] = {}
    for p in profiles:
        runs.setdefault(p.name, (spec.model, spec.revision, p.engine, p.gpu_count,
                                 engine_flags(p, lora)))
    return runs, runs[profiles[0].name]


def _matches(runs: tuple[dict[str, _Runs], _Runs] | None, r: s.Replica, secret_id: str,
             unrecorded: str) -> bool:
    """Whether replica `r` still runs what the spec asks for (`runs`, from
    `_spec_runs()`): the engine, GPUs and flags of the profile it was placed
    with, with a key of the fleet's secret (`secret_id`; `unrecorded` is
    what a replica recording none is of, see keys.replica_secret_id). A
    model turned external has no replicas."""
    if runs is None or (r.secret or unrecorded) != secret_id:
        return False
    by_name, first = runs
    return (r.weights, r.weights_revision, r.engine, len(r.gpus), r.engine_args) == (
        by_name.get(r.profile, first))


@dataclass
class Mine:
    """A model's replicas that are not draining, each either `current` or
    `stale`, both ready ones first, then the busiest; and the nodes to
    `avoid`, where the model's replicas kept dying."""

    # Run what the spec asks, under the fleet's secret, on a node not being
    # drained, not given up on by their agent.
    current: list[str]
    # To be replaced, new before old: a changed spec, another secret, a node
    # being drained, or given up on.
    stale: list[str]
    avoid: set[str]


@dataclass(frozen=True)
class Owned:
    """What sorting out any model's replicas reads, the same for a whole
    pass: the `live` replicas and the `ready` ones, engine `loads`, node
    confs (drains), replicas their agent gave up on (`failed`), the fleet's
    secret (`secret_id`; `unrecorded_secret_id`: what a replica recording
    none is of) and the sick GPUs (`sick`: node -> its sick GPUs)."""

    live: Mapping[str, s.Replica]
    ready: Collection[str]
    loads: Mapping[str, float]
    nodeconfs: Mapping[str, s.NodeConf]
    failed: Collection[str]
    secret_id: str
    unrecorded_secret_id: str
    sick: Mapping[str, Mapping[int, str]] | None = None


def sort_out(spec: s.StoredModel, ids: Collection[str], owned: Owned,
             lora: bool = False) -> Mine:
    """The model's replicas (`ids`) sorted out, those draining left out. A
    replica `loads` leaves out counts as the busiest: unknown is never idle.
    One walk of the model's replicas, each read once (it ran for every
    replica of the fleet in each pass: docs/design/scale.md)."""
    runs = _spec_runs(spec, lora)
    live, ready, loads, nodeconfs, failed, sick = (
        owned.live, owned.ready, owned.loads, owned.nodeconfs, owned.failed, owned.sick)
    secret_id, unrecorded_secret_id = owned.secret_id, owned.unrecorded_secret_id
    current: list[str] = []
    stale: list[str] = []
    avoid: set[str] = set()  # where this model kept dying: elsewhere first, if anywhere fits
    for rid in ids:
        r = live[rid]
        if r.draining_since is not None:
            continue
        if rid in failed:
            avoid.add(r.node)
            stale.append(rid)
        elif _matches(runs, r, secret_id, unrecorded_secret_id) and not (
                # On a drained node, or on a GPU fallen sick (gpuhealth.py;
                # `sick`: node -> its sick GPUs): its replacement goes
                # elsewhere first, as for a changed spec.
                (nodeconfs and (conf := nodeconfs.get(r.node)) is not None and conf.draining)
                or (sick and on_sick_gpu(r, sick))):
            current.append(rid)
        else:
            stale.append(rid)

    def by_use(rid: str) -> tuple[bool, float, str]:
        # Ready ones first, then the busiest, so that a surplus drops those
        # that serve nothing, then the least loaded (their drains end first).
        return (rid not in ready, -loads.get(rid, math.inf), rid)

    if len(current) > 1:
        current.sort(key=by_use)
    if len(stale) > 1:
        stale.sort(key=by_use)
    return Mine(current=current, stale=stale, avoid=avoid)


# --- 5. the surplus and the stand-ins ----------------------------------------------


@dataclass
class Trimmed:
    """What of a model's replicas stays: `current` ones, `want` at most, and
    `keep`, stale ones standing in; the rest `drain`s."""

    current: list[str]
    # Ready stale replicas, as many as current ones are missing or not ready.
    keep: list[str]
    # The surplus of current replicas, then the stale ones not kept.
    drain: list[str]


def trim(mine: Mine, want: int, ready: Collection[str]) -> Trimmed:
    """Old replicas stand in, ready ones only, for as many new ones as are
    not ready yet."""
    current = mine.current[:want]
    short = max(0, want - sum(rid in ready for rid in current))
    keep = [rid for rid in mine.stale if rid in ready][:short]
    return Trimmed(current=current, keep=keep,
                   drain=mine.current[want:] + [rid for rid in mine.stale if rid not in keep])
