"""The leader's reconcile loop: gather state, call `plan()`, apply it fenced.

`tick()` is one pass and returns what it did; `run()` only repeats it, woken
early by any change the mirror sees (a catalog edit, a node joining), so a
PUT is acted on at once rather than at the next interval.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from app.control import state as s
from app.control.leader import Elector, NotLeader
from app.control.mirror import Mirror
from app.control.placement import Plan, plan
from app.store.base import Delete, Put, Store, StoreError

logger = logging.getLogger(__name__)


@dataclass
class TickResult:
    acted: bool = False
    skipped: str = ""
    plan: Plan = field(default_factory=Plan)
    fenced_out: bool = False


class Reconciler:
    def __init__(
        self,
        store: Store,
        mirror: Mirror,
        elector: Elector,
        *,
        drain_seconds: float,
        interval: float,
        wall: Callable[[], float] = time.time,
        new_suffix: Callable[[], str] = lambda: secrets.token_hex(4),
    ) -> None:
        self._store = store
        self._mirror = mirror
        self._elector = elector
        self._drain_seconds = drain_seconds
        self._interval = interval
        self._wall = wall
        self._new_suffix = new_suffix
        # The revision of our last write. It must be in the mirror before the
        # next pass plans on it, or a replica just created would be created
        # twice.
        self.written_revision = 0
        self.last_unplaced: dict[str, str] = {}

    async def tick(self) -> TickResult:
        if not self._elector.is_leader:
            return TickResult(skipped="not leader")
        if not self._mirror.ready or self._mirror.revision < self.written_revision:
            return TickResult(skipped="mirror behind our last write")
        p = plan(
            self._mirror.models(), self._mirror.nodes(), self._mirror.replicas(),
            now=self._wall(), drain_seconds=self._drain_seconds, new_suffix=self._new_suffix,
        )
        if p.unplaced != self.last_unplaced:
            for model, why in p.unplaced.items():
                logger.warning("cannot place a replica of %s: %s", model, why)
        self.last_unplaced = p.unplaced
        result = TickResult(plan=p)
        if p.empty:
            return result
        replicas = self._mirror.replicas()
        try:
            for rep in p.create:
                logger.info("placing replica %s of %s on %s gpus=%s",
                            rep.id, rep.model, rep.node, rep.gpus)
                await self._write([Put(s.REPLICAS + rep.id, rep.model_dump_json().encode())])
            for rid in p.drain:
                logger.info("draining replica %s", rid)
                drained = replicas[rid].model_copy(update={"draining_since": self._wall()})
                await self._write([Put(s.REPLICAS + rid, drained.model_dump_json().encode())])
            for rid in p.delete:
                logger.info("removing replica %s", rid)
                await self._write([Delete(s.REPLICAS + rid), Delete(s.STATUS + rid)])
        except NotLeader as exc:
            logger.warning("stopped applying the plan: %s", exc)
            result.fenced_out = True
        result.acted = True
        return result

    async def _write(self, ops: list[Put | Delete]) -> None:
        res = await self._store.txn(self._elector.fence(), ops)
        if not res.succeeded:
            raise NotLeader("the leader key changed under us; write refused")
        self.written_revision = max(self.written_revision, res.revision)

    async def run(self) -> None:
        while True:
            seen = self._mirror.revision
            try:
                await self.tick()
            except StoreError as exc:
                logger.warning("reconcile pass failed: %s", exc)
            except Exception:
                logger.exception("reconcile pass crashed")
            await self._mirror.wait_past(seen, self._interval)
