"""What the operator sees of each `/v1` request: its id, its access line,
its trace headers. docs/design/routing.md, "The request id", and docs/design/logs.md.

Per request this costs a few attribute writes, one context variable set and,
only when the `app.access` logger is enabled, one log record (measured:
docs/design/logs.md). Nothing is formatted for a disabled logger.
"""

from __future__ import annotations

import logging
import random
from typing import TYPE_CHECKING, Any, Protocol

from app.logs import request_id

if TYPE_CHECKING:
    from app.router.usage.limits import Ticket

access_log = logging.getLogger("app.access")

# A client's X-Request-Id longer than this, or holding anything but printable
# ASCII, is replaced by one of ours: it goes into our logs, our answer's
# headers and the engine's request, where a control character could end a line.
MAX_REQUEST_ID = 128
# The ASGI scope's key for when the server began to read the request, by
# `time.perf_counter()` (app/gateway/http1.py stamps it; absent: the
# app's own start). Not the loop's clock: uvloop's is libuv's cached
# millisecond, too coarse for a fraction of a millisecond.
ARRIVED = "llmgw.arrived"
# W3C trace context headers pass to the engine unchanged when they are this
# short and printable (traceparent is 55 characters in version 00; the
# spec asks that at least 512 of tracestate be passed on).
_MAX_TRACEPARENT = 128
_MAX_TRACESTATE = 1024


class Tracer(Protocol):
    """Spans for a request and each of its attempts (app/router/tracing.py
    implements it with OpenTelemetry; the router only sees this). Called
    only when tracing is on: `Exchange.span` is None otherwise."""

    def begin(self, ex: Exchange) -> None:
        """Starts `ex.span`, a child of the client's traceparent if it sent one."""

    def end(self, ex: Exchange) -> None:
        """Ends `ex.span` with the request's model, replica and status."""

    def attempt(self, ex: Exchange, replica: str) -> None:
        """Starts `ex.attempt_span`, a child of `ex.span`, for one replica."""

    def attempt_end(self, ex: Exchange, status: int | None, error: str | None) -> None:
        """Ends `ex.attempt_span`: the replica's status, or why it failed."""


def new_request_id() -> str:
    """16 hex digits: unique enough to find a request in the logs. Not a
    secret (random, not secrets: no system call on the request path)."""
    return f"{random.getrandbits(64):016x}"


def _printable(value: bytes, limit: int) -> bool:
    return 0 < len(value) <= limit and value.isascii() and value.decode("ascii").isprintable()


class Exchange:
    """One `/v1` request as the logs and traces see it. The proxy fills it
    as the request goes (the relay sets `replica` and `first_byte`), and
    writes the access line from it once the request has ended."""

    __slots__ = ("answered", "arrived", "attempt_span", "body_read", "first_byte",
                 "first_token", "forwarded",
                 "key_id", "method", "model", "path", "replica", "request_id", "span", "started",
                 "status", "ticket", "traceparent", "tracestate", "upstream_wait")

    def __init__(self, method: str, path: str, started: float) -> None:
        self.method = method
        self.path = path
        self.started = started
        self.request_id = ""
        self.key_id: str | None = None
        self.model: str | None = None
        self.replica: str | None = None
        self.status = 500
        self.body_read = False  # refused before it: the connection closes (proxy.py)
        self.first_byte = 0.0  # a stream's first byte from its engine (loop time)
        # The same moment by `time.perf_counter()`, for the metrics: the
        # loop's clock (uvloop's) moves in whole milliseconds, and a fast
        # engine's first token came within one (a time to first token of 0).
        self.first_token = 0.0
        # The gateway's own cost (outcome.py, `Outcome.gateway`), by
        # `time.perf_counter()` (ARRIVED): when the request arrived, when the
        # answer started to reach the client (0.0: it did not, or its start
        # is not the gateway's to count), and the seconds spent waiting on
        # engines (and on the fleet: a hold, a spill) between.
        self.arrived = 0.0
        self.answered = 0.0
        self.upstream_wait = 0.0
        self.ticket: Ticket | None = None
        self.traceparent: bytes | None = None
        self.tracestate: bytes | None = None
        # Headers every attempt sends the engine beside ours: X-Request-Id
        # (first: relay.py leaves it out for llama.cpp, whose server answers
        # 400 to an X-Request-ID that is not a UUID) and the client's trace
        # context.
        self.forwarded: list[tuple[bytes, bytes]] = []
        self.span: Any = None  # the request's span, when tracing (tracing.py)
        self.attempt_span: Any = None

    def take_headers(self, rid: bytes | None, traceparent: bytes | None,
                     tracestate: bytes | None) -> None:
        """The client's X-Request-Id (or a new one) and trace context: set as
        the task's request id, kept for the engine."""
        if rid is not None and _printable(rid, MAX_REQUEST_ID):
            self.request_id = rid.decode("ascii")
        else:
            self.request_id = new_request_id()
            rid = self.request_id.encode()
        request_id.set(self.request_id)
        self.forwarded.append((b"X-Request-Id", rid))
        if traceparent is not None and _printable(traceparent, _MAX_TRACEPARENT):
            self.traceparent = traceparent
            self.forwarded.append((b"traceparent", traceparent))
            if tracestate is not None and _printable(tracestate, _MAX_TRACESTATE):
                self.tracestate = tracestate
                self.forwarded.append((b"tracestate", tracestate))

    @property
    def header(self) -> tuple[bytes, bytes]:
        """The answer's `x-request-id` (OpenAI's SDKs read it: `_request_id`)."""
        return (b"x-request-id", self.request_id.encode())

    def log(self, now: float) -> None:
        """The access line: at INFO on `app.access`, once the request ended."""
        if not access_log.isEnabledFor(logging.INFO):
            return
        ticket = self.ticket
        prompt: int | None = None
        completion: int | None = None
        if ticket is not None:
            completion = ticket.meter.completion_tokens
            # A llama.cpp stream's prompt is counted by its engine after it
            # (usage/prompt_count.py): not known yet, so not told.
            prompt = None if ticket.prompt_later else ticket.meter.prompt_tokens
        access_log.info(
            "%s %s %d", self.method, self.path, self.status,
            extra={"request_id": self.request_id, "key_id": self.key_id, "model": self.model,
                   "replica": self.replica, "status": self.status, "prompt_tokens": prompt,
                   "completion_tokens": completion,
                   "ttfb": self.first_byte - self.started if self.first_byte else None,
                   "duration": now - self.started})
