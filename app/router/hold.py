"""Scale from zero: a request held while its model's first replica is on
its way (app/router/relay.py holds it before its first attempt;
docs/architecture.md, "Flows")."""

from __future__ import annotations

import asyncio

from app.router import own_answers
from app.router.call import Call
from app.router.own_answers import error
from app.router.table import RouteTable
from app.router.timeouts import Timeouts


async def hold(table: RouteTable, t: Timeouts, call: Call) -> None:
    """Scale from zero: holds a request while `model`'s replica is on its
    way, up to `cold_start` seconds. A stream's response starts at once
    (`call.started` set): its headers, then SSE comments every few seconds,
    so that neither the client nor a proxy between gives up on it."""
    model, send = call.model, call.send
    if not table.hold(model, t.cold_start_held):
        raise error(503, f"Too many requests are waiting for '{model}' to start here; "
                    "retry shortly.", "service_unavailable", "model_starting",
                    retry_after=max(1, int(t.cold_start / 10)))
    keepalive: asyncio.Task[None] | None = None
    failed: BaseException | None = None
    try:
        if call.stream:
            await send({"type": "http.response.start", "status": 200, "headers": [
                (b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache"),
                (b"x-llmgw-held", b"cold-start"), call.ex.header]})
            call.started = True
            keepalive = asyncio.create_task(own_answers.keep_alive(send, model))
        if not await table.wait_routable(model, t.cold_start):
            table.hold_timed_out(model)
            why = table.unavailable(model)
            raise error(503, f"No replica of '{model}' became ready within "
                        f"{t.cold_start:g} s" + (f": {why}" if why else "."),
                        "service_unavailable", "no_ready_replica",
                        retry_after=max(1, int(t.cold_start / 10)))
    except BaseException as exc:
        # Re-raised once the keep-alive has stopped: no await in an except
        # or finally block, which the compiled router would get wrong
        # (docs/design/hot-path.md, "The router compiled").
        failed = exc
    table.unhold(model)
    if keepalive is not None:
        keepalive.cancel()
        await asyncio.gather(keepalive, return_exceptions=True)
    if failed is not None:
        try:
            raise failed
        finally:
            failed = None  # no reference cycle through the frame
