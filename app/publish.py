"""Where the control plane meets the router (DESIGN invariant 8).

The mirror says what changed; `Publisher.publish()` turns the mirrored state
into the router's tables: catalog names and aliases, ready endpoints with
their engine keys, client key grants. Neither side imports the other: this
module, like main.py, is wiring.

An unchanged endpoint list is not republished (its fingerprint is kept), so
a heartbeat or a status rewrite costs the router nothing.
"""

from __future__ import annotations

import asyncio
import logging

from app.control import state as s
from app.control.keys import engine_key
from app.control.mirror import Mirror
from app.control.placement import NoFit, place
from app.router.table import CatalogEntry, Endpoint, KeyGrant, RouteTable

logger = logging.getLogger(__name__)

# Keys whose change can alter what the router serves.
_RELEVANT = (s.MODELS, s.REPLICAS, s.STATUS, s.KEYS, s.NODES)


class Publisher:
    def __init__(self, mirror: Mirror, table: RouteTable, secret: str) -> None:
        self._mirror = mirror
        self._table = table
        self._secret = secret
        self._scheduled = False
        self._last: tuple[object, ...] = ()
        mirror.subscribe(self._on_change)

    def _on_change(self, keys: set[str]) -> None:
        if self._scheduled or not any(k.startswith(_RELEVANT) for k in keys):
            return
        # Coalesce a burst of changes (a resync, a transaction) into one publish.
        self._scheduled = True
        asyncio.get_running_loop().call_soon(self.publish)

    def _unplaced(self, name: str, spec: s.StoredModel, nodes: dict[str, s.NodeInfo]) -> str:
        """Why a model has no replica at all: placement is a pure function of
        the mirrored state, so this gateway can say what the leader sees."""
        fit = place(name, spec, nodes, self._mirror.replicas())
        return f"no replica is placed: {fit}" if isinstance(fit, NoFit) else (
            "no replica is placed yet")

    def publish(self) -> bool:
        """Rebuilds the router's tables; False when nothing it serves changed."""
        self._scheduled = False
        m = self._mirror
        models = m.models()
        catalog = tuple(
            CatalogEntry(name, tuple(spec.aliases), int(spec.created))
            for name, spec in sorted(models.items())
        )
        statuses = m.statuses()
        nodes = m.nodes()
        endpoints: dict[str, list[Endpoint]] = {}
        # Why each model's other replicas are not routable, for the 503 a
        # client gets when none is (kept only for models without endpoints).
        why: dict[str, list[str]] = {}
        for rid, rep in sorted(m.replicas().items()):
            st = statuses.get(rid)
            if rep.model not in models or rep.draining_since is not None:
                continue
            if rep.node not in nodes:
                # Not heard from (its agent or the node is down, or a restart
                # dropped its key): the leader keeps the replica for a grace
                # period, but its last "ready" is no promise.
                why.setdefault(rep.model, []).append(
                    f"replica {rid}: node {rep.node} not heard from")
            elif st is None or st.phase != "ready":
                phase = s.replica_phase(rep, st)
                detail = f": {st.detail}" if st is not None and st.detail else ""
                why.setdefault(rep.model, []).append(
                    f"replica {rid} is {phase} on {rep.node}{detail}")
            else:
                endpoints.setdefault(rep.model, []).append(
                    Endpoint(rid, st.url, engine_key(self._secret, rid)))
        unavailable = {
            name: "; ".join(why.get(name) or [self._unplaced(name, models[name], nodes)])
            for name in models if name not in endpoints
        }
        grants = {
            digest: KeyGrant(rec.id, rec.name, frozenset(rec.models))
            for digest, rec in m.client_keys().items()
        }
        ep_view = tuple((k, tuple(v)) for k, v in sorted(endpoints.items()))
        fingerprint = (catalog, ep_view, tuple(sorted(grants.items())),
                       tuple(sorted(unavailable.items())))
        if fingerprint == self._last:
            return False
        self._last = fingerprint
        self._table.set_catalog(catalog)
        self._table.set_endpoints(endpoints)
        self._table.set_client_keys(grants)
        self._table.set_unavailable(unavailable)
        logger.debug("published %d models, %d endpoints",
                     len(catalog), sum(len(v) for v in endpoints.values()))
        return True
