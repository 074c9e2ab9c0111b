"""Spill-over: a request the fleet cannot take goes to its model's overflow,
an external model of the catalog (docs/design/catalog.md, "Spill-over").

Decided once per request, before the first attempt, with no I/O but the
short hold for a replica on its way:

* `saturated`: every routable replica is saturated (the router's own
  notion, `choice.tier`: the engine's queue or KV cache full, a serial
  engine's queue over every gateway), where without an overflow the
  request would queue on one of them;
* `hold_timeout`: no replica routable, one on its way, and none became
  ready within `Timeouts.spill_hold` (shorter than a cold start's hold);
* `hold_full`: as that, but this gateway already holds its most requests;
* `no_replica`: no replica routable and none on its way (where without an
  overflow the client gets the 503).

A spill reserves the most it can cost from the key's external budget
(`external_tokens_per_day`, usage/budget.py; `estimates.reservation`) and is
settled to its answer's usage when it ends: refused with a 429
`external_budget_exceeded` when the budget is spent or reserved. A key
without that limit does not spill (its request goes on as if the model had
no overflow) unless the overflow says `spill_unbudgeted`: adding an overflow
to a model must not open the provider's bill to every key allowed that
model. An overflow that is itself withheld (its key file unreadable) takes
nothing either.
"""

from __future__ import annotations

from app.router.access import Exchange
from app.router.call import Call
from app.router.table import RouteTable
from app.router.timeouts import Timeouts
from app.router.usage.estimates import DEFAULT_RESERVE, reservation
from app.router.usage.limits import Limiter

REASONS = ("saturated", "hold_timeout", "hold_full", "no_replica")


def served_by(ex: Exchange) -> list[tuple[bytes, bytes]]:
    """The answer's header naming where a spilled request was served: none
    for one served by the fleet (it has `x-llmgw-replica`)."""
    t = ex.ticket
    return [(b"x-llmgw-served-by", b"overflow:" + t.model.encode())] if t and t.external else []


class Spill:
    """A request's way to its model's overflow, for `relay.forward`: what
    the `Call` it routes (its model, grant, admission and body) does not
    carry."""

    __slots__ = ("_limiter", "_size", "_table", "_timeouts")

    def __init__(self, table: RouteTable, limiter: Limiter, timeouts: Timeouts,
                 size: int) -> None:
        self._table = table
        self._limiter = limiter
        self._timeouts = timeouts
        self._size = size  # the body's bytes as sent: its prompt's bound (usage/estimates.py)

    @staticmethod
    def of(table: RouteTable, limiter: Limiter, timeouts: Timeouts, model: str,
           size: int) -> Spill | None:
        """The request's way to `model`'s overflow; None: it has none."""
        if table.overflow(model) is None:
            return None
        return Spill(table, limiter, timeouts, size)

    async def route(self, call: Call) -> str:
        """The model to send `call` to: its model, or its overflow (OverLimit
        when the key's external budget is spent). May hold the request up to
        `spill_hold` for a replica on its way; a cancellation (the watch's)
        propagates."""
        table, model = self._table, call.model
        target = table.overflow(model)
        eps = table.endpoints(target) if target is not None else ()
        if not eps:
            return model  # an overflow withheld (its key file unreadable) takes nothing
        assert call.grant is not None
        if call.grant.limits.external_tokens_per_day is None and not eps[0].spill_unbudgeted:
            return model  # a key without a budget stays on the fleet (Catalog, Spill-over)
        if table.endpoints(model):
            return await self._to_overflow(call, "saturated") if table.saturated(model) else model
        if not table.holdable(model):
            return await self._to_overflow(call, "no_replica")
        if not table.hold(model, self._timeouts.cold_start_held):
            return await self._to_overflow(call, "hold_full")
        try:
            if await table.wait_routable(model, self._timeouts.spill_hold):
                return model
        finally:
            table.unhold(model)
        return await self._to_overflow(call, "hold_timeout")

    async def _to_overflow(self, call: Call, reason: str) -> str:
        model = call.model
        target = self._table.overflow(model)
        assert target is not None
        eps = self._table.endpoints(target)
        if not eps:  # withheld while this request was held: as without an overflow
            return model
        ticket, grant = call.ticket, call.grant
        assert ticket is not None and grant is not None
        tokens = reservation(call.body, self._size, eps[0].spill_reserve or DEFAULT_RESERVE,
                             completes=call.ex.path != "/v1/embeddings")
        # Refused below the key's budget, it waits for a raised claim as a
        # request does (usage/limits.py, `admit_or_wait`).
        ticket.reserved = await self._limiter.reserve_external(
            grant.id, grant.limits.external_tokens_per_day, grant.gateways, model, target,
            tokens)
        ticket.external = True  # settled when released (Limiter._finish)
        ticket.model = target  # its usage is the overflow's (GET /admin/keys/{id}/usage)
        ticket.meter.rename = model  # the answer names the model as our engines do
        self._table.spilled(model, reason)
        return target
