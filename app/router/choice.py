"""Which replica takes a request: a pure function of the candidates, their
load, and the request's affinity key (docs/design/routing.md, "Choosing a replica";
DESIGN invariant 7).

Three rules, in order:
1. Priority tiers: only the highest-priority replicas that are not
   saturated are candidates; a lower tier is used only when every higher one
   is down or saturated.
2. Prompt affinity, sticky until saturated: a request that carries an
   affinity key (a session id, or a hash of its first messages) goes to the
   replica the key hashes to on a ring (consistent hashing) for as long as
   that replica is not saturated; a saturated one is passed for the next on
   the ring that is not. Saturation is judged on figures every gateway reads
   alike (the engine's own queue and KV cache, see `saturated`), never on
   this gateway's in-flight count, so every gateway sends a conversation to
   the same replica, and the engine finds its prefix in its cache.
3. Otherwise, power of two choices: two replicas drawn by weight, the less
   loaded per unit of weight wins. Several gateways choosing this way do not
   stampede the replica that looked idlest a moment ago, as "least loaded"
   would.

Load is this gateway's in-flight requests and the engine's own counts
(vLLM's running and waiting requests and KV-cache use, polled about once a
second, see engine_load.py). A count older than `stale_after` is unknown,
never idle: an unknown replica is charged the highest known load of its
tier, so it is not preferred for having gone quiet. A count that said
saturated is held longer (`in_force`): a scrape is late when its engine is
busiest.
"""

from __future__ import annotations

import bisect
import hashlib
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

# A replica is saturated when this many requests wait in its engine, or its
# KV cache is this full: the engine admits nothing more, a new request only
# queues. Below it, a request is admitted within a scheduler step, so a
# conversation gains its cached prefix by staying however busy the replica
# is. Lower would make a scrape's passing burst (a request waits one step,
# tens of ms, before it runs) move conversations; higher would queue them
# behind a full batch rather than prefill them elsewhere.
SATURATED_WAITING = 8
SATURATED_KV = 0.98
# A one-at-a-time engine without figures (llama-cpp-python's server) is
# saturated at this many requests in flight over all gateways: one running,
# two waiting. Each waiting request costs a whole request's time (seconds
# on a CPU), about what prefilling the conversation elsewhere costs.
SERIAL_SATURATED = 3
# Points per replica on the affinity ring: more spreads keys more evenly
# over replicas (each replica owns many small arcs) for a little memory.
RING_POINTS = 64
# A saturated figure stays in force this many staleness bounds after its
# read, unless a newer figure replaces it: a scrape comes late exactly when
# its engine is busiest (its server has a full batch to feed), and a full
# engine forgotten would take conversations back into its queue, behind a
# whole batch. Held wrongly, a conversation loses its cached prefix for a
# few seconds; forgotten wrongly, it waits for a batch to finish.
SATURATED_HOLD = 4


class EngineLoad(NamedTuple):
    """An engine's own counts, as last scraped from its /metrics (a named
    tuple, made per replica at each poll: see app/wire/loads.py's Counts)."""

    running: float
    waiting: float
    kv_cache: float  # 0..1
    at: float  # monotonic time of the scrape


@dataclass(frozen=True, slots=True)
class Candidate:
    replica_id: str
    priority: int = 0
    weight: float = 1.0
    # Serves one request at a time and reports no load figures (llama.cpp):
    # its queue is the requests in flight on it over every gateway.
    serial: bool = False


@dataclass(frozen=True, slots=True)
class Choice:
    replica_id: str
    # "affinity" (the key's replica), "affinity-next" (the next on the ring
    # not saturated), "p2c", "only" (one candidate), "fallback" (every tier
    # saturated).
    why: str


def cost(inflight: int, load: EngineLoad | None) -> float:
    """Requests in front of a new one. The engine's running count includes
    ours (and other gateways'), but lags by up to one scrape: take the larger.
    Waiting requests count twice: they have not started generating."""
    if load is None:
        return float(inflight)
    return max(float(inflight), load.running) + 2.0 * load.waiting


def fresh(load: EngineLoad | None, now: float, stale_after: float) -> EngineLoad | None:
    return load if load is not None and now - load.at <= stale_after else None


def in_force(load: EngineLoad | None, now: float, stale_after: float) -> EngineLoad | None:
    """The figure a choice goes by: a fresh one, or a saturated one up to
    `SATURATED_HOLD` staleness bounds old (a late scrape does not make a
    full engine look free); None (unknown) otherwise."""
    if load is None:
        return None
    age = now - load.at
    if age <= stale_after or (age <= SATURATED_HOLD * stale_after and saturated(load)):
        return load
    return None


def saturated(load: EngineLoad | None, *, serial: bool = False, queued: int = 0) -> bool:
    """Whether a replica admits no more work. On the engine's own figures,
    which every gateway scrapes alike; a serial engine (no figures) on the
    requests `queued` on it over every gateway. An unknown load (a stale or
    failed scrape) is not saturated: a gateway that cannot see a replica's
    figures keeps its conversations there, as the others do until they see
    it full; a full one seen lately is still full (`in_force`)."""
    if serial:
        return queued >= SERIAL_SATURATED
    return load is not None and (load.waiting >= SATURATED_WAITING
                                 or load.kv_cache >= SATURATED_KV)


def full(c: Candidate, loads: Mapping[str, EngineLoad | None],
         queued: Mapping[str, int]) -> bool:
    return saturated(loads.get(c.replica_id), serial=c.serial,
                     queued=queued.get(c.replica_id, 0))


def costs(
    candidates: Sequence[Candidate],
    inflight: Mapping[str, int],
    loads: Mapping[str, EngineLoad | None],
) -> dict[str, float]:
    """Each candidate's cost; an unknown engine load is charged the highest
    known cost among the candidates (unknown is not idle)."""
    known = {c.replica_id: cost(inflight.get(c.replica_id, 0), loads.get(c.replica_id))
             for c in candidates if loads.get(c.replica_id) is not None}
    worst = max(known.values(), default=0.0)
    return {c.replica_id: known.get(c.replica_id,
                                    max(worst, float(inflight.get(c.replica_id, 0))))
            for c in candidates}


def tier(candidates: Sequence[Candidate], loads: Mapping[str, EngineLoad | None],
         queued: Mapping[str, int] | None = None) -> tuple[list[Candidate], bool]:
    """The highest-priority candidates with one not saturated, those not
    saturated; (all, True) when every tier is saturated."""
    q = queued or {}
    for prio in sorted({c.priority for c in candidates}, reverse=True):
        level = [c for c in candidates if c.priority == prio]
        room = [c for c in level if not full(c, loads, q)]
        if room:
            return room, False
    return list(candidates), True


def _point(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")


def ring_order(replicas: Sequence[str], key: str) -> list[str]:
    """The replicas in the order a walk around the ring from `key` meets them."""
    points = sorted((_point(f"{r}#{i}"), r) for r in replicas for i in range(RING_POINTS))
    start = bisect.bisect(points, (_point(key), ""))
    order: list[str] = []
    for i in range(len(points)):
        r = points[(start + i) % len(points)][1]
        if r not in order:
            order.append(r)
            if len(order) == len(replicas):
                break
    return order


def choose(
    candidates: Sequence[Candidate],
    inflight: Mapping[str, int],
    loads: Mapping[str, EngineLoad | None],
    *,
    affinity: str | None = None,
    queued: Mapping[str, int] | None = None,
    rand: Callable[[], float] = random.random,
) -> Choice | None:
    """Picks one of `candidates` (ready, not cooled down, not yet tried).
    `loads` must hold only the figures in force (see `in_force`); `inflight` is this
    gateway's requests in flight, `queued` every gateway's as far as this
    one knows (for serial engines; default `inflight`)."""
    if not candidates:
        return None
    q = inflight if queued is None else queued
    level, all_saturated = tier(candidates, loads, q)
    if affinity is not None:
        # The ring is the top tier's, saturated replicas included, so a
        # replica filling up moves only its own keys, to where every gateway
        # walking the same ring with the same figures moves them.
        prio = max(c.priority for c in level)
        ring = [c.replica_id for c in candidates if c.priority == prio]
        room = {c.replica_id for c in level}
        order = ring_order(ring, affinity)
        for i, rid in enumerate(order):
            if rid in room:
                why = "fallback" if all_saturated else "affinity" if i == 0 else "affinity-next"
                return Choice(rid, why)
    if len(level) == 1:
        return Choice(level[0].replica_id, "fallback" if all_saturated else "only")
    c = costs(level, inflight, loads)
    a = _draw(level, rand)
    b = _draw([x for x in level if x is not a], rand)
    # A tie goes to the first drawn: idle replicas share the requests.
    best = b if c[b.replica_id] / b.weight < c[a.replica_id] / a.weight else a
    return Choice(best.replica_id, "fallback" if all_saturated else "p2c")


def _draw(level: Sequence[Candidate], rand: Callable[[], float]) -> Candidate:
    """One candidate, with probability proportional to its weight."""
    total = sum(x.weight for x in level)
    point = rand() * total
    for x in level:
        point -= x.weight
        if point < 0:
            return x
    return level[-1]


def affinity_key(body: Mapping[str, object], session: str | None) -> str | None:
    """What ties a request to the replica that has its prefix cached: a
    client's session id, else the chat's messages up to its first user turn
    (which every later turn of the conversation repeats), else the start of
    a long completion prompt. None: no affinity."""
    if session:
        return "s:" + session
    messages = body.get("messages")
    if isinstance(messages, list) and messages:
        # Up to the first user turn: what every later turn of the chat repeats.
        end = next((i for i, m in enumerate(messages)
                    if isinstance(m, dict) and m.get("role") == "user"), 0)
        head = repr(messages[: end + 1]).encode()
        return "m:" + hashlib.blake2b(head, digest_size=16).hexdigest()
    prompt = body.get("prompt")
    if isinstance(prompt, str) and len(prompt) >= 64:
        return "p:" + hashlib.blake2b(prompt[:1024].encode(), digest_size=16).hexdigest()
    return None


def ring_shares(replicas: Sequence[str]) -> dict[str, float]:
    """The fraction of affinity keys each replica owns on the ring (before
    saturation moves any): what `explain` reports as affinity share."""
    if not replicas:
        return {}
    points = sorted((_point(f"{r}#{i}"), r) for r in replicas for i in range(RING_POINTS))
    span = 2.0 ** 64
    shares = dict.fromkeys(replicas, 0.0)
    for i, (p, r) in enumerate(points):
        # A key maps to the first point at or after it: point i owns the arc
        # from the previous point (exclusive) up to itself.
        prev = points[i - 1][0] if i else points[-1][0] - int(span)
        shares[r] += (p - prev) / span
    return shares
