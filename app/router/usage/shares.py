"""Each gateway's part of a client key's limits: pure decisions, no I/O.

A key's limits are the key's, for all gateways together (docs/design/client-keys.md).
Each gateway holds a *claim* on each limit and admits while
what it holds (requests or tokens in its window, requests in flight) is under
`max(FLOOR, claim)`. The claims of all gateways together stay within the
limit, whatever the timing, because of how they move (app/gateway/key_shares.py):

* a claim is raised only out of what no other gateway claims, by a store
  transaction conditioned on every other gateway's record as read: two
  gateways never take the same free part, even from different snapshots;
* a claim is lowered locally first, then written, and never below what the
  gateway holds.

So for N gateways, the most admitted at once (concurrency) or within one
window (requests per minute) is the limit plus one FLOOR for each gateway
whose claim is 0: at most `L + N - 1`. The workers of one gateway
(`llmgw serve --workers`) each hold claims of their own but admit no floor
(`share_of(claim, 0)`): they add nothing past their claims, so N counts
gateways, not processes.

Where the claims go is `targets()`: the same deterministic function of the
published records on every gateway. Each gateway keeps what it holds; what
is left of the limit goes first to the requests waiting for a raise now
(`KeyLoad.waiting`: asked below the key's limit, refused by nothing but a
claim), then in proportion to the requests each was asked for lately
(`DEMAND_WINDOW`), evenly when none was. A client all on one gateway thus
gets the whole limit there; one spread evenly gets even parts; one that
moves takes the old gateway's part as that gateway's window drains (or its
requests end). A part idle on one gateway while another has requests
waiting goes to the waiting ones: refused only when the key, as the
records say, is at its limit.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

# The part a gateway admits with no claim: one request (or, for tokens, a
# request while it has charged none), so a client's first request on a
# gateway is served while the claims move. Larger: more over the limit
# (N x FLOOR in all), fewer refusals while a client's claim is raised.
FLOOR = 1
# Seconds over which a gateway's recent demand (requests asked) is counted.
# Shorter: claims follow a moving client sooner, but a client pausing for
# that long loses its weight in the split.
DEMAND_WINDOW = 5.0
KINDS = ("requests_per_minute", "tokens_per_minute", "concurrent_requests",
         "external_tokens_per_day")


@dataclass(frozen=True, slots=True)
class KeyLoad:
    """What one gateway holds of one key now, and what it was asked lately."""

    used: Mapping[str, int]  # by limit name: requests / tokens in the window, in flight
    asked: int = 0  # requests asked for (admitted or refused) in DEMAND_WINDOW
    refused: frozenset[str] = field(default_factory=frozenset)  # limits refused on, lately
    # Requests waiting now for this gateway's claim to be raised, by the
    # limit they wait on (app/router/usage/limits.py, `Limiter.admit_or_wait`).
    waiting: Mapping[str, int] = field(default_factory=dict)


def split(total: int, gateways: Sequence[str], weights: Mapping[str, int]) -> dict[str, int]:
    """`total` split among `gateways` in proportion to `weights` (evenly when
    all are 0), in whole units by largest remainder, ties to the earlier
    gateway in sorted order: every gateway computing this from the same
    inputs gets the same parts, and they sum to `total`."""
    order = sorted(gateways)
    if not order or total <= 0:
        return dict.fromkeys(order, 0)
    w = {g: max(0, weights.get(g, 0)) for g in order}
    if sum(w.values()) == 0:
        w = dict.fromkeys(order, 1)
    whole = sum(w.values())
    parts = {g: total * w[g] // whole for g in order}
    rest = total - sum(parts.values())
    by_remainder = sorted(order, key=lambda g: (-(total * w[g] % whole), order.index(g)))
    for g in by_remainder[:rest]:
        parts[g] += 1
    return parts


def targets(limit: int, gateways: Sequence[str], used: Mapping[str, int],
            asked: Mapping[str, int],
            waiting: Mapping[str, int] | None = None) -> dict[str, int]:
    """Where the claims on `limit` should be: each gateway keeps what it
    holds (`used`); the rest goes first to the requests waiting for a raise
    (`waiting`, split in proportion to them when they want more than is
    left), and what remains by recent demand (`asked`)."""
    free = max(0, limit - sum(max(0, used.get(g, 0)) for g in gateways))
    need = {g: max(0, (waiting or {}).get(g, 0)) for g in gateways}
    if sum(need.values()) >= free:
        parts = split(free, gateways, need)
    else:
        rest = split(free - sum(need.values()), gateways, asked)
        parts = {g: need[g] + rest[g] for g in gateways}
    return {g: max(0, used.get(g, 0)) + parts[g] for g in gateways}


def next_claim(current: int, target: int, used: int, room: int, refused_here: bool,
               refused_elsewhere: bool) -> int:
    """This gateway's next claim on one limit.

    `room` is the limit less every other gateway's claim: the most this
    claim may be raised to. It is raised (toward the target) only when this
    gateway refused a request on it lately, and lowered (to the target, never
    below what it holds) only when another gateway did: a steady pattern
    moves no claim and writes nothing."""
    if target > current and refused_here:
        return max(current, min(target, room))
    if target < current and refused_elsewhere:
        return max(used, target, 0)
    return current


def share_of(claim: int | None, floor: int = FLOOR) -> int:
    """What a gateway admits up to with this claim (None: no claim); `floor`,
    what it admits on none: FLOOR, or 0 for a worker of a gateway of several
    (app/gateway/key_shares.py, `claim_floors`)."""
    return max(floor, claim or 0)
