"""When an admin write may be applied, as the request says it: its
preconditions (`If-Match`, `If-None-Match: *` against a record's ETag) and
deadlines (the client's `X-Request-Deadline`, and LLMGW_ADMIN_WRITE_DEADLINE
counted from when the request arrived), read off the headers into the
control plane's plain values (app/control/ops/conditions.py, where they are
checked). See docs/design/admin-writes.md, "Catalog writes".
"""

from __future__ import annotations

import math
import time

from fastapi import Request

from app.api.errors import Problem
from app.control.ops.conditions import Deadline, Precondition, etag

__all__ = ["DEADLINE_HEADER", "RECEIVED", "deadline", "etag", "precondition"]

# The ASGI scope key GatewayApp stamps with time.monotonic() as a request
# enters the app (app/gateway/main.py), before its body is read.
RECEIVED = "llmgw.received"
DEADLINE_HEADER = "x-request-deadline"


def _tags(raw: str, header: str) -> list[str]:
    tags = [t.strip() for t in raw.split(",") if t.strip()]
    for t in tags:
        bare = t[2:] if t.startswith("W/") else t
        if t != "*" and not (len(bare) >= 2 and bare[0] == bare[-1] == '"'):
            raise Problem(400, f"Invalid {header}",
                          f"{header} takes '*' or quoted ETags (\"123\"), not {t[:40]!r}")
    return tags


def precondition(request: Request) -> Precondition:
    """The request's If-Match / If-None-Match (400 when malformed)."""
    m = request.headers.get("if-match")
    n = request.headers.get("if-none-match")
    return Precondition(tuple(_tags(m, "If-Match")) if m is not None else None,
                        tuple(_tags(n, "If-None-Match")) if n is not None else None)


def deadline(request: Request, bound: float) -> Deadline:
    """When a write made for `request` is too late (400 when the client's
    X-Request-Deadline is not a Unix time)."""
    received = float(request.scope.get(RECEIVED, time.monotonic()))
    raw = request.headers.get(DEADLINE_HEADER)
    client: float | None = None
    if raw is not None:
        try:
            client = float(raw)
        except ValueError:
            client = math.nan
        if not math.isfinite(client):
            raise Problem(400, "Invalid X-Request-Deadline",
                          "X-Request-Deadline takes a Unix time in seconds "
                          f"(1764600000.5), not {raw[:40]!r}")
    return Deadline(received, bound, client)
