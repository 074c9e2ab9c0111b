"""Where the control plane meets the router (DESIGN invariant 8).

The mirror says what changed; `Publisher.publish()` turns the mirrored state
into the router's tables: catalog names and aliases, ready endpoints with
their engine keys, client key grants. Neither side imports the other: this
module, like assembly.py, is wiring.

An unchanged endpoint list is not republished (its fingerprint is kept), so
a heartbeat or a status rewrite costs the router nothing.

External models become one endpoint each, at the provider's URL with the
provider's key, read from its file off the event loop (app/control/keyfiles.py):
`run()` rereads every key file and publishes every `interval` seconds besides
on changes, so a key rotated on disk is used within that long, without a
restart. A key file that cannot be used withholds its model alone.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from app.control import state as s
from app.control.keyfiles import ProviderKeys
from app.control.keys import SecretRing
from app.control.mirror import Mirror
from app.control.placement.agentversion import Window
from app.control.placement.placer import Placer, place_any, placer_of
from app.control.placement.verdict import NoFit
from app.gateway.node_grace import NodeGrace
from app.gateway.replica_endpoints import ReplicaEndpoints
from app.router.published import NO_LIMITS, CatalogEntry, Endpoint, KeyGrant, Limits
from app.router.table import RouteTable

logger = logging.getLogger(__name__)

# Keys whose change can alter what the router serves.
# The gateway count too: a limiter's equal shares before its claims loop runs.
# Node confs and quotas: whether a model can be placed at all (`_unplaced`).
_RELEVANT = (s.MODELS, s.REPLICAS, s.STATUS, s.KEYS, s.NODES, s.GATEWAYS, s.ADAPTERS,
             s.NODECONF, s.QUOTAS)

# The most of the event loop publishing takes while changes stream in.
SHARE = 0.2
# Keys an operator writes (the catalog, client keys, cordons and pools,
# quotas): published at once, never paced.
_EDITS = (s.MODELS, s.KEYS, s.NODECONF, s.QUOTAS)


@dataclass(frozen=True)
class Timing:
    """How a publisher is timed: how long a node whose key just went stays
    routed (`node_grace`, app/gateway/node_grace.py, on `clock`), and the
    most of the event loop publishing takes under a stream of changes
    (`share`, its publishes timed by `timer`: see `Publisher._schedule`)."""

    node_grace: float = 0.0
    share: float = SHARE
    clock: Callable[[], float] = time.monotonic
    timer: Callable[[], float] = time.perf_counter


class Publisher:
    def __init__(self, mirror: Mirror, table: RouteTable, secrets: SecretRing,
                 agent_window: Window | None = None,
                 keys: ProviderKeys | None = None, *, gateway_id: str = "",
                 timing: Timing = Timing()) -> None:
        self._agent_window = agent_window
        # Nodes whose key just went stay routed this long (app/gateway/node_grace.py).
        self._node_grace = NodeGrace(timing.node_grace, timing.clock, self._schedule)
        # This gateway's: the other gateways' snapshots feed the router their
        # in-flight counts ("" feeds none).
        self._gateway_id = gateway_id
        # Without a key folder, every key file is refused (say so, not hang).
        self._keys = keys if keys is not None else ProviderKeys("")
        self._keys.subscribe(self._schedule)
        self._mirror = mirror
        self._table = table
        self._secrets = secrets
        self._scheduled: asyncio.Handle | None = None
        # Publishing's most share of the event loop under a stream of
        # changes, timed by `timer`: after a publish that took t, the next
        # waits (1/share - 1) * t (see `_schedule`).
        self.share = timing.share
        self._timer = timing.timer
        self._quiet_until = 0.0
        self._urgent = False  # the publish scheduled is an edit's, not paced
        self._seen_others = False  # another gateway's registration was ever seen
        self._last: tuple[object, ...] = ()
        # Each replica's outcome, kept between publishes and worked out
        # again only where the mirror says a key changed (replica_endpoints.py).
        self._routed = ReplicaEndpoints(secrets.engine_key)
        # The catalog as last built, and the models view it was built from.
        self._catalog: tuple[object, tuple[CatalogEntry, ...]] = (None, ())
        self._entries: dict[str, tuple[s.StoredModel, CatalogEntry]] = {}
        # Of that view, in name order: each external model's provider, and
        # each adapter's base.
        self._externals: list[tuple[str, s.External]] = []
        self._adapters: list[tuple[str, str]] = []
        # The key grants as last built: the client keys' view and the
        # gateway count they were built from.
        self._grants: tuple[object, int, dict[str, KeyGrant]] = (None, 0, {})
        # The mirror revision of the last publish: the router's tables hold
        # every change up to it (a drain included), whatever the fingerprint.
        self.published_revision = 0
        mirror.subscribe(self._on_change)

    async def run(self, interval: float) -> None:
        """Every `interval` seconds: rereads the key files (a rotated
        provider key, which no store change announces; a changed one
        republishes when read) and publishes."""
        while True:
            await asyncio.sleep(interval)
            try:
                self.reread_keys()
                self.publish()
            except Exception:
                logger.exception("publish failed")

    def reread_keys(self) -> None:
        """Starts a read of every external model's key file; each outcome
        that differs from the last republishes once it is in."""
        self._keys.refresh(
            spec.external.api_key_file for spec in self._mirror.models().values()
            if spec.external is not None and spec.external.api_key_file is not None)

    def _on_change(self, keys: set[str]) -> None:
        self._routed.changed(keys)
        if self._gateway_id and any(k.startswith(s.USAGE) for k in keys):
            self.publish_peer_inflight()
        if not any(k.startswith(_RELEVANT) for k in keys):
            return
        self._schedule(urgent=any(k.startswith(_EDITS) for k in keys))

    def _schedule(self, urgent: bool = False) -> None:
        """A publish soon: every change until it runs goes into it (a resync,
        a transaction, a burst). At once after a quiet spell, or for an
        operator's edit (`urgent`: rare, and awaited by whoever made it);
        under a stream of the fleet's changes, no sooner than the last
        publish's cost allows, so that publishing takes at most `share` of
        the event loop: 10,000 agents report about 300 changes a second,
        and a publish at each would take most of the loop (the router's
        requests waiting behind it). docs/design/scale.md."""
        if self._scheduled is not None:
            if not urgent or self._urgent:
                return
            self._scheduled.cancel()  # paced: sooner now
        self._urgent = urgent
        loop = asyncio.get_running_loop()
        wait = 0.0 if urgent else self._quiet_until - self._timer()
        self._scheduled = (loop.call_later(wait, self.publish) if wait > 0
                           else loop.call_soon(self.publish))

    def publish_peer_inflight(self) -> None:
        """The other gateways' requests in flight per replica, summed over
        their usage snapshots (written every few seconds when changed): a
        llama.cpp engine's queue, which no /metrics tells (app/router/choice.py)."""
        counts: dict[str, int] = {}
        for u in self._mirror.usages().values():
            if u.gateway != self._gateway_id:
                for rid, n in u.inflight.items():
                    counts[rid] = counts.get(rid, 0) + n
        self._table.set_peer_inflight(counts)

    @staticmethod
    def _unplaced(name: str, spec: s.StoredModel, placer: Callable[[], Placer]
                  ) -> NoFit | None:
        """Why no node can take a replica of a model that has none, or None
        when one can: the leader's decision (`place_any`, over every input
        its pass reads: `placer_of`), which placement being a pure function
        of the mirrored state lets this gateway reach too. One `placer` per
        publish: the models waiting for room on a full fleet share its scan
        of the nodes (each scanned them all)."""
        if not spec.profile_list:
            return None  # external, or an adapter: never placed (they say why otherwise)
        fit, _ = place_any(placer(), name, spec)
        return fit if isinstance(fit, NoFit) else None

    def publish(self) -> bool:
        """Rebuilds the router's tables; False when nothing it serves changed."""
        if self._scheduled is not None:
            self._scheduled.cancel()  # this one covers it
            self._scheduled = None
        start = self._timer()
        try:
            return self._publish()
        finally:
            end = self._timer()
            self._quiet_until = end + (end - start) * (1.0 / self.share - 1.0)

    def _publish(self) -> bool:
        m = self._mirror
        revision = m.revision
        models = m.models()
        catalog = self._catalog_of(models)
        endpoints, why, coming = self._endpoints(models)
        unavailable, holdable = self._unavailable(models, endpoints, why, coming)
        grants = self._grants_of()
        # Spill-over: each model's overflow, while it names an external model.
        overflow = tuple(sorted(
            (name, spec.overflow) for name, spec in models.items()
            if spec.overflow is not None and spec.external is None
            and (target := models.get(spec.overflow)) is not None
            and target.external is not None))
        # Compared as dicts (in C; an Endpoint kept is the same object, so
        # equal at a glance): sorting and copying them was ~10 ms of a
        # publish at 10,000 nodes.
        fingerprint = (catalog, endpoints, grants, unavailable, holdable, overflow)
        changed = fingerprint != self._last
        if changed:
            self._set(fingerprint)
            logger.debug("published %d models, %d endpoints",
                         len(catalog), sum(len(v) for v in endpoints.values()))
        self.published_revision = revision
        return changed

    def _catalog_of(self, models: Mapping[str, s.StoredModel]) -> tuple[CatalogEntry, ...]:
        """The catalog's entries, rebuilt when the models' view is replaced
        (as it is when a model changes); an entry is kept while its spec is
        the same object."""
        if self._catalog[0] is not models:
            was = self._entries
            self._entries = {name: kept if (kept := was.get(name)) is not None
                             and kept[0] is spec else (spec, _entry(name, spec))
                             for name, spec in models.items()}
            self._catalog = (models, tuple(e for _, e in self._entries.values()))
            self._externals = [(n, sp.external) for n, sp in models.items()  # key order
                               if sp.external is not None]
            self._adapters = [(n, sp.adapter.base) for n, sp in models.items()
                              if sp.adapter is not None]
        return self._catalog[1]

    def _endpoints(self, models: Mapping[str, s.StoredModel]
                   ) -> tuple[dict[str, list[Endpoint]], dict[str, list[str]], set[str]]:
        """Each model's endpoints (its replicas', an external model's, an
        adapter's), why its other replicas are not routable (for the 503 a
        client gets when none is), and the models with a replica on its way."""
        m = self._mirror
        nodes = m.nodes()
        held = self._node_grace.held(nodes)
        try:
            self._routed.update(m.replicas(), m.statuses(), models, nodes, held)
        except BaseException:
            self._routed.walk_all()  # whatever it kept may be half done
            raise
        # Copies: the external models and adapters below add to them.
        endpoints = dict(self._routed.endpoints)
        why = dict(self._routed.why)  # kept only for models without endpoints
        coming = set(self._routed.coming)  # a replica loading on a live node
        key_files: set[str] = set()
        for name, ext in self._externals:
            key = ""
            if ext.api_key_file is not None:
                key_files.add(ext.api_key_file)
                got = self._keys.get(ext.api_key_file)  # None: being read, held meanwhile
                if got is None or got.key is None:
                    why[name] = [f"the key file of external model '{name}' " + (
                        "is being read" if got is None else f"cannot be used: {got.error}")]
                    if got is None:
                        coming.add(name)
                    continue
                key = got.key
            endpoints[name] = [Endpoint(f"external:{name}", ext.url.rstrip("/"), key,
                                        upstream_model=ext.model,
                                        spill_reserve=ext.spill_reserve_tokens or 0,
                                        spill_unbudgeted=ext.spill_unbudgeted)]
        self._keys.retain(key_files)
        _adapter_endpoints(models, self._adapters, m.parsed(s.ADAPTERS, s.AdapterSet),
                           endpoints, why, coming)
        return endpoints, why, coming

    def _unavailable(self, models: Mapping[str, s.StoredModel],
                     endpoints: Mapping[str, list[Endpoint]], why: Mapping[str, list[str]],
                     coming: set[str]) -> tuple[dict[str, str], frozenset[str]]:
        """Why each model without endpoints has none: its replicas' states,
        else whether any node can take one (`nofit`, the decision as data:
        the text is only said to clients); and the models a request is held
        for."""
        placers: list[Placer] = []

        def placer() -> Placer:
            if not placers:
                placers.append(placer_of(self._mirror, self._agent_window))
            return placers[0]

        unavailable: dict[str, str] = {}
        nofit: dict[str, NoFit] = {}
        for name, spec in models.items():
            if name in endpoints:
                continue
            if why.get(name):
                unavailable[name] = "; ".join(why[name])
            elif (refused := self._unplaced(name, spec, placer)) is not None:
                nofit[name] = refused
                unavailable[name] = f"no replica is placed: {refused}"
            else:
                unavailable[name] = "no replica is placed yet"
        # Scale from zero: requests are held for a model whose replica is
        # loading, or one stopped while idle that a request will start again
        # (its use reaches the leader in the next usage snapshot), unless no
        # node can take it: that one is answered at once, saying why. A
        # failed replica's model is not held for.
        holdable = frozenset(
            name for name in unavailable
            if name in coming or (name not in why and name not in nofit
                                  and _starts_on_use(models[name])))
        return unavailable, holdable

    def _grants_of(self) -> dict[str, KeyGrant]:
        """The client keys' grants, rebuilt when the keys' view or the
        gateway count changes.

        Live gateways (lease-bound keys): equal shares of each key's limits
        until the claims loop runs (app/gateway/key_shares.py); this one
        counts even before its own key is seen. Alone (1), a gateway admits
        a key's whole limit with no claim; once it has seen another it
        never takes itself for alone again: etcd back from an outage drops
        every lease at once and each gateway writes its own registration
        back first (docs/design/client-keys.md)."""
        m = self._mirror
        gateways = max(1, sum(1 for _ in m.items(s.GATEWAYS)))
        self._seen_others = self._seen_others or gateways > 1
        if self._seen_others:
            gateways = max(2, gateways)
        keys = m.client_keys()
        if self._grants[0] is not keys or self._grants[1] != gateways:
            self._grants = (keys, gateways, {
                digest: KeyGrant(rec.id, rec.name, frozenset(rec.models), _limits(Limits(
                    rec.limits.requests_per_minute, rec.limits.tokens_per_minute,
                    rec.limits.concurrent_requests, rec.limits.external_tokens_per_day)),
                    gateways, rec.expires)
                for digest, rec in keys.items()})
        return self._grants[2]

    def _set(self, fingerprint: tuple[Any, ...]) -> None:
        """Only what changed is set again (a catalog edit rebuilt the
        endpoints' table at 10,000 nodes: ~6 ms)."""
        last = self._last or (None,) * len(fingerprint)
        self._last = fingerprint
        catalog, endpoints, grants, unavailable, holdable, overflow = fingerprint
        t = self._table
        if catalog != last[0]:
            t.set_catalog(catalog)
        if endpoints != last[1]:
            t.set_endpoints(endpoints)
        if grants != last[2]:
            t.set_client_keys(grants)
        if unavailable != last[3]:
            t.set_unavailable(unavailable)
        if holdable != last[4]:
            t.set_holdable(holdable)
        if overflow != last[5]:
            t.set_overflow(dict(overflow))

def _limits(limits: Limits) -> Limits:
    """`NO_LIMITS` itself for a key without limits: the limiter tells it
    by identity, not by comparing two dataclasses a request."""
    return NO_LIMITS if limits == NO_LIMITS else limits


def _entry(name: str, spec: s.StoredModel) -> CatalogEntry:
    return CatalogEntry(name, tuple(spec.aliases), int(spec.created),
                        spec.adapter.base if spec.adapter is not None else "")


def _adapter_endpoints(models: Mapping[str, s.StoredModel],
                       adapters: list[tuple[str, str]],
                       sets: Mapping[str, s.AdapterSet],
                       endpoints: dict[str, list[Endpoint]], why: dict[str, list[str]],
                       coming: set[str]) -> None:
    """Each LoRA adapter's endpoints: its base's ready replicas that the
    leader has loaded it on (`adapters/{name}`), asked for it by name
    (docs/design/lora-adapters.md)."""
    for name, base in adapters:
        loaded = set(sets[name].replicas) if name in sets else set()
        eps = [replace(ep, upstream_model=name, adapter=name)
               for ep in endpoints.get(base, ()) if ep.replica_id in loaded]
        if eps:
            endpoints[name] = eps
            continue
        if endpoints.get(base) or base in coming:
            # The leader loads it on a ready replica of the base within a pass.
            coming.add(name)
            why[name] = [f"adapter '{name}' is being loaded on a replica of '{base}'"]
        elif base in models and base not in why and _starts_on_use(models[base]):
            # Its base stopped while idle: a held request for the adapter is
            # a use of the base (app/control/usage.py), which starts it.
            coming.add(name)
            why[name] = [f"its base '{base}' is started on demand"]
        else:
            why[name] = [f"no replica of its base '{base}' is ready"
                         + (": " + "; ".join(why[base]) if why.get(base) else "")]


def _starts_on_use(spec: s.StoredModel) -> bool:
    """A model placed only while used (min 0, an idle timeout): a request for
    it is what starts its replica (app/control/plan/planner.py, `wanted`)."""
    rng = spec.replica_range
    return (spec.external is None and rng.min == 0 and rng.max > 0
            and spec.idle_timeout is not None)
