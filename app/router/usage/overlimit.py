"""A key's refusal, and one gateway's equal share of a limit: shared by the
per-minute limits (limits.py) and the external budget (budget.py)."""

from __future__ import annotations

import math


def share(limit: int | None, gateways: int) -> int | None:
    """One gateway's share of `limit` among `gateways`: rounded up, so that a
    key stays usable on every gateway (a share of 0 would refuse it for
    ever), at the cost of at most `gateways - 1` over the limit in all."""
    if limit is None:
        return None
    return -(-limit // max(gateways, 1))


class OverLimit(Exception):
    """The key is over one of its limits: a 429 with Retry-After."""

    def __init__(self, kind: str, message: str, retry_after: float, limit: str = "",
                 short: bool = False, code: str = "rate_limit_exceeded") -> None:
        super().__init__(message)
        self.short = short  # refused on a part below the key's limit
        # The other limits this request was refused on below the key's
        # limit: raised by the same step (app/router/usage/limits.py).
        self.also: tuple[str, ...] = ()
        self.kind = kind  # "requests" or "tokens", OpenAI's error type
        self.limit = limit  # the limit's name: requests_per_minute, ...
        self.code = code  # OpenAI's error code
        self.message = message
        # Whole seconds, at least 1: what HTTP's Retry-After can say.
        self.retry_after = max(1, math.ceil(retry_after))
