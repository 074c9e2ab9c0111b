"""Load-based scaling between `replicas.min` and `replicas.max`
(docs/architecture.md, Reconciler: scaling).

`desired()` is the rule: a model wants as many replicas as its engines' load
(running + waiting requests, summed over its replicas) needs at its
`load_target` per replica. `Scaler.step()` turns that into the count the
plan places, one reconcile pass at a time on the leader's clock: up at once,
down one replica at a time and only once the lower count has held for the
whole window, never on a load it does not know.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence

from app.control import state as s
from app.control.plan import wanted as floor_wanted
from app.control.usage import replica_loads

logger = logging.getLogger(__name__)


def desired(load: float, target: int, floor: int, ceiling: int) -> int:
    """Replicas for `load` at `target` per replica, within [floor, ceiling]."""
    return max(floor, min(ceiling, math.ceil(load / target)))


def wanted_now(model: s.StoredModel, replicas: Sequence[s.Replica],
               usages: Mapping[str, s.Usage], now: float, idle_slack: float,
               default_target: int) -> int:
    """The replicas `model` wants now, as the leader counts them before its
    scale-down window: its floor (`plan.wanted`: min, or one while a min-0
    model is in use), raised by its engines' load when every replica's load
    is known (`desired`). What `/admin/models` and `llmgw_replicas_wanted`
    show on every gateway; `replicas`: the model's, not draining."""
    last = max((u.last_used.get(model.name, 0.0) for u in usages.values()), default=0.0)
    wanted = floor_wanted(model, last or None, now, idle_slack)
    loads = replica_loads(usages, [r.id for r in replicas if r.engine == "llamacpp"])
    if wanted > 0 and replicas and all(r.id in loads for r in replicas):
        wanted = desired(sum(loads[r.id] for r in replicas),
                         model.load_target or default_target, wanted,
                         max(wanted, model.replica_range.max))
    return wanted


class Scaler:
    """The leader's scaling state: per model, the count last decided and
    since when a lower one has held. `step()` is one pass; `reset()` forgets
    everything (a new lead starts from the replicas it finds)."""

    def __init__(self, *, window: float, default_target: int) -> None:
        self.window = window
        self.default_target = default_target
        self._held: dict[str, int] = {}
        self._low_since: dict[str, float] = {}

    def reset(self) -> None:
        self._held.clear()
        self._low_since.clear()

    def step(
        self,
        models: Mapping[str, s.StoredModel],
        replicas: Mapping[str, s.Replica],
        loads: Mapping[str, float],
        floors: Mapping[str, int],
        now: float,
    ) -> dict[str, int]:
        """The replicas each scalable model should have now.

        `loads` (replica -> engine load, usage.replica_loads()) names only
        replicas some gateway polled recently: one left out is unknown.
        `floors` are plan.wanted()'s counts before scaling (`replicas.min`,
        or 0/1 for an idle-managed model). A model at floor 0 (idle) or
        whose range has no room above its floor is left out: nothing to
        scale. `now` is the leader's monotonic clock.
        """
        out: dict[str, int] = {}
        serving: dict[str, list[str]] = {}
        for rid, r in replicas.items():
            if r.draining_since is None:
                serving.setdefault(r.model, []).append(rid)
        for name, spec in sorted(models.items()):
            floor, ceiling = floors.get(name, 0), spec.replica_range.max
            if spec.model is None or not spec.profile_list or floor == 0 or ceiling <= floor:
                continue  # forgotten below
            mine = serving.get(name, [])
            # A model first seen (or a new lead) keeps what runs: a
            # handover scales nothing down (DESIGN invariant 10).
            before = held = max(floor, min(ceiling, self._held.get(name, len(mine))))
            known = [loads[rid] for rid in mine if rid in loads]
            target = spec.load_target or self.default_target
            want = desired(sum(known), target, floor, ceiling)
            if want >= held:
                # Up at once: the known loads are a lower bound of the load.
                held = want
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
                logger.info("scaling %s from %d to %d replicas: load %.0f on %d of %d "
                            "replicas, target %d per replica", name, before, held,
                            sum(known), len(known), len(mine), target)
            self._held[name] = held
            out[name] = held
        for gone in self._held.keys() - out.keys():
            del self._held[gone]
        for gone in self._low_since.keys() - out.keys():
            del self._low_since[gone]
        return out
