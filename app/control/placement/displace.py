"""Priorities when GPUs are short: which lower-priority replicas give way
so that a higher-priority model's minimum finds room. A pure function beside
the placer's place() (placer.py), which it asks where room would be made."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from app.control import state as s
from app.control.placement import fleet
from app.control.placement.placer import place
from app.control.placement.verdict import Fit


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
    nodeconfs: Mapping[str, s.NodeConf] | None = None,
    quotas: Mapping[str, s.Quota] | None = None,
    refused: bool = False,
) -> Displacement | None:
    """Which lower-priority replicas to drain so that one more replica of
    `name` (a replica of its minimum that place() could not fit) finds room;
    None if no choice of them would do.

    Only replicas of models of a lower priority than its first profile's,
    and only those above their own model's minimum: a higher-priority model
    never takes a lower one below its minimum. It picks the node needing
    the fewest victims (then the lowest priorities). Room that draining
    replicas will free counts as made: the answer is then that node with no
    victims, so that a pass taken while the first victims drain does not
    pick more.

    `refused`: place() already found no node for it over `replicas`, so
    (quota aside) only nodes where replicas are draining can have room once
    they stop: only those are asked, not the whole fleet again.
    """
    if not spec.profile_list:
        return None
    room = _Room(name, spec, {**models, name: spec}, nodes, replicas, nodeconfs, quotas or {})
    waiting = room.waiting(refused)
    if waiting is not None:
        return Displacement(waiting, [], {})
    best: tuple[tuple[int, int, str], list[s.Replica]] | None = None
    for node in sorted(nodes):
        taken = room.victims_on(node)
        if taken is None:
            continue
        key = (len(taken), sum(fleet.replica_priority(room.models, t) for t in taken), node)
        if best is None or key < best[0]:
            best = (key, taken)
    if best is None:
        return None
    node, prio = best[0][2], room.prof.priority
    why = {v.id: (f"displaced by {name} (priority {prio} over "
                  f"{fleet.replica_priority(room.models, v)}), whose minimum did not fit; "
                  f"on {node}") for v in best[1]}
    return Displacement(node, [v.id for v in best[1]], why)


class _Room:
    """One displace() question: one more replica of `name` (its first
    profile), over the replicas not draining, node by node."""

    def __init__(self, name: str, spec: s.ModelSpec, models: Mapping[str, s.ModelSpec],
                 nodes: Mapping[str, s.NodeInfo], replicas: Mapping[str, s.Replica],
                 nodeconfs: Mapping[str, s.NodeConf] | None,
                 quotas: Mapping[str, s.Quota]) -> None:
        self.name, self.spec, self.models, self.nodes = name, spec, models, nodes
        self.prof = spec.profile_list[0]
        self.replicas, self.nodeconfs, self.quotas = replicas, nodeconfs, quotas
        self.staying = {rid: r for rid, r in replicas.items() if r.draining_since is None}
        self.by_node: dict[str, dict[str, s.Replica]] = {}
        for rid, r in self.staying.items():
            self.by_node.setdefault(r.node, {})[rid] = r
        # The quota is checked here rather than by place(), and place() sees one
        # node's replicas only: each trial is then as small as the node (measured:
        # 100 full 8-GPU nodes, from 1.2 s to 30 ms).
        self.scope = scope = spec.quota
        self.cap = quotas.get(scope) if scope is not None else None
        self.held = (fleet.quota_use(models, self.staying).get(scope, 0)
                     if scope is not None else 0)
        self.above: dict[str, int] = {}  # replicas each model has above its minimum
        for r in self.staying.values():
            self.above[r.model] = self.above.get(r.model, 0) + 1
        for m in self.above:
            self.above[m] -= models[m].replica_range.min if m in models else self.above[m]

    def waiting(self, refused: bool) -> str | None:
        """The node where replicas already draining make the room, if any."""
        asked = self.nodes
        if refused and self.cap is None:
            asked = {n: self.nodes[n] for n in {r.node for r in self.replicas.values()
                                                if r.draining_since is not None}
                     if n in self.nodes}
        fit = place(self.name, self.spec, asked, self.staying, profile=self.prof,
                    nodeconfs=self.nodeconfs, quotas=self.quotas, models=self.models)
        return fit.node if isinstance(fit, Fit) else None

    def fits(self, on: str, without: set[str]) -> bool:
        left = {rid: r for rid, r in self.by_node.get(on, {}).items() if rid not in without}
        if not isinstance(place(self.name, self.spec, {on: self.nodes[on]}, left,
                                profile=self.prof, nodeconfs=self.nodeconfs), Fit):
            return False
        if self.cap is None or self.prof.gpu_count == 0:
            return True
        freed = sum(len(self.staying[v].gpus) for v in without
                    if self.models[self.staying[v].model].quota == self.scope)
        return self.held - freed + self.prof.gpu_count <= self.cap.max_gpus

    def victims_on(self, node: str) -> list[s.Replica] | None:
        """The fewest lower-priority replicas on `node` whose going makes
        room, lowest priorities first; None if none would."""
        models = self.models
        victims = sorted(
            (r for r in self.by_node.get(node, {}).values() if r.model != self.name
             and r.model in models
             and fleet.replica_priority(models, r) < self.prof.priority),
            key=lambda r: (fleet.replica_priority(models, r), r.id))
        budget = dict(self.above)
        allowed = []
        for v in victims:
            if budget[v.model] > 0:
                budget[v.model] -= 1
                allowed.append(v)
        if not allowed or not self.fits(node, {v.id for v in allowed}):
            return None  # one trial rules out a node that even all its victims cannot free
        taken: list[s.Replica] = []
        budget = dict(self.above)
        for v in victims:
            if budget[v.model] <= 0:
                continue
            budget[v.model] -= 1
            taken.append(v)
            if self.fits(node, {t.id for t in taken}):
                break
        else:
            return None
        # Greedy removal may have taken one that the later ones made needless.
        for v in list(reversed(taken)):
            if len(taken) > 1 and self.fits(node, {t.id for t in taken if t is not v}):
                taken.remove(v)
        return taken
