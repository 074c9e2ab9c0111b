"""Load-based scaling between `replicas.min` and `replicas.max`
(docs/design/control-plane.md, "Scaling on load").

`desired()` is the rule: a model wants as many replicas as its engines' load
(running + waiting requests, summed over its replicas) needs at its
`load_target` per replica. Saturation overrides the target: an engine whose
queue has not drained for `saturated_after` seconds, or whose KV cache is
full that long, wants replicas for the whole load at the rate its engines
were seen running (`for_saturation()`). `Scaler.step()` turns that into the
count the plan places, one reconcile pass at a time on the leader's clock:
up at once, down one replica at a time and only once the lower count has
held for the whole window, never on a load it does not know nor while a
replica is saturated.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

from app.control import state as s
from app.control.plan.planner import wanted as floor_wanted
from app.control.usage import KV_FULL, Queue, replica_loads

logger = logging.getLogger(__name__)


# What llama-cpp-python's server (as the agent starts it, with
# --interrupt_requests False) runs at once: one request; the next ones wait.
LLAMACPP_TARGET = 1


def desired(load: float, target: int, floor: int, ceiling: int) -> int:
    """Replicas for `load` at `target` per replica, within [floor, ceiling]."""
    return max(floor, min(ceiling, math.ceil(load / target)))


def default_target(spec: s.StoredModel, replicas: Sequence[s.Replica], default: int) -> int:
    """The load target of a model whose spec sets none: one request for
    llama.cpp (its server runs one at a time), `default` (the setting) for
    vLLM, by the engine of its replicas (or, with none, of its first
    profile). A model running both engines gets the setting."""
    engines = {r.engine for r in replicas} or {p.engine for p in spec.profile_list[:1]}
    return LLAMACPP_TARGET if engines == {"llamacpp"} else default


def saturated(q: Queue | None) -> bool:
    """An engine with requests waiting, or a KV cache at its limit."""
    return q is not None and (q.waiting > 0 or q.kv >= KV_FULL)


def for_saturation(loads: Mapping[str, float], queues: Mapping[str, Queue],
                   full: Collection[str]) -> int:
    """Replicas for the whole known load (`loads`, over the model's
    replicas) at the rate its saturated engines (`full`) run: their running
    requests per replica, at least one. An engine full with nothing waiting
    counts one request more than it runs (it admits no more). Sized from
    the queue in one step: a queue of 20 behind engines running 4 each wants
    5 more replicas at once, not one per pass."""
    running = [max(0.0, loads.get(rid, 0.0) - queues[rid].waiting) for rid in full]
    rate = max(1.0, sum(running) / len(running))
    overflow = sum(1 for rid in full if queues[rid].waiting == 0)
    return math.ceil((sum(loads.values()) + overflow) / rate)


def wanted_now(model: s.StoredModel, replicas: Sequence[s.Replica],
               usages: Mapping[str, s.Usage], now: float, idle_slack: float,
               default: int) -> int:
    """The replicas `model` wants now, as the leader counts them before its
    scale-down window: its floor (`plan.wanted`: min, or one while a min-0
    model is in use), raised by its engines' load when every replica's load
    is known (`desired`). What `/admin/models` and `llmgw_replicas_wanted`
    show on every gateway; `replicas`: the model's, not draining."""
    last = max((u.last_used.get(model.name, 0.0) for u in usages.values()), default=0.0)
    wanted = floor_wanted(model, last or None, now, idle_slack)
    loads = replica_loads(usages, [r.id for r in replicas if r.engine == "llamacpp"])
    if wanted > 0 and replicas and all(r.id in loads for r in replicas):
        target = model.load_target or default_target(model, replicas, default)
        wanted = desired(sum(loads[r.id] for r in replicas), target, wanted,
                         max(wanted, model.replica_range.max))
    return wanted


class Scaler:
    """The leader's scaling state: per model, the count last decided and
    since when a lower one has held; per replica, since when its engine has
    been saturated. `step()` is one pass; `reset()` forgets everything (a
    new lead starts from the replicas it finds)."""

    def __init__(self, *, window: float, default_target: int,
                 saturated_after: float = 5.0) -> None:
        self.window = window
        self.default_target = default_target
        self.saturated_after = saturated_after
        self._held: dict[str, int] = {}
        self._low_since: dict[str, float] = {}
        self._full_since: dict[str, float] = {}

    def reset(self) -> None:
        self._held.clear()
        self._low_since.clear()
        self._full_since.clear()

    def next_due(self, now: float) -> float | None:
        """Seconds until a replica seen saturated has been so for
        `saturated_after` (the leader looks again then, not a reconcile
        interval later); None when none is on its way there."""
        due = [since + self.saturated_after - now for since in self._full_since.values()
               if since + self.saturated_after > now]
        return max(0.0, min(due)) if due else None

    def step(
        self,
        models: Mapping[str, s.StoredModel],
        replicas: Mapping[str, s.Replica],
        loads: Mapping[str, float],
        floors: Mapping[str, int],
        now: float,
        queues: Mapping[str, Queue] | None = None,
    ) -> dict[str, int]:
        """The replicas each scalable model should have now.

        `loads` (replica -> engine load, usage.replica_loads()) names only
        replicas some gateway polled recently: one left out is unknown.
        `queues` (usage.replica_queues()) the same polls' waiting requests
        and KV-cache use; one left out is unknown: not saturated now, but
        a saturation under way keeps its start (only a queue seen drained
        ends it). `floors` are plan.wanted()'s counts
        before scaling (`replicas.min`, or 0/1 for an idle-managed model). A
        model at floor 0 (idle) or whose range has no room above its floor
        is left out: nothing to scale. `now` is the leader's monotonic clock:
        how long an engine has been saturated is counted on it, from
        successive snapshots, never from other gateways' clocks.
        """
        queued = queues or {}
        out: dict[str, int] = {}
        serving: dict[str, list[str]] = {}
        for rid, r in replicas.items():
            if r.draining_since is None:
                serving.setdefault(r.model, []).append(rid)
        full_since: dict[str, float] = {}
        for name, spec in sorted(models.items()):
            floor, ceiling = floors.get(name, 0), spec.replica_range.max
            if spec.model is None or not spec.profile_list or floor == 0 or ceiling <= floor:
                continue  # forgotten below
            mine = serving.get(name, [])
            for rid in mine:
                if rid not in queued and rid in self._full_since:
                    # Unknown (a poll that timed out, often on a busy
                    # engine): neither a start nor an end.
                    full_since[rid] = self._full_since[rid]
            known = {rid: loads[rid] for rid in mine if rid in loads}
            target = spec.load_target or default_target(
                spec, [replicas[rid] for rid in mine], self.default_target)
            out[name] = self._held[name] = self._model_step(
                name, mine, _Load(known, queued, target, floor, ceiling), full_since, now)
        for gone in self._held.keys() - out.keys():
            del self._held[gone]
        for gone in self._low_since.keys() - out.keys():
            del self._low_since[gone]
        # A queue seen drained starts over; a replica gone is forgotten.
        self._full_since = full_since
        return out

    def _model_step(self, name: str, mine: list[str], load: _Load,
                    full_since: dict[str, float], now: float) -> int:
        """One model's count this pass (`mine`: its replicas not draining),
        noting in `full_since` since when each of its saturated replicas is."""
        known, queued, target = load.known, load.queued, load.target
        floor, ceiling = load.floor, load.ceiling
        # A model first seen (or a new lead) keeps what runs: a
        # handover scales nothing down (DESIGN invariant 10).
        before = held = max(floor, min(ceiling, self._held.get(name, len(mine))))
        want = desired(sum(known.values()), target, floor, ceiling)
        full = [rid for rid in mine if saturated(queued.get(rid))]
        for rid in full:
            full_since[rid] = self._full_since.get(rid, now)
            if rid not in self._full_since:
                logger.debug("replica %s saturated: %.0f waiting, KV cache %.0f%%",
                             rid, queued[rid].waiting, 100 * queued[rid].kv)
        # Saturated for the whole delay: the queue is not a burst the
        # engine works off. Sized from the whole load at the rate the
        # saturated engines run; unknown loads (a replica loading) never
        # hold it back, and, it being a level, the count does not climb
        # pass after pass while the new replicas load.
        past = [rid for rid in full if now - full_since[rid] >= self.saturated_after]
        if past:
            want = max(want, min(ceiling, for_saturation(known, queued, past)))
        if want >= held:
            # Up at once: the known loads are a lower bound of the load.
            held = want
            self._low_since.pop(name, None)
        elif full:
            # A saturated replica is never a reason to go down: the
            # lower count does not hold while a queue waits.
            self._low_since.pop(name, None)
        elif mine and len(known) == len(mine):
            since = self._low_since.setdefault(name, now)
            if now - since >= self.window:
                # One fewer than what runs: a count held above it (no
                # room for the rest) would spend a window removing
                # nothing.
                held = max(want, min(held, len(mine)) - 1)
                # The next replica waits a window of its own: the load
                # of the one going moves to the others.
                self._low_since[name] = now
        # Else a load is unknown (a replica loading, an engine that did
        # not answer): hold, and step down only once every one is known.
        if held != before:
            why = (f"{len(past)} saturated for {self.saturated_after:g} s "
                   f"({sum(queued[rid].waiting for rid in past):.0f} waiting)"
                   if past and held > before else f"target {target} per replica")
            logger.info("scaling %s from %d to %d replicas: load %.0f on %d of %d "
                        "replicas, %s", name, before, held, sum(known.values()),
                        len(known), len(mine), why)
        return held


@dataclass(frozen=True)
class _Load:
    """What one model's step weighs: the known engine loads of its
    replicas, the polled queues, its target per replica, its range."""

    known: Mapping[str, float]
    queued: Mapping[str, Queue]
    target: int
    floor: int
    ceiling: int
