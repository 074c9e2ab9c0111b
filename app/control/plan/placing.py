"""The last phase of a reconcile pass (phases.py has the others): placing
a model's missing replicas, each where placement (`place_any()`,
app/control/placement/placer.py) finds room, else saying what the model
waits for, or making room by displacing lower-priority replicas
(app/control/placement/displace.py).

It adds to the pass's `Plan` and `Fleet` in place: each replica placed or
displaced changes where the next one fits.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field

from app.control import state as s
from app.control.placement import fleet as fleet_of
from app.control.placement.agentversion import Window
from app.control.placement.displace import displace
from app.control.placement.placer import Placer, place_any
from app.control.placement.verdict import Fit, NoFit
from app.control.plan.phases import Plan, Trimmed
from app.wire.adapters import engine_flags

_SLUG = re.compile(r"[^a-z0-9]+")
_ANY = 2 ** 62  # above any priority a spec can give


def replica_id(model: str, suffix: str) -> str:
    slug = _SLUG.sub("-", model.lower()).strip("-")[:40] or "model"
    return f"{slug}-{suffix}"


@dataclass(frozen=True)
class Fitting:
    """What placement applies besides the nodes and replicas, as the
    leader's pass gives it (and `placer_of()` for the gateways): node
    confs (cordons, drains, pools, labels, cleared GPUs), quotas, the
    models whose replicas count against them, the agent window."""

    nodeconfs: Mapping[str, s.NodeConf]
    quotas: Mapping[str, s.Quota]
    models: Mapping[str, s.ModelSpec]
    agent_versions: Window | None = None

    def placer(self, nodes: Mapping[str, s.NodeInfo],
               replicas: Mapping[str, s.Replica]) -> Placer:
        return Placer(nodes, replicas, nodeconfs=self.nodeconfs, quotas=self.quotas,
                      models=self.models, agent_versions=self.agent_versions)


@dataclass(frozen=True)
class Placing:
    """One model's placing in a pass: `want` replicas of `name`, of which
    `kept` says what stays, away from `avoid` (nodes where it kept dying)
    if anywhere else fits; `ready`: the pass's ready replicas."""

    name: str
    spec: s.StoredModel
    want: int
    kept: Trimmed
    avoid: Collection[str]
    ready: Collection[str]


@dataclass
class Fleet:
    """What placing reads and changes over a whole pass. `live` gains each
    replica placed and the drain mark of each one displaced; `placer` holds
    the fits over `live` (told of each replica placed); `fitting` is what
    else placement applies."""

    models: Mapping[str, s.StoredModel]
    nodes: Mapping[str, s.NodeInfo]
    live: dict[str, s.Replica]
    placer: Placer
    fitting: Fitting
    now: float
    lora_bases: Collection[str] = frozenset()  # the models some adapter names
    # Each model's replicas in `live` when the pass began (phases.
    # replicas_by_model), and those this pass placed: what a model waiting
    # for room reads of its own, not a scan of the fleet per model.
    by_model: Mapping[str, list[str]] = field(default_factory=dict)
    created: dict[str, list[str]] = field(default_factory=dict)
    # The lowest priority of a replica not draining (None: not worked out
    # yet), lowered by each replica placed: no victim is below it.
    lowest: int | None = None
    # Models short of their minimum that no victim can serve: what they
    # wait for (room being freed) is said once the pass is over.
    waits: list[str] = field(default_factory=list)


def place_missing(out: Plan, fleet: Fleet, ask: Placing, *,
                  new_suffix: Callable[[], str], secret_id: str) -> None:
    """Adds to `out` a replica of `name` for each that `want` finds missing
    from `kept.current`, away from `avoid` if anywhere else fits, until one
    fits nowhere: then `_no_room()` says what the model waits for, and a
    model short of its minimum displaces lower-priority replicas."""
    name, spec, want, kept, avoid, ready = (
        ask.name, ask.spec, ask.want, ask.kept, ask.avoid, ask.ready)
    live, current, weights = fleet.live, kept.current, spec.model
    if weights is None:
        return  # external: phases.placing_order() leaves it out
    for i in range(want - len(current)):
        fit: Fit | NoFit = NoFit({})
        prof = spec.profile_list[0]
        if avoid:
            elsewhere = {n: info for n, info in fleet.nodes.items() if n not in avoid}
            fit, prof = place_any(fleet.fitting.placer(elsewhere, live), name, spec)
        if isinstance(fit, NoFit):
            fit, prof = place_any(fleet.placer, name, spec)
        if isinstance(fit, NoFit):
            coming = [rid for rid in current if rid not in ready] + fleet.created.get(name, [])
            _no_room(out, name, spec, fleet, kept, coming, fit)
            if name in out.unplaced and len(current) + i < spec.replica_range.min:
                if _victims_possible(fleet, spec):
                    _displace(out, name, spec, fleet)
                else:
                    fleet.waits.append(name)
            break
        rep = s.Replica(
            id=replica_id(name, new_suffix()), model=name, node=fit.node,
            gpus=fit.gpus, engine=prof.engine, weights=weights,
            weights_revision=spec.revision, profile=prof.name,
            engine_args=engine_flags(prof, name in fleet.lora_bases),
            secret=secret_id,
        )
        live[rep.id] = rep
        fleet.placer.add(rep)
        out.create.append(rep)
        fleet.created.setdefault(name, []).append(rep.id)
        if fleet.lowest is not None:
            fleet.lowest = min(fleet.lowest, prof.priority)


def _displace(out: Plan, name: str, spec: s.StoredModel, fleet: Fleet) -> None:
    """Room for a replica of `name`'s minimum, made by draining replicas of
    lower-priority models above their own minimum (placement/displace.py)."""
    live, now = fleet.live, fleet.now
    view = _leaving(out, live, now)
    d = displace(name, spec, fleet.models, fleet.nodes, view,
                 nodeconfs=fleet.fitting.nodeconfs, quotas=fleet.fitting.quotas, refused=True)
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


def _leaving(out: Plan, live: Mapping[str, s.Replica], now: float) -> dict[str, s.Replica]:
    """`live` with this pass's drains marked draining, or the same room is
    picked twice."""
    view = dict(live)
    for rid in set(out.drain):
        if (r := live.get(rid)) is not None and r.draining_since is None:
            view[rid] = r.model_copy(update={"draining_since": now})
    return view


def _victims_possible(fleet: Fleet, spec: s.StoredModel) -> bool:
    """Whether displace() could drain something for `spec` (its first
    profile's priority): a replica of a lower priority is running, or a
    quota it counts against is in play (displace() weighs that whole)."""
    prof = spec.profile_list[0]
    if spec.quota is not None and spec.quota in fleet.fitting.quotas and prof.gpu_count:
        return True
    if fleet.lowest is None:
        fleet.lowest = min((fleet_of.replica_priority(fleet.models, r)
                            for r in fleet.live.values() if r.draining_since is None),
                           default=_ANY)
    return fleet.lowest < prof.priority


def say_waits(out: Plan, fleet: Fleet) -> None:
    """For each model of `fleet.waits`, the room it waits for: the node
    where replicas draining (before or in this pass) leave it room once
    they stop, as displace() says it when it finds no victim. Worked out
    once for them all after the pass, not with a scan of the fleet per
    model (a full fleet's rollout drains on every node)."""
    if not fleet.waits:
        return
    view = _leaving(out, fleet.live, fleet.now)
    going: dict[str, list[str]] = {}
    for rid, r in view.items():
        if r.draining_since is not None:
            going.setdefault(r.node, []).append(rid)
    if not going:
        return
    # Only those nodes, and what stays on them: the rest of the fleet is full.
    staying = {rid: r for rid, r in view.items()
               if r.draining_since is None and r.node in going}
    placer = Placer({n: fleet.nodes[n] for n in going if n in fleet.nodes}, staying,
                    nodeconfs=fleet.fitting.nodeconfs)
    for name in fleet.waits:
        fit = placer.place(name, fleet.models[name])
        if isinstance(fit, Fit):
            out.unplaced[name] += (f"; waiting for {', '.join(sorted(going[fit.node]))} "
                                   f"to stop on {fit.node}")


def _no_room(out: Plan, name: str, spec: s.StoredModel, fleet: Fleet, kept: Trimmed,
             coming: list[str], fit: NoFit) -> None:
    """No node has room for a replica of the new spec: wait for what is on
    its way, else fall back to drain first, one old replica at a time, when
    that makes room."""
    live, keep, going = fleet.live, kept.keep, set(kept.drain)
    # Draining already, marked so this pass (displaced), or drained by it.
    leaving = sorted(rid for rid in fleet.by_model.get(name, ())
                     if live[rid].draining_since is not None or rid in going)
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
        if fleet.placer.fits_without(name, spec, rid):
            keep.remove(rid)
            out.drain.append(rid)
            out.reasons[name] = (f"no room for a new replica beside the old ones ({fit}): "
                                 f"draining {rid} first, so {name} runs one replica short "
                                 "until its replacement is ready")
            return
    out.unplaced[name] = str(fit)
    out.reasons[name] = (f"no room for the new spec even in place of an old replica "
                         f"({fit}): the old replicas keep serving")
