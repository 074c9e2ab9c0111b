"""A client key's external budget: tokens a day served by models' overflows
(spill-over, docs/design/catalog.md and docs/design/client-keys.md).

An answer's tokens are known only when it ends, so each spill *reserves*
the most it can cost (`estimates.reservation`: its prompt's bound and its
`max_tokens`, or its overflow's default) when admitted, and is *settled* to
what its answer reported when it ends (nothing for one that failed). A spill
is admitted while this gateway's day window and the reservations in flight
are under its part of the limit, the parts moved between gateways by the
claims loop (app/gateway/key_shares.py, kind `external_tokens_per_day`),
which is told both as what this gateway holds. So however many spills
arrive at once, a gateway spends at most its part plus one reservation
(while each answer stays within its reservation). The window slides over
a day in one-minute buckets, so a key costs at most 1,440 entries however
many spills it makes.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Mapping

from app.router.usage.overlimit import OverLimit, share
from app.router.usage.shares import DEMAND_WINDOW, FLOOR, KINDS, KeyLoad, share_of

DAY = 86400.0
_BUCKET = 60.0  # seconds of charges summed in one entry of the window
KIND = KINDS[3]
# The OpenAI error code of a spill refused on the budget (a 429).
CODE = "external_budget_exceeded"
# Retry-After of that 429: the fleet may have room again well before the
# budget does, and a retry served locally costs the budget nothing.
RETRY_AFTER = 5


class _Day:
    __slots__ = ("buckets", "refused", "reserved", "total")

    def __init__(self) -> None:
        self.buckets: deque[list[float]] = deque()  # [bucket start, tokens]
        self.total = 0
        self.reserved = 0  # tokens reserved by this key's spills in flight here
        self.refused = float("-inf")  # when a spill was last refused on it

    def prune(self, now: float, window: float) -> None:
        while self.buckets and self.buckets[0][0] <= now - window:
            self.total -= int(self.buckets.popleft()[1])


class ExternalBudget:
    """This gateway's day windows of external tokens, by key id.

    `claims_of(key)` is the limiter's claims on a key (None: no claims loop,
    equal shares); `on_short()` gives the loop's wake-up, called when a spill
    is refused below the key's limit; `floor()`, what this gateway spends of
    a key on no claim: the limiter's (a worker of a gateway of several: 0
    while its claims stand, so that N counts gateways; usage/limits.py)."""

    def __init__(self, clock: Callable[[], float],
                 claims_of: Callable[[str], Mapping[str, int] | None],
                 on_short: Callable[[], Callable[[], None] | None],
                 floor: Callable[[], int] = lambda: FLOOR,
                 window: float = DAY) -> None:
        self._clock = clock
        self._claims_of = claims_of
        self._on_short = on_short
        self._floor = floor
        self._window = window
        self._keys: dict[str, _Day] = {}

    def used(self, key_id: str) -> int:
        day = self._keys.get(key_id)
        if day is None:
            return 0
        day.prune(self._clock(), self._window)
        return day.total

    def reserved(self, key_id: str) -> int:
        day = self._keys.get(key_id)
        return day.reserved if day is not None else 0

    def reserve(self, key_id: str, limit: int | None, gateways: int, model: str,
                target: str, tokens: int) -> int:
        """Reserves `tokens` of `key_id`'s budget for one spill of `model`'s
        request to `target`: returns what was reserved, to `settle` when it
        ends (0 for a key without the limit: nothing to bound); OverLimit
        (code `external_budget_exceeded`) when this gateway's part is spent,
        its window's tokens and the reservations in flight together."""
        if limit is None:
            return 0
        claims = self._claims_of(key_id)
        part = (share(limit, gateways) if claims is None or gateways <= 1
                else min(limit, share_of(claims.get(KIND), self._floor())))
        assert part is not None
        now = self._clock()
        used = self.used(key_id)
        day = self._keys.setdefault(key_id, _Day())
        if used + day.reserved < part:
            day.reserved += tokens
            return tokens
        day.refused = now
        of = "" if part >= limit else f", {part} held by this gateway now"
        short = part < limit
        if short and (wake := self._on_short()) is not None:
            wake()
        raise OverLimit("tokens", (
            f"'{model}' has no room in the fleet now and this key's budget for its overflow "
            f"'{target}' is spent: external_tokens_per_day {limit}{of}, used {used} and "
            f"{day.reserved} reserved for answers in flight here. Please try again later."),
            1 if short else RETRY_AFTER, KIND, short, CODE)

    def settle(self, key_id: str, reserved: int, tokens: int) -> None:
        """A spill has ended: its reservation given back, the `tokens` its
        answer reported (or its estimate) charged."""
        if reserved:
            day = self._keys.get(key_id)
            if day is not None:
                day.reserved = max(0, day.reserved - reserved)
        if tokens:
            self.charge(key_id, tokens)

    def charge(self, key_id: str, tokens: int) -> None:
        now = self._clock()
        day = self._keys.setdefault(key_id, _Day())
        day.prune(now, self._window)
        start = now - now % _BUCKET
        if day.buckets and day.buckets[-1][0] == start:
            day.buckets[-1][1] += tokens
        else:
            day.buckets.append([start, tokens])
        day.total += tokens

    def loads(self) -> dict[str, KeyLoad]:
        """What this gateway holds of each key's budget (for the claims loop);
        keys with nothing in their window or in flight are forgotten."""
        now = self._clock()
        out: dict[str, KeyLoad] = {}
        for key_id, day in list(self._keys.items()):
            day.prune(now, self._window)
            recent = day.refused > now - DEMAND_WINDOW
            if not day.buckets and not day.reserved and not recent:
                del self._keys[key_id]
                continue
            # What it holds: spent in the window, and reserved by spills in flight.
            out[key_id] = KeyLoad({KIND: day.total + day.reserved}, 0,
                                  frozenset({KIND}) if recent else frozenset())
        return out
