"""When a write may be applied: the client's preconditions (If-Match,
If-None-Match against a record's ETag) and its deadline, as plain values
(app/api/writes.py reads them off the request). See docs/design/admin-writes.md, "Catalog writes".

A record's ETag is its key's mod revision in the store, quoted: the same on
every gateway, changed by every write of that record.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from app.control.ops.refusals import PreconditionFailed, TooLate
from app.store.base import KeyValue


def etag(kv: KeyValue | None) -> str | None:
    """The ETag of a record as stored, None when there is none."""
    return None if kv is None else f'"{kv.mod_revision}"'


@dataclass(frozen=True)
class Precondition:
    """A request's If-Match / If-None-Match (RFC 9110 13.1), checked against
    the record it would replace. A weak tag never matches (strong comparison)."""

    if_match: tuple[str, ...] | None = None
    if_none_match: tuple[str, ...] | None = None

    @property
    def given(self) -> bool:
        return self.if_match is not None or self.if_none_match is not None

    def check(self, kv: KeyValue | None, what: str) -> None:
        """Raises PreconditionFailed (naming the current ETag) unless the
        write may replace `kv`."""
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
    def _failed(what: str, current: str | None, header: str) -> PreconditionFailed:
        now = f"its ETag is now {current}" if current else "it does not exist"
        return PreconditionFailed(f"{what}: {header} does not hold ({now}); nothing written. "
                                  "Read it again and decide on what it holds now.", current)


NO_PRECONDITION = Precondition()


@dataclass(frozen=True)
class Deadline:
    """When a write is too late to apply: after the client's deadline
    (`client`, a Unix time it sent, so it needs the clocks to agree), or
    more than `bound` seconds after the request arrived (`received`, by this
    process's monotonic clock, which needs no agreement and runs on while
    the process is stopped)."""

    received: float
    bound: float
    client: float | None = None

    def check(self) -> None:
        """Raises TooLate when the write must not be applied now; call it
        just before each store write."""
        if self.client is not None and time.time() > self.client:
            raise TooLate(f"the client's X-Request-Deadline passed "
                          f"{time.time() - self.client:.1f} s ago; nothing written")
        held = time.monotonic() - self.received
        if held > self.bound:
            raise TooLate(f"the request arrived {held:.1f} s ago, more than "
                          f"LLMGW_ADMIN_WRITE_DEADLINE ({self.bound:g} s); nothing written")


def no_deadline() -> Deadline:
    """A deadline that never passes (writes made outside a request)."""
    return Deadline(time.monotonic(), float("inf"))
