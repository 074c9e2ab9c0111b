"""The router's view of the world: names, endpoints, client keys.

It is replaced wholesale by `publish_*` calls from the control side (the
router never imports the control plane; main.py wires them, DESIGN
invariant 8) and read on every request without any I/O.

Taking an endpoint returns a lease (`with table.acquire(ep):`) so
the in-flight count drops even when a client disconnects mid-stream.

A replica that just failed a request (refused the connection, answered
502/503, broke off, stalled) is cooled down for a few seconds
(`cool_down`): `choose()` passes it over while another is left, so the
requests that follow do not each pay for finding it dead.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable, Collection, Mapping, Sequence

from app.router import choice
from app.router.choice import EngineLoad
from app.router.published import CatalogEntry, Endpoint, KeyGrant

# Longest reason `set_unavailable` keeps: a log tail is not a 503 message.
REASON_MAX = 300


class RouteTable:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._cooling: dict[str, float] = {}  # replica id -> clock time it is warm again
        self._catalog: dict[str, CatalogEntry] = {}
        self._names: dict[str, str] = {}  # name or alias -> model name
        self._endpoints: dict[str, tuple[Endpoint, ...]] = {}
        self._keys: dict[str, KeyGrant] = {}
        # False until the control side first sets the keys (its state loaded):
        # an unknown key then is one not loaded yet, not a wrong one.
        self.keys_loaded = False
        self._unavailable: dict[str, str] = {}
        self._inflight: dict[str, int] = {}
        self._adapter_inflight: dict[str, int] = {}
        # Other gateways' requests in flight per replica, from their usage
        # snapshots (a few seconds old): a serial engine's queue is ours plus these.
        self._peer_inflight: dict[str, int] = {}
        self._loads: dict[str, EngineLoad] = {}
        # Scale from zero: models whose replica is on its way (set by the
        # control side), requests held for each here, and their wake-ups.
        self._holdable: frozenset[str] = frozenset()
        self._held: dict[str, int] = {}
        # Held requests that got no replica in time, per model, ever (a
        # counter for the metrics).
        self.hold_timeouts: dict[str, int] = {}
        self._routable: dict[str, asyncio.Event] = {}
        # Spill-over (spill.py): model -> its overflow, an external model;
        # requests spilled per (model, reason), ever (a counter for the metrics).
        self._overflow: dict[str, str] = {}
        self.spills: dict[tuple[str, str], int] = {}
        # Engine counts older than this are unknown: three of the load
        # poll's rounds (set by engine_load.py; a round a second, or longer
        # for a large fleet).
        self.stale_after = 3.0
        self.rand: Callable[[], float] = random.random

    # --- fed by the control side (the sinks of DESIGN invariant 8) ----------

    def set_catalog(self, entries: Sequence[CatalogEntry]) -> None:
        names: dict[str, str] = {}
        for e in entries:
            names[e.name] = e.name
        for e in entries:
            for a in e.aliases:
                names.setdefault(a, e.name)  # a model's own name wins over an alias
        self._catalog = {e.name: e for e in entries}
        self._names = names

    def set_endpoints(self, endpoints: Mapping[str, Sequence[Endpoint]]) -> None:
        self._endpoints = {m: tuple(eps) for m, eps in endpoints.items()}
        for model in [m for m in self._routable if self._endpoints.get(m)]:
            self._routable.pop(model).set()  # wakes the requests held for it

    def set_holdable(self, models: Collection[str]) -> None:
        """Models with no routable replica whose replica is on its way (placed
        and loading, or to be placed on demand, scale from zero): a request
        for one is held until it can be routed instead of answered 503."""
        self._holdable = frozenset(models)
        for model in [m for m in self._routable if m not in self._holdable]:
            self._routable.pop(model).set()  # no longer coming: answer them now

    def set_overflow(self, overflow: Mapping[str, str]) -> None:
        self._overflow = dict(overflow)  # model -> the external model it spills to

    def overflow(self, model: str) -> str | None:
        return self._overflow.get(model)

    def spilled(self, model: str, reason: str) -> None:
        self.spills[model, reason] = self.spills.get((model, reason), 0) + 1

    def saturated(self, model: str) -> bool:
        """Whether `model` has endpoints, every warm one saturated (choice.tier)."""
        eps = list(self._endpoints.get(model, ()))
        if self._cooling and eps:
            eps = self._warm(eps) or eps
        if not eps:
            return False
        _, full = choice.tier([_candidate(e) for e in eps], self._loads_in_force(eps),
                              self.queued())
        return full

    def holdable(self, model: str) -> bool:
        return model in self._holdable

    def held(self) -> dict[str, int]:
        """Requests held per model on this gateway (for the usage snapshot)."""
        return {m: n for m, n in self._held.items() if n > 0}

    def hold(self, model: str, cap: int) -> bool:
        """Counts one more request held for `model`; False past `cap`."""
        if self._held.get(model, 0) >= cap:
            return False
        self._held[model] = self._held.get(model, 0) + 1
        return True

    def hold_timed_out(self, model: str) -> None:
        """A held request for `model` ends without a replica (its wait or
        its deadline ran out)."""
        self.hold_timeouts[model] = self.hold_timeouts.get(model, 0) + 1

    def unhold(self, model: str) -> None:
        left = self._held.get(model, 0) - 1
        if left > 0:
            self._held[model] = left
        else:
            self._held.pop(model, None)

    async def wait_routable(self, model: str, timeout: float) -> bool:
        """Waits until `model` has an endpoint (True) or is no longer on its
        way, or `timeout` passes (False)."""
        while not self._endpoints.get(model):
            if model not in self._holdable:
                return False
            event = self._routable.setdefault(model, asyncio.Event())
            try:
                async with asyncio.timeout(timeout):
                    await event.wait()
            except TimeoutError:
                return bool(self._endpoints.get(model))
        return True

    def set_loads(self, loads: Mapping[str, EngineLoad]) -> None:
        """The engines' own counts, by replica id (engine_load.py): a round's."""
        self._loads = dict(loads)

    def add_loads(self, loads: Mapping[str, EngineLoad]) -> None:
        """Counts read during a round, routed on before it ends."""
        self._loads.update(loads)

    def set_peer_inflight(self, counts: Mapping[str, int]) -> None:
        """Requests the other gateways have in flight, by replica id, as their
        last usage snapshots say (app/gateway/publish.py)."""
        self._peer_inflight = {rid: n for rid, n in counts.items() if n > 0}

    def queued(self) -> dict[str, int]:
        """Requests in flight per replica over every gateway, as far as this
        one knows: its own now, the others' as of their last snapshot."""
        out = dict(self._peer_inflight)
        for rid, n in self._inflight.items():
            out[rid] = out.get(rid, 0) + n
        return out

    def all_endpoints(self) -> list[Endpoint]:
        return [ep for eps in self._endpoints.values() for ep in eps]

    def set_client_keys(self, keys: Mapping[str, KeyGrant]) -> None:
        self._keys = dict(keys)
        self.keys_loaded = True

    def set_unavailable(self, reasons: Mapping[str, str]) -> None:
        """Why models have no routable replica: catalog name -> one short line.

        E.g. `{"small": "replica smollm2-ab12 failed: engine killed by SIGILL"}`.
        The proxy's 503 `no_ready_replica` for "small" then reads "No replica
        of 'small' is ready: replica smollm2-ab12 failed: ...". Like the other
        setters it replaces the whole mapping: pass every model that has a
        reason, and a model left out has none. A model that has endpoints
        ignores its entry (its 503, if all of them fail, names their errors).

        Every client allowed the model reads it: no secrets (engine keys are
        masked before they reach `status/` details, DESIGN invariant 6).
        Longer reasons are cut to `REASON_MAX` characters. Read only when a
        request finds no replica, never on a routed one.
        """
        self._unavailable = {
            m: why if len(why) <= REASON_MAX else why[:REASON_MAX - 1] + "…"
            for m, why in reasons.items()
        }

    # --- read per request ----------------------------------------------------------

    def catalog(self) -> list[CatalogEntry]:
        return sorted(self._catalog.values(), key=lambda e: e.name)

    def resolve(self, requested: str) -> str | None:
        return self._names.get(requested)

    def grant(self, key_hash: str) -> KeyGrant | None:
        return self._keys.get(key_hash)

    def unavailable(self, model: str) -> str | None:
        """The reason given by `set_unavailable` for `model`, if any."""
        return self._unavailable.get(model)

    def endpoints(self, model: str) -> tuple[Endpoint, ...]:
        return self._endpoints.get(model, ())

    def inflight(self, replica_id: str) -> int:
        return self._inflight.get(replica_id, 0)

    def inflight_by_replica(self) -> dict[str, int]:
        """Every replica with requests in flight here, routed or not (a
        drained one keeps its count until its last request ends)."""
        return dict(self._inflight)

    def choose(self, model: str, exclude: set[str],
               affinity: str | None = None, only: str | None = None) -> Endpoint | None:
        """A ready replica of `model` not in `exclude`, by choice.choose():
        priority tiers, prompt affinity until saturated, else the less loaded
        of two drawn by weight.

        Replicas cooling down are passed over unless no other is left: a
        cooled replica is still better than a 503 (its failure may have been
        one request's bad luck). `only`: that replica or none (a response's
        state lives in its replica, app/router/responses.py).
        """
        eps = [e for e in self._endpoints.get(model, ()) if e.replica_id not in exclude
               and (only is None or e.replica_id == only)]
        if len(eps) <= 1:
            return eps[0] if eps else None
        if self._cooling:  # empty in the common case: no clock read per request
            warm = self._warm(eps)
            eps = warm or eps
            if len(eps) == 1:
                return eps[0]
        picked = choice.choose(
            [_candidate(e) for e in eps], self._inflight, self._loads_in_force(eps),
            affinity=affinity, queued=self.queued() if self._peer_inflight else None,
            rand=self.rand)
        assert picked is not None
        return next(e for e in eps if e.replica_id == picked.replica_id)

    def fresh_loads(self) -> dict[str, EngineLoad]:
        """Every engine load polled within `stale_after` (for the usage
        snapshot, off the request path)."""
        now = self._clock()
        return {rid: load for rid, load in self._loads.items()
                if choice.fresh(load, now, self.stale_after) is not None}

    def _loads_in_force(self, eps: Sequence[Endpoint]) -> dict[str, EngineLoad | None]:
        if not self._loads:
            return {}
        now = self._clock()
        return {e.replica_id: choice.in_force(self._loads.get(e.replica_id), now,
                                              self.stale_after)
                for e in eps}

    def explain(self, model: str) -> list[dict[str, object]]:
        """Each endpoint of `model` as this gateway sees it, and whether it is
        being chosen and why not (GET /admin/routes)."""
        eps = list(self._endpoints.get(model, ()))
        cooling = self.cooldowns()
        loads = self._loads_in_force(eps)
        cands = [_candidate(e) for e in eps if e.replica_id not in cooling]
        queued = self.queued()
        level, all_saturated = choice.tier(cands, loads, queued)
        in_tier = {c.replica_id for c in level}
        costs = choice.costs(cands, self._inflight, loads)
        shares = choice.ring_shares([c.replica_id for c in level])
        out: list[dict[str, object]] = []
        for e in eps:
            rid = e.replica_id
            load = loads.get(rid)
            if rid in cooling:
                why = f"cooling down ({cooling[rid]:.1f} s left) after a failure"
            elif rid not in in_tier:
                why = ("saturated" if choice.saturated(
                    load, serial=e.engine == "llamacpp", queued=queued.get(rid, 0))
                       else "a higher priority has room")
            else:
                why = "candidate" + (" (every tier saturated)" if all_saturated else "")
            out.append({
                "replica": rid, "url": e.url, "priority": e.priority, "weight": e.weight,
                "inflight": self._inflight.get(rid, 0),
                "inflight_all_gateways": queued.get(rid, 0),
                "engine": None if load is None else {
                    "running": load.running, "waiting": load.waiting,
                    "kv_cache": load.kv_cache},
                "cost": costs.get(rid), "affinity_share": shares.get(rid, 0.0),
                "cooldown": cooling.get(rid), "chosen": rid in in_tier, "why": why,
            })
        return out

    def cool_down(self, replica_id: str, seconds: float) -> None:
        """`choose()` passes `replica_id` over for `seconds` while others are left."""
        if seconds > 0:
            self._cooling[replica_id] = self._clock() + seconds

    def cooldowns(self) -> dict[str, float]:
        """Replicas cooling down on this gateway -> seconds left (for /admin)."""
        now = self._clock()
        self._expire(now)
        return {rid: until - now for rid, until in sorted(self._cooling.items())}

    def _warm(self, eps: list[Endpoint]) -> list[Endpoint]:
        now = self._clock()
        self._expire(now)
        return [e for e in eps if e.replica_id not in self._cooling]

    def _expire(self, now: float) -> None:
        for rid in [r for r, until in self._cooling.items() if until <= now]:
            del self._cooling[rid]

    def acquire(self, ep: Endpoint) -> Lease:
        """Counts one request in flight on `ep` until the lease is released."""
        self._inflight[ep.replica_id] = self._inflight.get(ep.replica_id, 0) + 1
        if ep.adapter:
            self._adapter_inflight[ep.adapter] = self._adapter_inflight.get(ep.adapter, 0) + 1
        return Lease(self, ep)

    def adapter_inflight(self) -> dict[str, int]:
        """Requests in flight here per LoRA adapter."""
        return dict(self._adapter_inflight)

    def _release(self, ep: Endpoint) -> None:
        left = self._inflight.get(ep.replica_id, 0) - 1
        if left > 0:
            self._inflight[ep.replica_id] = left
        else:
            self._inflight.pop(ep.replica_id, None)
        if ep.adapter:
            n = self._adapter_inflight.get(ep.adapter, 0) - 1
            if n > 0:
                self._adapter_inflight[ep.adapter] = n
            else:
                self._adapter_inflight.pop(ep.adapter, None)


def _candidate(e: Endpoint) -> choice.Candidate:
    # llama-cpp-python's server serves one request at a time, without /metrics.
    return choice.Candidate(e.replica_id, e.priority, e.weight, serial=e.engine == "llamacpp")


class Lease:
    """One request in flight on an endpoint. Release is idempotent."""

    __slots__ = ("_released", "_table", "endpoint")

    def __init__(self, table: RouteTable, ep: Endpoint) -> None:
        self._table = table
        self.endpoint = ep
        self._released = False

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._table._release(self.endpoint)

    def __enter__(self) -> Endpoint:
        return self.endpoint

    def __exit__(self, *exc: object) -> None:
        self.release()
