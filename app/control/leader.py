"""Leader election on a store lease, with fencing.

Each gateway holds one lease: it binds the gateway's `gateways/{id}` record
and, on the winner, the `leader` key. `tick()` is one step: renew the lease
(or get a new one), then try to create the `leader` key if nobody holds it.

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
from app.store.base import Compare, LeaseExpired, Put, Store, StoreError, StoreUnavailable

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
    ) -> None:
        self._store = store
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
        # The store counts the TTL from when it received the renewal, which is
        # after we sent it; a fifth of the TTL covers clock-rate differences.
        return self._clock() - self._renewed_at < self._ttl * 0.8

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
        then (docs/architecture.md, Placement).
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

    async def tick(self) -> ElectionStep:
        was = self.is_leader
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
            await self._campaign()
        except LeaseExpired:
            logger.warning("gateway %s lost its lease; starting over", self._gateway.id)
            self.lease = 0
            self._leader_revision = 0
        except StoreUnavailable as exc:
            # Said once by the store when it became unreachable; not every
            # election interval here. is_leader lapses on its own with time.
            logger.debug("election step failed: %s", exc)
        except StoreError as exc:
            logger.warning("election step failed: %s", exc)
        now = self.is_leader
        if now != was:
            logger.info("gateway %s %s leadership", self._gateway.id,
                        "took" if now else "lost")
        return ElectionStep(now, now != was)

    async def _campaign(self) -> None:
        value = s.LeaderInfo(id=self._gateway.id, url=self._gateway.url).model_dump_json()
        result = await self._store.txn(
            [Compare.absent(s.LEADER)], [Put(s.LEADER, value.encode(), self.lease)]
        )
        if result.succeeded:
            self._leader_revision = result.revision
            return
        current = await self._store.get(s.LEADER)
        if current is not None and current.lease == self.lease:
            self._leader_revision = current.create_revision
        else:
            self._leader_revision = 0

    async def resign(self) -> None:
        """Clean stop: revoke the lease so that another gateway leads at once."""
        lease, self.lease, self._leader_revision = self.lease, 0, 0
        if lease:
            try:
                await self._store.revoke(lease)
            except StoreError as exc:
                logger.warning("could not revoke lease on stop (%s); it expires in %d s",
                               exc, self._ttl)
