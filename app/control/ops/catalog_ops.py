"""Catalog writes: a model put (its name and aliases checked against every
other model's) and a model delete (docs/design/admin-writes.md, "Catalog writes").

Every change is decided on the mirror's catalog and conditioned on that
catalog being the one the decision read (`catalog/serial`, see state.py).
On a race lost to another gateway the operation waits for the winner's
write and decides again, so the loser gets the answer the new catalog gives
(Taken: the alias is now taken; PreconditionFailed: If-Match no longer
holds) rather than an overwrite. Never after the deadline (TooLate).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from app.control import catalog
from app.control import state as s
from app.control.ops.base import SETTLE, State
from app.control.ops.conditions import Deadline, Precondition, etag
from app.control.ops.refusals import Busy, InUse, Invalid, NotFound, Taken
from app.store.base import Compare, Delete, Op, Put
from app.wire import catalog as rules
from app.wire.adapters import adapter_problem, base_problem

_TRIES = 5


@dataclass(frozen=True)
class ModelPut:
    stored: dict[str, Any]  # the record as written
    existed: bool  # False: created
    etag: str | None  # the record's ETag as this gateway's mirror has it after
    changed: bool = True  # False: the spec was the one stored, nothing written


class CatalogOps:
    def __init__(self, state: State, gateway_id: str) -> None:
        self._state = state
        self._gateway_id = gateway_id

    async def put_model(self, name: str, spec: s.ModelSpec, cond: Precondition,
                        deadline: Deadline) -> ModelPut:
        """Creates or replaces model `name` (its spec already checked).
        Refuses: Taken (the name or an alias names another model),
        PreconditionFailed, Busy, TooLate."""
        result: dict[str, Any] = {}

        def decide() -> list[Op]:
            cond.check(self._state.mirror.get(s.MODELS + name), f"model {name!r}")
            models = self._state.mirror.models()
            taken = {n: n for n in models} | {
                a: m.name for m in models.values() for a in m.aliases}
            for ident in (name, *spec.aliases):
                owner = taken.get(ident)
                if owner is not None and owner != name:
                    raise Taken(f"{ident!r} already names model {owner!r}")
            why = adapter_problem(spec, models)
            if why is not None:
                raise Invalid(("adapter", "base"), why)
            why = base_problem(name, spec, models)
            if why is not None:
                raise InUse(why)
            # Spill-over (docs/design/catalog.md, "Spill-over"): an overflow names an
            # external model, which stays external while one names it.
            why = rules.overflow_problem(name, spec, models)
            if why is not None:
                raise Invalid(("overflow",), why)
            users = rules.overflowing_to(name, models)
            if spec.external is None and users:
                raise InUse(f"model {name!r} is the overflow of {', '.join(users)}: "
                            "it must stay external")
            existed = name in models
            if existed and models[name].spec_dump() == spec.spec_dump():
                # The spec as stored (a `model show` put back): no write, so
                # the ETag and the catalog serial stay and no mirror wakes.
                result.update(stored=json.loads(catalog.stored_value(
                    name, models[name].created, spec)), existed=True, changed=False)
                return []
            created = models[name].created if existed else time.time()
            value = catalog.stored_value(name, created, spec)
            result.update(stored=json.loads(value), existed=existed, changed=True)
            return [Put(s.MODELS + name, value)]

        await self._write(decide, deadline, cond.given)
        return ModelPut(result["stored"], result["existed"],
                        etag(self._state.mirror.get(s.MODELS + name)), result["changed"])

    async def delete_model(self, name: str, cond: Precondition, deadline: Deadline) -> None:
        """Removes model `name`. Refuses: NotFound, PreconditionFailed, Busy, TooLate."""

        def decide() -> list[Op]:
            cond.check(self._state.mirror.get(s.MODELS + name), f"model {name!r}")
            if name not in self._state.mirror.models():
                raise NotFound("model", f"model {name!r} is not in the catalog")
            why = base_problem(name, None, self._state.mirror.models())
            if why is not None:
                raise InUse(why)
            users = rules.overflowing_to(name, self._state.mirror.models())
            if users:
                raise InUse(f"model {name!r} is the overflow of {', '.join(users)}: "
                            "change their overflow first")
            return [Delete(s.MODELS + name)]

        await self._write(decide, deadline, cond.given)

    async def _settle(self, revision: int) -> None:
        await self._state.mirror.wait_for(revision, SETTLE)

    async def _write(self, decide: Callable[[], list[Op]], deadline: Deadline,
                     conditioned: bool) -> int:
        """Applies `decide()`'s ops with a bump of the catalog serial it read
        (none, and nothing written, when it decides on no ops).
        A `conditioned` write first brings the mirror up to the store, so an
        ETag read on another gateway is compared with what is stored now."""
        if conditioned:
            current = await self._state.store.get(s.CATALOG_SERIAL)
            if current is not None:
                await self._settle(current.mod_revision)
        for _ in range(_TRIES):
            serial = self._state.mirror.get(s.CATALOG_SERIAL)
            seen = serial.mod_revision if serial is not None else 0
            ops = decide()
            if not ops:  # nothing to change: no write, no serial bump
                return seen
            bump = Put(s.CATALOG_SERIAL, json.dumps({"by": self._gateway_id}).encode())
            deadline.check()  # the client may have given up while this waited
            res = await self._state.store.txn([Compare.modified_at(s.CATALOG_SERIAL, seen)],
                                        [*ops, bump])
            if res.succeeded:
                await self._settle(res.revision)
                return res.revision
            # Someone else's write came first: read it, then decide again.
            current = await self._state.store.get(s.CATALOG_SERIAL)
            await self._settle(current.mod_revision if current is not None else res.revision)
        raise Busy("catalog", "the catalog kept changing under this request; retry")
