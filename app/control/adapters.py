"""Where each LoRA adapter is loaded: the leader's adapter loop
(docs/design/lora-adapters.md).

`decide()` is the rule, pure: an adapter is loaded on at least one ready
replica of its base, and on more while its requests in flight over every
gateway exceed `load_target` per replica holding it, up to its
`max_replicas` and the base's replicas with a free slot (each holds
`--max-loras` adapters). It grows at once, one replica per step; it
shrinks one replica per `shrink_after` seconds of load below its size. A
replica taken out is no longer routed to at once, and unloaded `drain`
seconds later, once its requests had time to end.

`AdapterLoop.step()` applies it, on the leader only: it loads the adapter
on the replicas added (the engine's `POST /v1/load_lora_adapter`, with the
engine key) before recording them in `adapters/{name}` (fenced by the
leader's key), so a gateway routes only to a replica that has it; it
checks that each recorded replica still lists it (an engine restarted
lost it) and loads it again; it unloads those drained.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import aiohttp

from app.control import state as s
from app.control.keys import SecretRing
from app.control.leader import Elector
from app.control.mirror import Mirror
from app.store.base import Delete, Put, Store, StoreError
from app.wire.adapters import max_loras
from app.wire.loads import read_capped
from app.wire.spec import Adapter

logger = logging.getLogger(__name__)

# Longest /v1/models answer read from an engine: its model and adapters.
_MAX_MODELS_ANSWER = 1 << 20


@dataclass(frozen=True)
class BaseReplica:
    """A ready replica of an adapter's base, as the rule sees it."""

    id: str
    slots: int  # adapters it holds at once (--max-loras)
    held: int  # adapters recorded on it (being unloaded included)


def size_for(inflight: int, load_target: int, cap: int) -> int:
    """The replicas an adapter with `inflight` requests should be on: at
    least 1, `load_target` requests per replica, at most `cap`."""
    return max(1, min(cap, math.ceil(inflight / load_target)))


def decide(name: str, spec: Adapter, rec: s.AdapterSet | None,
           ready: Sequence[BaseReplica], inflight: int, now: float, *,
           shrink_after: float) -> s.AdapterSet:
    """The adapter's set after one step (which replicas to load it on are
    those in the answer's `replicas` but not in `rec`'s)."""
    by_id = {r.id: r for r in ready}
    current = [rid for rid in (rec.replicas if rec else []) if rid in by_id]
    unloading = dict(rec.unloading) if rec else {}
    for rid in rec.replicas if rec else []:
        if rid not in by_id:
            # Not ready (or gone): out of the router now; unloaded after the
            # drain if it comes back, so its slot is not lost.
            unloading.setdefault(rid, now)
    low_since = rec.low_since if rec else None
    free = [r for r in ready
            if r.id not in current and (r.held < r.slots or r.id in unloading)]
    cap = min(spec.max_replicas, len(current) + len(free))
    want = size_for(inflight, spec.load_target, cap) if cap else 0
    if want > len(current):
        # The emptiest replica first (fewest adapters), then the name.
        pick = sorted(free, key=lambda r: (r.id not in unloading, r.held, r.id))[0]
        current.append(pick.id)
        unloading.pop(pick.id, None)
        low_since = None
    elif want < len(current):
        if low_since is None:
            low_since = now
        elif now - low_since >= shrink_after:
            out = current.pop()  # the last one added
            unloading[out] = now
            low_since = now  # one step per shrink_after
    else:
        low_since = None
    return s.AdapterSet(name=name, base=spec.base, replicas=current, unloading=unloading,
                        low_since=low_since, updated=now)


class Engines(Protocol):
    """The engines' runtime LoRA API (vLLM's)."""

    async def listed(self, url: str, key: str) -> set[str] | None:
        """The adapters the engine lists in /v1/models; None if unknown."""
        ...

    async def load(self, url: str, key: str, name: str, path: str) -> str | None:
        """Loads adapter `name`; None when done, else why not."""
        ...

    async def unload(self, url: str, key: str, name: str) -> str | None:
        ...


class VllmEngines:
    """`Engines` over HTTP: each call bounded by `timeout`, answers read up
    to a cap."""

    def __init__(self, timeout: float = 30.0) -> None:
        self._timeout = aiohttp.ClientTimeout(total=timeout, sock_connect=min(5.0, timeout))
        self._session: aiohttp.ClientSession | None = None

    def _open(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(timeout=self._timeout)
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    async def listed(self, url: str, key: str) -> set[str] | None:
        try:
            async with self._open().get(f"{url}/v1/models", headers=_auth(key)) as resp:
                if resp.status != 200:
                    return None
                body = await read_capped(resp.content, _MAX_MODELS_ANSWER)
            if len(body) > _MAX_MODELS_ANSWER:
                return None
            data = json.loads(body).get("data")
            if not isinstance(data, list):
                return None
            return {str(m["id"]) for m in data
                    if isinstance(m, dict) and isinstance(m.get("id"), str) and m.get("parent")}
        except (aiohttp.ClientError, TimeoutError, ValueError, AttributeError):
            return None

    async def load(self, url: str, key: str, name: str, path: str) -> str | None:
        return await self._post(f"{url}/v1/load_lora_adapter",
                                {"lora_name": name, "lora_path": path}, key)

    async def unload(self, url: str, key: str, name: str) -> str | None:
        return await self._post(f"{url}/v1/unload_lora_adapter", {"lora_name": name}, key)

    async def _post(self, url: str, body: dict[str, str], key: str) -> str | None:
        try:
            async with self._open().post(url, json=body, headers=_auth(key)) as resp:
                if resp.status == 200:
                    return None
                text = (await read_capped(resp.content, 300)).decode("utf-8", "replace")
                return f"HTTP {resp.status}: {text[:300]}"
        except (aiohttp.ClientError, TimeoutError) as exc:
            return f"{type(exc).__name__}: {exc}"[:300]


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"} if key else {}


def adapter_inflight(usages: Mapping[str, s.Usage]) -> dict[str, int]:
    """Requests in flight per adapter over every gateway's last snapshot."""
    out: dict[str, int] = {}
    for u in usages.values():
        for name, n in u.adapters.items():
            out[name] = out.get(name, 0) + n
    return out


class AdapterLoop:
    def __init__(self, store: Store, mirror: Mirror, elector: Elector, secrets: SecretRing,
                 engines: Engines | None = None, *, shrink_after: float = 60.0,
                 drain: float = 30.0, clock: Callable[[], float] = time.time) -> None:
        self._store = store
        self._mirror = mirror
        self._elector = elector
        self._secrets = secrets
        self.engines: Engines = engines if engines is not None else VllmEngines()
        self._shrink_after = shrink_after
        self._drain = drain
        self.clock = clock

    async def close(self) -> None:
        if isinstance(self.engines, VllmEngines):
            await self.engines.close()

    async def run(self, interval: float) -> None:
        while True:
            await asyncio.sleep(interval)
            try:
                await self.step()
            except Exception:
                logger.exception("adapter step failed")

    async def step(self) -> bool:
        """One pass over every adapter; False when not leading."""
        if not self._elector.is_leader or not self._mirror.ready:
            return False
        m = self._mirror
        now = self.clock()
        models = m.models()
        sets = m.parsed(s.ADAPTERS, s.AdapterSet)
        replicas = m.replicas()
        statuses = m.statuses()
        nodes = m.nodes()
        held: dict[str, int] = {}
        for one in sets.values():
            for rid in {*one.replicas, *one.unloading}:
                held[rid] = held.get(rid, 0) + 1
        ready: dict[str, list[BaseReplica]] = {}
        urls: dict[str, tuple[str, str]] = {}
        for rid, rep in sorted(replicas.items()):
            st = statuses.get(rid)
            if (st is None or st.phase != "ready" or rep.draining_since is not None
                    or rep.node not in nodes or not max_loras(rep.engine_args)):
                continue
            ready.setdefault(rep.model, []).append(
                BaseReplica(rid, max_loras(rep.engine_args), held.get(rid, 0)))
            urls[rid] = (st.url.rstrip("/"), self._secrets.engine_key(rid, rep.secret))
        inflight = adapter_inflight(m.usages())
        # What each engine holding an adapter lists, asked of all at once:
        # one engine slow to answer delays the pass by one call's timeout,
        # not one a replica, and holds no other adapter's growth longer.
        asked = sorted({rid for one in sets.values() for rid in one.replicas if rid in urls})
        answers = await asyncio.gather(*(self.engines.listed(*urls[rid]) for rid in asked))
        listed: dict[str, set[str] | None] = dict(zip(asked, answers, strict=True))
        writes: list[Put | Delete] = []
        for name, spec in sorted(models.items()):
            if spec.adapter is None:
                continue
            rec = sets.get(name)
            new = decide(name, spec.adapter, rec, ready.get(spec.adapter.base, []),
                         inflight.get(name, 0), now, shrink_after=self._shrink_after)
            kept = set(rec.replicas) if rec else set()
            new.replicas = [rid for rid in new.replicas
                            if await self._ensure(rid, urls[rid], name, spec.adapter.weights,
                                                  listed, rid in kept)]
            for rid, since in list(new.unloading.items()):
                if now - since >= self._drain:
                    if rid in urls:
                        why = await self.engines.unload(*urls[rid], name)
                        if why is not None:
                            logger.info("adapter %s: unload from %s: %s", name, rid, why)
                    del new.unloading[rid]
            if (rec.replicas if rec else []) != new.replicas:
                logger.info("adapter %s: on %s (%d requests in flight)", name,
                            ", ".join(new.replicas) or "no replica", inflight.get(name, 0))
            if rec is None or _shape(rec) != _shape(new):
                writes.append(Put(s.ADAPTERS + name, new.model_dump_json().encode()))
        for name in sets:
            if name not in models or models[name].adapter is None:
                writes.append(Delete(s.ADAPTERS + name))
        if writes:
            try:
                res = await self._store.txn(self._elector.fence(), self._elector.signed(writes))
            except StoreError as exc:
                logger.info("adapter sets not written: %s", exc)
                return True
            if res.succeeded:
                await m.wait_for(res.revision, 2.0)
        return True

    async def _ensure(self, rid: str, where: tuple[str, str], name: str, path: str,
                      listed: dict[str, set[str] | None], recorded: bool) -> bool:
        """Whether adapter `name` is loaded on replica `rid`, loading it if
        its engine does not list it. A replica it is `recorded` on whose
        engine did not answer the listing keeps it: loading it again there
        would be refused as already loaded (vLLM answers 400), and taking
        the replica out for one missed answer would move its traffic."""
        if rid not in listed:
            listed[rid] = await self.engines.listed(*where)
        have = listed[rid]
        if have is not None and name in have:
            return True
        if have is None and recorded:
            return True
        why = await self.engines.load(*where, name, path)
        if why is not None:
            logger.info("adapter %s: load on %s: %s", name, rid, why)
            return False
        if have is not None:
            have.add(name)
        return True


def _shape(rec: s.AdapterSet) -> tuple[object, ...]:
    return (rec.base, rec.replicas, rec.unloading, rec.low_since)
