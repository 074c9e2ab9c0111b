"""Each gateway's claims on client keys' limits: the loop that moves them.

Where the control plane meets the router's limiter (like app/gateway/publish.py,
wiring: neither side imports the other). The decisions are pure, in
app/router/usage/shares.py; this loop gathers, decides and writes
(docs/design/client-keys.md).

Every step reads this gateway's load per key from the limiter (what it holds,
what it was asked lately, what it refused) and every other gateway's record
`keyshares/{gateway}` from the mirror, moves its claims, hands them to the
limiter, and writes its record, bound to its election lease (a dead
gateway's claims go with its lease). A claim is lowered in the limiter
before it is written. It is raised only once written, in a transaction
conditioned on `keyshares-serial` as read and bumping it: every raise by
every gateway goes through that one key, so none is computed from claims
another raise has since changed, and the claims of all gateways never
sum past the limit. Lowers and plain updates do not touch it.

Steps run every `interval`, and at once (at most every `_GAP`) when the
limiter refuses a request on a claim below the key's limit, or another
gateway's record changes. Such a request waits for the next step
(`settle`, bounded by the limiter's deadline: app/router/usage/limits.py,
`admit_or_wait`): every request waiting when a step starts is served by
that one step, its raise one transaction. Writes: when claims or what was
refused change, or more requests wait than last written, else at most
every `refresh` seconds while the load changes; nothing while all is
steady. An admitted request only reads the limiter's tables.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

from app.control import state as s
from app.control.mirror import Mirror
from app.gateway.pause import Pause
from app.router.usage.shares import FLOOR, KINDS, KeyLoad, next_claim, targets
from app.store.base import Compare, Put, Store, StoreError, StoreUnavailable

logger = logging.getLogger(__name__)

SERIAL = "keyshares-serial"
_GAP = 0.02  # seconds between two steps woken at once: a flood of refusals costs this


class ClaimSink(Protocol):
    """The router's limiter, as this loop uses it."""

    on_short: Callable[[], None] | None

    settle: Callable[[], Awaitable[None]] | None

    def key_loads(self) -> Mapping[str, KeyLoad]: ...

    def set_claims(self, claims: Mapping[str, Mapping[str, int]],
                   until: float = ...) -> None: ...


Claims = dict[str, dict[str, int]]


def claim_floors(index: int) -> tuple[int, int]:
    """What worker `index` of a gateway of several (`llmgw serve --workers`)
    admits of a client key on no claim (app/router/usage/limits.py,
    `Limiter.floor` and `lapsed_floor`). Nothing while its claims stand:
    the gateway's workers admit only on their claims, which sum to at most
    the key's limit over every worker of every gateway, so a gateway of
    several adds nothing past them (a request finding no claim waits for a
    raise instead). Once its lease can no longer be proven (its claims
    lapsed, the store unreachable past the TTL), one request on the first
    worker only: one floor a gateway, as a gateway of one process has. So
    N in L + N - 1 counts gateways, not workers (docs/design/workers.md)."""
    return 0, (FLOOR if index == 0 else 0)


@dataclass(frozen=True)
class Holder:
    """This gateway as the holder of its claims: its id, its election lease
    (its record is bound to it), and until when (monotonic) its claims
    stand: while its lease is proven, and `hold` more, the time the others
    keep a vanished record's part (Elector.proven_until). Past it they may
    be taken."""

    gateway_id: str
    lease: Callable[[], int]
    until: Callable[[], float] = lambda: float("inf")
    hold: float = 0.0


class KeyShares:
    """Moves this gateway's claims. `step()` is one pass; `run()` repeats it."""

    def __init__(self, store: Store, mirror: Mirror, limiter: ClaimSink, holder: Holder, *,
                 refresh: float, clock: Callable[[], float] = time.time,
                 monotonic: Callable[[], float] = time.monotonic) -> None:
        self._store = store
        self._until = holder.until
        self._hold = holder.hold
        self._mono = monotonic
        # Every other gateway's record as last seen, and since when
        # (monotonic) it is gone (None: there): a record gone with its
        # lease is counted for `hold` from when this gateway found it gone.
        self._seen: dict[str, tuple[s.KeyShares, float | None]] = {}
        self._mirror = mirror
        self._limiter = limiter
        self._me = holder.gateway_id
        self._lease = holder.lease
        self._refresh = refresh
        self._clock = clock
        self.claims: Claims = {}
        self.written: s.KeyShares | None = None
        self._written_lease = 0
        self._last_raise = 0  # revision of our last raise: the mirror must reach it first
        self._pause = Pause()  # the loop's wait between steps (`run`)
        # Done when the next step ends: what waiting requests await (`settle`).
        self._settled: asyncio.Future[None] | None = None

    def start(self) -> None:
        """From now on the limiter admits by claims (its floor until raised)."""
        self._limiter.set_claims({})

    def settle(self) -> asyncio.Future[None]:
        """Done when a step that starts after this call has ended, whatever
        it did (the caller checks its request again); wakes the loop. Every
        request waiting then shares that step."""
        if self._settled is None:
            self._settled = asyncio.get_running_loop().create_future()
        self.wake()
        return self._settled

    def decide(self, loads: Mapping[str, KeyLoad], others: Mapping[str, s.KeyShares]) -> Claims:
        """The claims this gateway should hold, from its loads and the
        others' records (pure, given the mirror's keys and gateways)."""
        limits = {rec.id: rec.limits for rec in self._mirror.client_keys().values()}
        gateways = sorted(set(self._mirror.gateways()) | set(others) | {self._me})
        wanted = {k for rec in others.values() for k, sh in rec.keys.items() if sh.refused}
        out: Claims = {}
        for key_id in sorted(set(loads) | set(self.claims) | wanted):
            lim = limits.get(key_id)
            if lim is None:
                continue  # revoked: its claims go
            mine = loads.get(key_id) or KeyLoad({})
            theirs = {gw: rec.keys[key_id] for gw, rec in others.items() if key_id in rec.keys}
            asked = {gw: sh.asked for gw, sh in theirs.items()} | {self._me: mine.asked}
            current = self.claims.get(key_id, {})
            new: dict[str, int] = {}
            for kind in KINDS:
                limit = getattr(lim, kind)
                if limit is None:
                    continue
                used = {gw: sh.used.get(kind, 0) for gw, sh in theirs.items()}
                used[self._me] = mine.used.get(kind, 0)
                waiting = {gw: sh.waiting.get(kind, 0) for gw, sh in theirs.items()}
                waiting[self._me] = mine.waiting.get(kind, 0)
                # What another holds counts even past its claim: requests it
                # admitted on a claim it has since lost with its lease.
                room = limit - sum(max(sh.claims.get(kind, 0), sh.used.get(kind, 0))
                                   for sh in theirs.values())
                claim = next_claim(current.get(kind, 0),
                                   targets(limit, gateways, used, asked, waiting)[self._me],
                                   used[self._me], room, kind in mine.refused,
                                   any(kind in sh.refused for sh in theirs.values()))
                if claim > 0:
                    new[kind] = claim
            if new:
                out[key_id] = new
        return out

    def _record(self, claims: Claims, loads: Mapping[str, KeyLoad]) -> s.KeyShares:
        keys = {}
        for key_id in sorted(set(claims) | set(loads)):
            load = loads.get(key_id) or KeyLoad({})
            keys[key_id] = s.KeyShare(claims=claims.get(key_id, {}), used=dict(load.used),
                                      asked=load.asked, refused=sorted(load.refused),
                                      waiting=dict(load.waiting))
        return s.KeyShares(gateway=self._me, keys=keys, updated=self._clock())

    def _due(self, record: s.KeyShares, lease: int) -> bool:
        old = self.written
        if old is None or lease != self._written_lease:
            return True
        if {k: (v.claims, v.refused) for k, v in record.keys.items()} != {
                k: (v.claims, v.refused) for k, v in old.keys.items()}:
            return True  # the others move their claims on these: at once
        if any(n > (old.keys[k].waiting.get(kind, 0) if k in old.keys else 0)
               for k, v in record.keys.items() for kind, n in v.waiting.items()):
            # More waiting than the others were told, whom they lower their
            # claims for: at once. Fewer (admitted, or refused at their
            # deadline) with the load: a key at its limit, asked for without
            # pause, would otherwise write on every step.
            return True
        return (record.keys != old.keys and record.updated - old.updated >= self._refresh)

    def _others(self) -> dict[str, s.KeyShares]:
        """The other gateways' records, and for `hold` after it went, each
        record gone with its lease (its claims and what it held, as last
        seen): etcd back from an outage past the TTL drops every lease at
        once, and a gateway alive but not yet written again still holds
        what it admitted (docs/design/client-keys.md)."""
        now = self._mono()
        live = {gw: rec for gw, rec in self._mirror.parsed(s.KEY_SHARES, s.KeyShares).items()
                if gw != self._me}
        out = dict(live)
        for gw, (rec, gone) in list(self._seen.items()):
            if gw in live:
                continue
            if gone is None:
                self._seen[gw] = (rec, gone := now)
            if now - gone >= self._hold:
                del self._seen[gw]
                continue
            out[gw] = s.KeyShares(gateway=gw, updated=rec.updated, keys={
                k: s.KeyShare(claims=sh.claims, used=sh.used)  # no demand, no refusal
                for k, sh in rec.keys.items()})
        for gw, rec in live.items():
            self._seen[gw] = (rec, None)
        return out

    def _lapse(self, until: float) -> None:
        """This gateway's lease is not proven (since `until`): its record may
        be gone and its part taken, so it claims nothing until it raises
        again, and its limiter admits its lapsed floor."""
        if self.claims or self.written is not None:
            logger.info("gateway %s cannot prove its lease: its claims on keys' limits "
                        "lapse", self._me)
        self.claims = {}
        self.written = None
        self._limiter.set_claims({}, until)

    async def step(self) -> bool:
        """One pass; True when it wrote this gateway's record. Ends the
        wait of the requests that asked to `settle` before it started."""
        settled, self._settled = self._settled, None
        try:
            return await self._step()
        finally:
            if settled is not None and not settled.done():
                settled.set_result(None)

    async def _step(self) -> bool:
        until = self._until()
        if self._mono() >= until:
            self._lapse(until)
            return False  # nothing to claim on until the lease is proven again
        lease = self._lease()
        if lease == 0 or not self._mirror.ready:
            return False
        loads = self._limiter.key_loads()
        others = self._others()
        wanted = self.decide(loads, others)
        # Lowers take effect at once; raises only once written.
        lowered: Claims = {}
        for key_id, kinds in wanted.items():
            kept = {k: min(n, self.claims.get(key_id, {}).get(k, 0)) for k, n in kinds.items()}
            if any(kept.values()):
                lowered[key_id] = {k: n for k, n in kept.items() if n > 0}
        raised = wanted != lowered
        self.claims = lowered
        self._limiter.set_claims(lowered, until)
        key = s.KEY_SHARES + self._me
        if raised and self._mirror.revision >= self._last_raise:
            record = self._record(wanted, loads)
            serial = self._mirror.get(SERIAL)
            cond = (Compare.modified_at(SERIAL, serial.mod_revision) if serial is not None
                    else Compare.absent(SERIAL))
            res = await self._store.txn([cond], [
                Put(key, record.model_dump_json().encode(), lease=lease),
                Put(SERIAL, str(self._mirror.revision).encode())])
            if res.succeeded:
                self.claims = wanted
                self._limiter.set_claims(wanted, until)
                self._last_raise = res.revision
                self.written, self._written_lease = record, lease
                return True
            # Another raise came first: decided again on the mirror that has it.
        record = self._record(lowered, loads)
        if not self._due(record, lease):
            return False
        await self._store.put(key, record.model_dump_json().encode(), lease=lease)
        self.written, self._written_lease = record, lease
        return True

    def wake(self) -> None:
        self._pause.wake()

    def _on_change(self, keys: set[str]) -> None:
        if any(k.startswith(s.KEY_SHARES) and k != s.KEY_SHARES + self._me for k in keys):
            self.wake()

    async def run(self, interval: float) -> None:
        self._limiter.on_short = self.wake
        self._limiter.settle = self.settle
        self._mirror.subscribe(self._on_change)
        self.start()
        while True:
            try:
                await self.step()
            except StoreUnavailable as exc:
                logger.debug("key shares not written: %s", exc)  # the store says so once
            except StoreError as exc:
                logger.warning("key shares not written: %s", exc)  # a lease just expired
            except Exception:
                logger.exception("key shares step crashed")
            await self._pause.wait(interval)
            await asyncio.sleep(_GAP)
