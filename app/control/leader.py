"""Leader election on a store lease, with fencing.

Each gateway holds one lease: it binds the gateway's `gateways/{id}` record,
its usage snapshot and, on the winner, the `leader` key. Two steps, run by
two loops so that a renewal never waits behind a campaign stuck on a slow
store: `renew()` renews the lease (or gets a new one), and `campaign()`
tries to create the `leader` key, only when the mirror shows none (so a
fleet with a leader costs the store one keepalive per gateway and
interval, not a transaction). `tick()` runs both, for tests.

What this does *not* guarantee: that only one gateway *believes* it leads.
A gateway paused longer than the TTL (GC, SIGSTOP, a VM migration) may wake
up still thinking it leads. That is why every leader write goes through
`fence()`: a transaction conditioned on the `leader` key still having the
create revision this gateway wrote. A new leader's key has a new create
revision, so the old leader's writes are refused by the store itself.

A gateway stops *acting* as leader as soon as it cannot prove its lease
alive: `is_leader` is false once the last successful renewal, minus a
margin, is older than the TTL, whatever the store client believes.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from app.control import state as s
from app.control.mirror import Mirror
from app.store.base import (
    Compare,
    Delete,
    LeaseExpired,
    Put,
    Store,
    StoreError,
    StoreUnavailable,
)

logger = logging.getLogger(__name__)


class NotLeader(Exception):
    """Raised by `fence()` on a gateway that cannot prove it leads."""


@dataclass(frozen=True)
class ElectionStep:
    is_leader: bool
    leader_changed: bool


class Elector:
    def __init__(
        self,
        store: Store,
        gateway: s.GatewayInfo,
        ttl: int,
        clock: Callable[[], float] = time.monotonic,
        mirror: Mirror | None = None,
        on_started_leading: Callable[[], None] | None = None,
        on_stopped_leading: Callable[[], None] | None = None,
    ) -> None:
        self._store = store
        # Told when this gateway takes and loses the lead, as client-go's
        # leaderelection callbacks: the leader-only loops start and stop
        # (app/gateway/supervisor.py, `Leadership`).
        self._on_started, self._on_stopped = on_started_leading, on_stopped_leading
        # Without a mirror (some tests), every campaign asks the store.
        self._mirror = mirror
        self._was_leader = False
        self._gateway = gateway
        self._ttl = ttl
        self._clock = clock
        self.lease = 0
        self._leader_revision = 0  # create revision of our `leader` key; 0 = not ours
        self._renewed_at = float("-inf")  # when the last successful renewal was *sent*

    @property
    def gateway_id(self) -> str:
        return self._gateway.id

    def _lease_proven(self) -> bool:
        return self._clock() < self.proven_until()

    def proven_until(self, extra: float = 0.0) -> float:
        """Until when (this elector's clock) the lease is proven alive, and
        `extra` seconds more: what the others wait past its expiry before
        they take what it bound (the key-share records' hold).

        The store counts the TTL from when it received the renewal, which is
        after we sent it; a fifth of the time covers clock-rate differences."""
        return self._renewed_at + (self._ttl + extra) * 0.8

    @property
    def lead_revision(self) -> int:
        """The store revision at which this gateway took the lead; 0 when it
        does not hold the `leader` key.

        It is the create revision of our `leader` key: the revision of the
        campaign transaction that won, or, when that answer was lost, the
        create revision of the key found bound to our lease. Every write of
        an earlier leader came before it (they were fenced on a key that had
        to be gone before ours could be created), so a mirror that has
        reached this revision holds all of them: the reconciler plans only
        then (docs/design/placement.md).
        """
        return self._leader_revision

    @property
    def is_leader(self) -> bool:
        return self._leader_revision != 0 and self._lease_proven()

    def fence(self) -> list[Compare]:
        """The condition every leader write must carry (DESIGN invariant 1)."""
        if not self.is_leader:
            raise NotLeader(f"gateway {self._gateway.id} does not hold the leader key")
        return [Compare.created_at(s.LEADER, self._leader_revision)]

    def signed(self, ops: list[Put | Delete]) -> list[Put | Delete]:
        """`ops` and the `leader-write` put that names their writer and its
        lease, so that etcd's history attributes every fenced write
        (docs/architecture.md, "State")."""
        me = s.LeaderWrite(id=self._gateway.id, lease=self.lease)
        return [*ops, Put(s.LEADER_WRITE, me.model_dump_json().encode())]

    async def tick(self) -> ElectionStep:
        """One renewal, then one campaign."""
        was = self.is_leader
        await self.renew()
        await self.campaign()
        now = self.is_leader
        return ElectionStep(now, now != was)

    async def renew(self) -> None:
        """Renews the lease, or gets a new one (and rewrites `gateways/{id}`)."""
        sent = self._clock()
        try:
            if self.lease == 0:
                self.lease = await self._store.grant(self._ttl)
                self._renewed_at = sent
                await self._store.put(
                    s.GATEWAYS + self._gateway.id,
                    self._gateway.model_dump_json().encode(),
                    lease=self.lease,
                )
            else:
                await self._store.keepalive(self.lease)
                self._renewed_at = sent
        except StoreError as exc:
            self._failed("renewal", exc)
        self._note()

    async def campaign(self) -> None:
        """Takes the `leader` key if no one holds it; notes whether we do."""
        try:
            if self.lease != 0 and self._needs_campaign():
                await self._campaign()
        except StoreError as exc:
            self._failed("campaign", exc)
        self._note()

    def _needs_campaign(self) -> bool:
        """What the mirror shows of the `leader` key, without asking the store."""
        m = self._mirror
        if m is None:
            return True
        if not m.ready:
            return False  # cannot see whether someone leads
        kv = m.get(s.LEADER)
        if kv is not None:
            if kv.lease == self.lease:
                self._leader_revision = kv.create_revision  # ours (an answer lost)
            elif m.revision >= self._leader_revision:
                self._leader_revision = 0  # another gateway's, after ours
            return False
        if self._leader_revision and m.revision < self._leader_revision:
            return False  # we just won: the mirror has not seen our key yet
        self._leader_revision = 0  # none, or ours gone with our lease
        return True

    def _failed(self, what: str, exc: StoreError) -> None:
        if isinstance(exc, LeaseExpired):
            logger.warning("gateway %s lost its lease; starting over", self._gateway.id)
            self.lease = 0
            self._leader_revision = 0
        elif isinstance(exc, StoreUnavailable):
            # Said once by the store when it became unreachable; not every
            # election interval here. is_leader lapses on its own with time.
            logger.debug("election %s failed: %s", what, exc)
        else:
            logger.warning("election %s failed: %s", what, exc)

    def _note(self) -> None:
        now = self.is_leader
        if now == self._was_leader:
            return
        self._was_leader = now
        logger.info("gateway %s %s leadership", self._gateway.id, "took" if now else "lost")
        told = self._on_started if now else self._on_stopped
        if told is not None:
            told()

    async def _campaign(self) -> None:
        value = s.LeaderInfo(id=self._gateway.id, url=self._gateway.url).model_dump_json()
        lease = self.lease
        result = await self._store.txn(
            [Compare.absent(s.LEADER)], [Put(s.LEADER, value.encode(), lease)]
        )
        if result.succeeded:
            self._leader_revision = result.revision
            return
        current = await self._store.get(s.LEADER)
        if current is not None and current.lease == lease:
            self._leader_revision = current.create_revision
        else:
            self._leader_revision = 0

    async def step_down(self) -> None:
        """A stop begins: gives up the lead at once but keeps the lease, which
        still binds this gateway's record and usage snapshot while its open
        requests run (drains elsewhere count them; docs/design/stopping.md).
        The campaign loop must be stopped first, or it would
        take the lead again. Another gateway campaigns once its mirror shows
        no `leader` key: within an election interval."""
        revision, self._leader_revision = self._leader_revision, 0
        self._note()
        if revision:
            try:
                await self._store.txn([Compare.created_at(s.LEADER, revision)],
                                      [Delete(s.LEADER)])
            except StoreError as exc:
                logger.warning("could not give up the lead on stop (%s); it passes when "
                               "the lease is revoked or expires", exc)

    async def resign(self) -> None:
        """Clean stop: revoke the lease so that another gateway leads at once."""
        lease, self.lease, self._leader_revision = self.lease, 0, 0
        if lease:
            try:
                await self._store.revoke(lease)
            except StoreError as exc:
                logger.warning("could not revoke lease on stop (%s); it expires in %d s",
                               exc, self._ttl)
