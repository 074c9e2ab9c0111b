"""Fleet writes: a node's conf (cordon, drain, pool, labels, engine build),
capacity quotas, and fabric test results (docs/design/placement.md, "Quotas";
docs/design/node-operations.md, "Fabric test").

Every write is decided on the mirror and conditioned on the key's revision
as read, or on its absence (DESIGN invariant 9): two admins on two gateways
cannot overwrite each other's change unseen; the loser decides again on
the winner's value. The caller's preconditions (If-Match, If-None-Match)
are checked against the record as stored; nothing is written past the
caller's deadline.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

from pydantic import ValidationError

from app.control import state as s
from app.control.ops.base import SETTLE, State
from app.control.ops.conditions import Deadline, Precondition
from app.control.ops.refusals import Busy, NotFound
from app.store.base import Compare, Delete, KeyValue, Put, StoreUnavailable

logger = logging.getLogger(__name__)

_TRIES = 5


class FleetOps:
    def __init__(self, state: State) -> None:
        self._state = state

    def check_known(self, node: str) -> None:
        """Refuses NotFound unless the node is known: while its agent beats,
        it has a conf, or replicas still name it (an agent restarting must
        stay cordonable)."""
        mirror = self._state.mirror
        if (mirror.get(s.NODES + node) is None and mirror.get(s.NODECONF + node) is None
                and not any(rep.node == node for rep in mirror.replicas().values())):
            raise NotFound("node", f"no node {node!r} is known to the fleet")

    async def change_conf(self, node: str, edit: Callable[[s.NodeConf], s.NodeConf],
                          cond: Precondition, deadline: Deadline) -> None:
        """Writes `edit(conf as stored)` (defaults when none is, or when the
        stored one is unreadable). Refuses: NotFound, PreconditionFailed,
        Busy, TooLate."""
        self.check_known(node)

        def decide(value: bytes | None) -> bytes:
            conf = s.NodeConf()
            if value is not None:
                try:
                    conf = s.NodeConf.model_validate_json(value)
                except ValidationError:
                    pass  # unreadable (the mirror logs it): replaced by this write
            return edit(conf).model_dump_json().encode()

        await self._write(s.NODECONF + node, decide, cond, deadline)

    async def set_quota(self, scope: str, max_gpus: int, cond: Precondition,
                        deadline: Deadline) -> None:
        """Sets the scope's quota. Refuses: PreconditionFailed, Busy, TooLate."""
        value = s.Quota(max_gpus=max_gpus).model_dump_json().encode()
        await self._write(s.QUOTAS + scope, lambda _: value, cond, deadline)

    async def delete_quota(self, scope: str, cond: Precondition, deadline: Deadline) -> None:
        """Removes the scope's quota. Refuses: NotFound, PreconditionFailed,
        Busy, TooLate."""

        def decide(value: bytes | None) -> None:
            if value is None:
                raise NotFound("quota", f"no quota is set for scope {scope!r}")

        await self._write(s.QUOTAS + scope, decide, cond, deadline)

    async def save_fabric(self, results: Sequence[s.FabricResult], settle: float) -> bool:
        """Keeps each measured direction under `fabric/{from}/{to}` for
        placement; False when the store did not answer (the results were
        measured all the same: the caller says so and answers them)."""
        rev = 0
        try:
            for res in results:
                rev = await self._state.store.put(f"{s.FABRIC}{res.from_}/{res.to}",
                                                  res.model_dump_json(by_alias=True).encode())
        except StoreUnavailable as exc:
            logger.warning("fabric results not saved: %s", exc)
            return False
        await self._state.mirror.wait_for(rev, settle)
        return True

    async def _write(self, key: str, decide: Callable[[bytes | None], bytes | None],
                     pre: Precondition, deadline: Deadline) -> None:
        """Writes `decide(value read)` (None: delete) to `key`, conditioned on
        the key's revision as read (absent: on its absence), which `pre` must
        accept. A race lost to another gateway waits for the winner's write
        and decides again."""
        store, mirror = self._state.store, self._state.mirror
        # What the next decision reads when the mirror has not caught up with
        # the store (a slow resync): the store's own answer, so that a lagging
        # mirror costs one refused write, not every try.
        read: KeyValue | None = None
        behind = False
        if pre.given:  # an ETag read elsewhere is compared with the store's
            read = await store.get(key)
            behind = read is not None and not await mirror.wait_for(read.mod_revision, SETTLE)
        for _ in range(_TRIES):
            kv = read if behind else mirror.get(key)
            pre.check(kv, key)
            new = decide(kv.value if kv is not None else None)
            if new == (kv.value if kv is not None else None):
                return
            cond = (Compare.modified_at(key, kv.mod_revision) if kv is not None
                    else Compare.absent(key))
            deadline.check()
            res = await store.txn([cond], [Put(key, new) if new is not None else Delete(key)])
            if res.succeeded:
                await mirror.wait_for(res.revision, SETTLE)
                return
            read = await store.get(key)
            behind = not await mirror.wait_for(
                read.mod_revision if read is not None else res.revision, SETTLE)
        raise Busy("record", f"{key} kept changing under this request; retry")
