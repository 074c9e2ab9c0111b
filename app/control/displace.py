"""Priorities when GPUs are short: which lower-priority replicas give way
so that a higher-priority model's minimum finds room. A pure function beside
placement.place(), which it asks where room would be made."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from app.control import fleet
from app.control import state as s
from app.control.placement import Fit, place


@dataclass(frozen=True)
class Displacement:
    """Room for one replica on `node` once `victims` (replica ids) stop; `why`
    says, per victim, what displaced it. No victims: replicas already
    draining there make the room, wait for them."""

    node: str
    victims: list[str]
    why: dict[str, str]




def displace(
    name: str,
    spec: s.ModelSpec,
    models: Mapping[str, s.ModelSpec],
    nodes: Mapping[str, s.NodeInfo],
    replicas: Mapping[str, s.Replica],
    *,
    profile: s.Profile | None = None,
    nodeconfs: Mapping[str, s.NodeConf] | None = None,
    quotas: Mapping[str, s.Quota] | None = None,
    refused: bool = False,
) -> Displacement | None:
    """Which lower-priority replicas to drain so that one more replica of
    `name` (a replica of its minimum that place() could not fit) finds room;
    None if no choice of them would do.

    Only replicas of models of a lower priority than `profile`'s (by default
    the first), and only those above their own model's minimum: a
    higher-priority model never takes a lower one below its minimum. It picks
    the node needing the fewest victims (then the lowest priorities). Room
    that draining replicas will free counts as made: the answer is then that
    node with no victims, so that a pass taken while the first victims drain
    does not pick more.

    `refused`: place() already found no node for it over `replicas`, so
    (quota aside) only nodes where replicas are draining can have room once
    they stop: only those are asked, not the whole fleet again.
    """
    profiles = spec.profile_list
    if not profiles:
        return None
    prof = profile if profile is not None else profiles[0]
    models = {**models, name: spec}
    staying = {rid: r for rid, r in replicas.items() if r.draining_since is None}
    by_node: dict[str, dict[str, s.Replica]] = {}
    for rid, r in staying.items():
        by_node.setdefault(r.node, {})[rid] = r
    # The quota is checked here rather than by place(), and place() sees one
    # node's replicas only: each trial is then as small as the node (measured:
    # 100 full 8-GPU nodes, from 1.2 s to 30 ms).
    scope = spec.quota
    cap = (quotas or {}).get(scope) if scope is not None else None
    held = fleet.quota_use(models, staying).get(scope, 0) if scope is not None else 0

    def fits(on: str, without: set[str]) -> bool:
        left = {rid: r for rid, r in by_node.get(on, {}).items() if rid not in without}
        if not isinstance(place(name, spec, {on: nodes[on]}, left, profile=prof,
                                nodeconfs=nodeconfs), Fit):
            return False
        if cap is None or prof.gpu_count == 0:
            return True
        freed = sum(len(staying[v].gpus) for v in without
                    if models[staying[v].model].quota == scope)
        return held - freed + prof.gpu_count <= cap.max_gpus

    asked = nodes
    if refused and cap is None:
        asked = {n: nodes[n] for n in {r.node for r in replicas.values()
                                       if r.draining_since is not None} if n in nodes}
    waiting = place(name, spec, asked, staying, profile=prof, nodeconfs=nodeconfs,
                    quotas=quotas, models=models)
    if isinstance(waiting, Fit):
        return Displacement(waiting.node, [], {})
    above: dict[str, int] = {}  # replicas each model has above its minimum
    for r in staying.values():
        above[r.model] = above.get(r.model, 0) + 1
    for m in above:
        above[m] -= models[m].replica_range.min if m in models else above[m]
    best: tuple[tuple[int, int, str], list[s.Replica]] | None = None
    for node in sorted(nodes):
        victims = sorted(
            (r for r in by_node.get(node, {}).values() if r.model != name
             and r.model in models and fleet.replica_priority(models, r) < prof.priority),
            key=lambda r: (fleet.replica_priority(models, r), r.id))
        budget = dict(above)
        allowed = []
        for v in victims:
            if budget[v.model] > 0:
                budget[v.model] -= 1
                allowed.append(v)
        if not allowed or not fits(node, {v.id for v in allowed}):
            continue  # one trial rules out a node that even all its victims cannot free
        taken: list[s.Replica] = []
        budget = dict(above)
        for v in victims:
            if budget[v.model] <= 0:
                continue
            budget[v.model] -= 1
            taken.append(v)
            if fits(node, {t.id for t in taken}):
                break
        else:
            continue
        # Greedy removal may have taken one that the later ones made needless.
        for v in list(reversed(taken)):
            if len(taken) > 1 and fits(node, {t.id for t in taken if t is not v}):
                taken.remove(v)
        key = (len(taken), sum(fleet.replica_priority(models, t) for t in taken), node)
        if best is None or key < best[0]:
            best = (key, taken)
    if best is None:
        return None
    node = best[0][2]
    why = {v.id: (f"displaced by {name} (priority {prof.priority} over "
                  f"{fleet.replica_priority(models, v)}), whose minimum did not fit; "
                  f"on {node}") for v in best[1]}
    return Displacement(node, [v.id for v in best[1]], why)
