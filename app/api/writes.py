"""When an admin write may be applied: the client's preconditions
(`If-Match`, `If-None-Match: *` against a record's ETag) and deadlines (the
client's `X-Request-Deadline`, and LLMGW_ADMIN_WRITE_DEADLINE counted from
when the request arrived). See docs/architecture.md, Catalog writes.

A record's ETag is its key's mod revision in the store, quoted: the same on
every gateway, changed by every write of that record.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

from fastapi import Request

from app.api.errors import Problem
from app.store.base import KeyValue

# The ASGI scope key GatewayApp stamps with time.monotonic() as a request
# enters the app (app/main.py), before its body is read.
RECEIVED = "llmgw.received"
DEADLINE_HEADER = "x-request-deadline"


def etag(kv: KeyValue | None) -> str | None:
    """The ETag of a record as stored, None when there is none."""
    return None if kv is None else f'"{kv.mod_revision}"'


def _tags(raw: str, header: str) -> list[str]:
    tags = [t.strip() for t in raw.split(",") if t.strip()]
    for t in tags:
        bare = t[2:] if t.startswith("W/") else t
        if t != "*" and not (len(bare) >= 2 and bare[0] == bare[-1] == '"'):
            raise Problem(400, f"Invalid {header}",
                          f"{header} takes '*' or quoted ETags (\"123\"), not {t[:40]!r}")
    return tags


@dataclass(frozen=True)
class Precondition:
    """A request's If-Match / If-None-Match (RFC 9110 13.1), checked against
    the record it would replace. A weak tag never matches (strong comparison)."""

    if_match: tuple[str, ...] | None = None
    if_none_match: tuple[str, ...] | None = None

    @classmethod
    def of(cls, request: Request) -> Precondition:
        m = request.headers.get("if-match")
        n = request.headers.get("if-none-match")
        return cls(tuple(_tags(m, "If-Match")) if m is not None else None,
                   tuple(_tags(n, "If-None-Match")) if n is not None else None)

    @property
    def given(self) -> bool:
        return self.if_match is not None or self.if_none_match is not None

    def check(self, kv: KeyValue | None, what: str) -> None:
        """Raises 412 (naming the current ETag) unless the write may replace `kv`."""
        current = etag(kv)
        if self.if_match is not None:
            ok = current is not None and ("*" in self.if_match or current in self.if_match)
            if not ok:
                raise self._failed(what, current, "If-Match")
        if self.if_none_match is not None:
            hit = current is not None and ("*" in self.if_none_match or any(
                t.removeprefix("W/") == current for t in self.if_none_match))
            if hit:
                raise self._failed(what, current, "If-None-Match")

    @staticmethod
    def _failed(what: str, current: str | None, header: str) -> Problem:
        now = f"its ETag is now {current}" if current else "it does not exist"
        return Problem(412, "Precondition Failed",
                       f"{what}: {header} does not hold ({now}); nothing written. "
                       "Read it again and decide on what it holds now.",
                       etag=current)


class Deadline:
    """When a write is too late to apply: after the client's deadline (a Unix
    time it sent, so it needs the clocks to agree), or more than `bound`
    seconds after the request arrived by this process's monotonic clock
    (which needs no agreement, and runs on while the process is stopped)."""

    def __init__(self, request: Request, bound: float) -> None:
        self._received = float(request.scope.get(RECEIVED, time.monotonic()))
        self._bound = bound
        raw = request.headers.get(DEADLINE_HEADER)
        self._client: float | None = None
        if raw is not None:
            try:
                self._client = float(raw)
            except ValueError:
                self._client = math.nan
            if not math.isfinite(self._client):
                raise Problem(400, "Invalid X-Request-Deadline",
                              "X-Request-Deadline takes a Unix time in seconds "
                              f"(1764600000.5), not {raw[:40]!r}")

    def check(self) -> None:
        """Raises 408 when the write must not be applied now; call it just
        before each store write."""
        if self._client is not None and time.time() > self._client:
            raise Problem(408, "Deadline passed",
                          f"the client's X-Request-Deadline passed "
                          f"{time.time() - self._client:.1f} s ago; nothing written")
        held = time.monotonic() - self._received
        if held > self._bound:
            raise Problem(408, "Deadline passed",
                          f"the request arrived {held:.1f} s ago, more than "
                          f"LLMGW_ADMIN_WRITE_DEADLINE ({self._bound:g} s); nothing written")
