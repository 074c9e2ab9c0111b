"""The router's endpoints made from the mirror's replicas, kept between
publishes and worked out again only where a change touched
(docs/design/scale.md).

A publish used to walk every replica: at 10,000 nodes (20,000 replicas)
that was most of its ~75 ms, at every status report or inventory of the
fleet. `ReplicaEndpoints` keeps each replica's outcome (routed, with its endpoint,
or why not) and indexes replicas by model and by node; the publisher tells
it the keys the mirror says changed (`changed()`), and `update()` works out
again only those replicas (a replica's or status's key: that replica; a
model's: its replicas; a node's, or a node's grace starting or ending: the
replicas on it), then each model with a replica among them. Anything it
cannot tell apart (its first update, a resync's many keys) walks them all.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass

from app.control import state as s
from app.router.published import Endpoint

# A routed replica: what its endpoint was made of (the mirror's parsed
# values: the same objects while their keys do not change), and the endpoint.
_Made = tuple[s.Replica, s.ReplicaStatus, s.StoredModel, Endpoint]

# Past this many keys changed since the last update, walk every replica: a
# resync reports every key it found changed.
_WALK_ALL = 2048


@dataclass(slots=True)
class _Outcome:
    model: str
    node: str
    made: _Made | None = None  # routed
    why: str | None = None  # not routable: said in the model's 503
    coming: bool = False  # pending or starting on a node heard from


class ReplicaEndpoints:
    """`endpoints`, `why` and `coming` as a publish's replicas make them:
    each model's routable endpoints in replica key order, why its other
    replicas are not routable, and the models with a replica on its way.
    Read them after `update()`; they are replaced, never changed in place,
    so a caller may add to copies."""

    def __init__(self, engine_key: Callable[[str, str], str]) -> None:
        self._engine_key = engine_key
        self._out: dict[str, _Outcome] = {}
        self._by_model: dict[str, dict[str, None]] = {}  # model -> its replicas (a set)
        self._by_node: dict[str, dict[str, None]] = {}
        self._all = True  # the next update walks every replica
        self._replicas: set[str] = set()
        self._models: set[str] = set()
        self._nodes: set[str] = set()
        self._held: frozenset[str] = frozenset()
        self.endpoints: dict[str, list[Endpoint]] = {}
        self.why: dict[str, list[str]] = {}
        self.coming: set[str] = set()

    def changed(self, keys: Iterable[str]) -> None:
        """Keys the mirror says changed since the last update."""
        if self._all:
            return
        for k in keys:
            if k.startswith(s.REPLICAS):
                self._replicas.add(k[len(s.REPLICAS):])
            elif k.startswith(s.STATUS):
                self._replicas.add(k[len(s.STATUS):])
            elif k.startswith(s.MODELS):
                self._models.add(k[len(s.MODELS):])
            elif k.startswith(s.NODES):
                self._nodes.add(k[len(s.NODES):])
        if len(self._replicas) + len(self._models) + len(self._nodes) > _WALK_ALL:
            self.walk_all()

    def walk_all(self) -> None:
        """The next update works out every replica again."""
        self._all = True
        self._replicas.clear()
        self._models.clear()
        self._nodes.clear()

    def update(self, replicas: Mapping[str, s.Replica],
               statuses: Mapping[str, s.ReplicaStatus],
               models: Mapping[str, s.StoredModel], nodes: Collection[str],
               held: frozenset[str]) -> None:
        if self._all:
            rids: Iterable[str] = list(self._out.keys() | replicas.keys())
            touched: set[str] | None = None
        else:
            dirty = set(self._replicas)
            for name in self._models:
                dirty.update(self._by_model.get(name, ()))
            for node in self._nodes | (held ^ self._held):
                dirty.update(self._by_node.get(node, ()))
            rids = dirty
            touched = set(self._models)
        self._all = False
        self._replicas.clear()
        self._models.clear()
        self._nodes.clear()
        self._held = held
        for rid in rids:
            old = self._out.get(rid)
            rep = replicas.get(rid)
            if old is not None and (rep is None or rep.model != old.model
                                    or rep.node != old.node):
                self._unindex(rid, old)
                if touched is not None:
                    touched.add(old.model)
            if rep is None:
                self._out.pop(rid, None)
                continue
            out = self._outcome(rid, rep, statuses.get(rid), models, nodes, held,
                                old.made if old is not None else None)
            if old is None or old.model != rep.model or old.node != rep.node:
                self._by_model.setdefault(rep.model, {})[rid] = None
                self._by_node.setdefault(rep.node, {})[rid] = None
            self._out[rid] = out
            if touched is not None:
                touched.add(rep.model)
        if touched is None:
            self.endpoints, self.why, self.coming = {}, {}, set()
            touched = set(self._by_model)
        else:
            self.endpoints, self.why = dict(self.endpoints), dict(self.why)
            self.coming = set(self.coming)
        for model in touched:
            self._model(model)

    def _unindex(self, rid: str, old: _Outcome) -> None:
        for index, key in ((self._by_model, old.model), (self._by_node, old.node)):
            members = index.get(key)
            if members is not None:
                members.pop(rid, None)
                if not members:
                    del index[key]

    def _model(self, model: str) -> None:
        """A model's endpoints, reasons and coming flag from its replicas'
        outcomes, in replica key order (as the mirror's views are)."""
        eps: list[Endpoint] = []
        why: list[str] = []
        coming = False
        for rid in sorted(self._by_model.get(model, ())):
            out = self._out[rid]
            if out.made is not None:
                eps.append(out.made[3])
            elif out.why is not None:
                why.append(out.why)
            coming = coming or out.coming
        if eps:
            self.endpoints[model] = eps
        else:
            self.endpoints.pop(model, None)
        if why:
            self.why[model] = why
        else:
            self.why.pop(model, None)
        if coming:
            self.coming.add(model)
        else:
            self.coming.discard(model)

    def _outcome(self, rid: str, rep: s.Replica, st: s.ReplicaStatus | None,
                 models: Mapping[str, s.StoredModel], nodes: Collection[str],
                 held: frozenset[str], was: _Made | None) -> _Outcome:
        out = _Outcome(rep.model, rep.node)
        if (was is not None and was[0] is rep and was[1] is st
                and models.get(rep.model) is was[2] and (rep.node in nodes or rep.node in held)):
            # Routed last time, and nothing it is made of changed (its node
            # still heard from): no field read again, no engine key derived.
            out.made = was
            return out
        if rep.model not in models or rep.draining_since is not None:
            return out
        if rep.node not in nodes and rep.node not in held:
            # Not heard from (its agent or the node is down, or a restart
            # dropped its key): the leader keeps the replica for a grace
            # period, but its last "ready" is no promise.
            out.why = f"replica {rid}: node {rep.node} not heard from"
        elif st is None or st.phase != "ready":
            phase = s.replica_phase(rep, st)
            out.coming = phase in ("pending", "starting")
            detail = f": {st.detail}" if st is not None and st.detail else ""
            out.why = f"replica {rid} is {phase} on {rep.node}{detail}"
        else:
            spec = models[rep.model]
            prof = next((p for p in spec.profile_list if p.name == rep.profile), None)
            ep = Endpoint(
                rid, st.url, self._engine_key(rid, rep.secret),
                priority=prof.priority if prof else 0,
                weight=prof.weight if prof else 1.0, engine=rep.engine)
            out.made = (rep, st, spec, ep)
        return out
