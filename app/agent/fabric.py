"""Fabric test, the agent's part: stream bytes to another agent, or sink them.

A gateway measures the TCP bandwidth from node A to node B in two calls
(app/api/fabric.py; docs/design/node-operations.md):

    POST B /node/v1/fabric/ticket                 -> {"ticket", "expires_in"}
    POST A /node/v1/fabric/send {"sink_url", "ticket", "seconds", "bytes"}
         A: POST B /node/v1/fabric/sink, Bearer TICKET, a stream of zeros
         B: reads and discards it, answers {"bytes", "seconds"}  -> relayed by A

A knows only its own node token, and must not learn B's: B's sink accepts a
ticket instead, which B makes at random on its gateway's request, keeps for
TICKET_TTL seconds and accepts once. Both ends cap what one test may cost
(MAX_SECONDS, MAX_BYTES) and run one test at a time, so a node token or a
ticket cannot make an agent a traffic generator or a sink without end.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
from aiohttp import web

# The contract with the gateways that run a test (app/wire/fabric.py).
from app.wire.fabric import MAX_BYTES, MAX_SECONDS, SINK_PATH

TICKET_TTL = 60.0
MAX_TICKETS = 16
CHUNK = 1 << 20
# The sink gives up on a sender this long after its cap: a stalled stream
# must not hold the sink (and its one-test-at-a-time slot) for ever.
SINK_GRACE = 5.0


class FabricError(Exception):
    """Refused or failed; `status` is the HTTP status to answer with."""

    def __init__(self, status: int, title: str, detail: str) -> None:
        super().__init__(detail)
        self.status, self.title, self.detail = status, title, detail


class Fabric:
    """Tickets, the sink and the sender of one agent."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._tickets: dict[str, float] = {}  # ticket -> expiry
        self._busy = asyncio.Lock()

    # --- tickets ---------------------------------------------------------------------

    def issue(self) -> str:
        now = self.clock()
        self._tickets = {t: exp for t, exp in self._tickets.items() if exp > now}
        if len(self._tickets) >= MAX_TICKETS:
            raise FabricError(429, "Too many tickets",
                              f"{MAX_TICKETS} sink tickets are outstanding; retry in a minute")
        ticket = secrets.token_urlsafe(32)
        self._tickets[ticket] = now + TICKET_TTL
        return ticket

    def take(self, ticket: str) -> bool:
        """True once for a ticket issued within TICKET_TTL; it is spent then."""
        expiry = self._tickets.pop(ticket, None)
        return expiry is not None and expiry > self.clock()

    # --- one test at a time ----------------------------------------------------------

    def _claim(self) -> None:
        if self._busy.locked():
            raise FabricError(409, "Fabric test running",
                              "this agent is in another fabric test; retry when it ends")

    # --- the sink --------------------------------------------------------------------

    async def sink(self, content: aiohttp.StreamReader) -> dict[str, Any]:
        """Reads and discards a stream up to MAX_BYTES: its bytes and seconds,
        from the first byte to the last."""
        self._claim()
        async with self._busy:
            received = 0
            first: float | None = None
            try:
                async with asyncio.timeout(MAX_SECONDS + SINK_GRACE):
                    while chunk := await content.readany():
                        if first is None:
                            first = self.clock()
                        received += len(chunk)
                        if received > MAX_BYTES:
                            raise FabricError(413, "Too much",
                                              f"a fabric test sends at most {MAX_BYTES} bytes")
            except TimeoutError:
                raise FabricError(408, "Sender too slow", "the stream did not end within "
                                  f"{MAX_SECONDS + SINK_GRACE:g} s") from None
            seconds = self.clock() - first if first is not None else 0.0
            return {"bytes": received, "seconds": seconds}

    # --- the sender ------------------------------------------------------------------

    async def send(self, sink_url: str, ticket: str, seconds: float,
                   max_bytes: int) -> dict[str, Any]:
        """Streams zeros to `sink_url` for `seconds` or `max_bytes`, whichever
        ends first; answers the sink's count."""
        self._claim()
        async with self._busy:
            chunk = bytes(CHUNK)
            sent = 0

            async def stream() -> AsyncIterator[bytes]:
                nonlocal sent
                start = self.clock()
                while sent < max_bytes and self.clock() - start < seconds:
                    piece = chunk if max_bytes - sent >= CHUNK else chunk[:max_bytes - sent]
                    sent += len(piece)
                    yield piece

            timeout = aiohttp.ClientTimeout(total=seconds + SINK_GRACE + 5, sock_connect=5)
            try:
                async with aiohttp.ClientSession(timeout=timeout) as session, session.post(
                    sink_url, data=stream(), headers={"Authorization": f"Bearer {ticket}"},
                ) as resp:
                    answer = await resp.json(content_type=None)
                    status = resp.status
            except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
                raise FabricError(502, "Sink unreachable", f"streaming to {sink_url}: "
                                  f"{exc or type(exc).__name__}") from None
            if status != 200 or not isinstance(answer, dict):
                detail = answer.get("detail", "") if isinstance(answer, dict) else ""
                raise FabricError(502, "Sink refused",
                                  f"the sink at {sink_url} answered {status}: {detail}")
            return {"bytes": int(answer.get("bytes", 0)),
                    "seconds": float(answer.get("seconds", 0.0)), "sent": sent}


def check_send(body: Any) -> tuple[str, str, float, int]:
    """The send request's fields, or FabricError 400 saying what is wrong."""
    if not isinstance(body, dict):
        raise FabricError(400, "Bad body", "send a JSON object")
    url, ticket = body.get("sink_url"), body.get("ticket")
    seconds, max_bytes = body.get("seconds", 1.0), body.get("bytes", MAX_BYTES)
    if not isinstance(url, str) or not url.startswith(("http://", "https://")):
        raise FabricError(400, "Bad body", "sink_url must be an http(s) URL")
    if not isinstance(ticket, str) or not 0 < len(ticket) <= 200:
        raise FabricError(400, "Bad body", "ticket must be the sink's ticket")
    if (not isinstance(seconds, int | float) or isinstance(seconds, bool)
            or not 0 < seconds <= MAX_SECONDS):
        raise FabricError(400, "Bad body", f"seconds must be above 0 and at most {MAX_SECONDS:g}")
    if (not isinstance(max_bytes, int) or isinstance(max_bytes, bool)
            or not 0 < max_bytes <= MAX_BYTES):
        raise FabricError(400, "Bad body", f"bytes must be 1 to {MAX_BYTES}")
    return url, ticket, float(seconds), max_bytes


def routes(fabric: Fabric, app: web.Application,
           problem: Callable[[int, str, str], web.Response]) -> None:
    """Adds the three routes; the sink's ticket is checked by NodeApi's guard."""

    async def ticket(request: web.Request) -> web.Response:
        try:
            return web.json_response({"ticket": fabric.issue(), "expires_in": TICKET_TTL})
        except FabricError as exc:
            return problem(exc.status, exc.title, exc.detail)

    async def sink(request: web.Request) -> web.Response:
        try:
            return web.json_response(await fabric.sink(request.content))
        except FabricError as exc:
            return problem(exc.status, exc.title, exc.detail)

    async def send(request: web.Request) -> web.Response:
        try:
            try:
                body = await request.json()
            except ValueError:
                body = None
            return web.json_response(await fabric.send(*check_send(body)))
        except FabricError as exc:
            return problem(exc.status, exc.title, exc.detail)

    app.router.add_post("/node/v1/fabric/ticket", ticket)
    app.router.add_post(SINK_PATH, sink)
    app.router.add_post("/node/v1/fabric/send", send)
