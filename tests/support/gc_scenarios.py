"""Scenarios of app/gateway/gc_keeper.py run in a process of their own
(freezing and collecting act on the whole interpreter), each printing one
JSON line for tests/test_gc_keeper.py.

    python -m tests.support.gc_scenarios churn plain|keep
    python -m tests.support.gc_scenarios leak
    python -m tests.support.gc_scenarios transient
    python -m tests.support.gc_scenarios middle
"""

from __future__ import annotations

import gc
import json
import sys
import weakref

from app.gateway.gc_keeper import GcKeeper, thresholds

MIRROR = 20_000  # values, two tracked objects each


class Value:
    """A parsed mirror value: an object holding a list, both tracked."""

    def __init__(self, n: int) -> None:
        self.gpus = [n]


def churn(keep: bool) -> dict[str, object]:
    """A mirror frozen once loaded, then every value replaced three times
    over while requests come and go: how many objects a full collection
    would walk (those not frozen), at most, measured before each step."""
    gc.set_threshold(*thresholds(7000))
    mirror = {i: Value(i) for i in range(MIRROR)}
    keeper = GcKeeper()
    keeper.freeze_all()
    walked = 0
    for round_ in range(3 * MIRROR // 500):
        for i in range(500):
            key = (round_ * 500 + i) % MIRROR
            mirror[key] = Value(key)  # the old one, frozen, is freed all the same
        # A loaded gateway's requests in flight, aging into the oldest
        # generation through the collector's own collections, as under load.
        inflight = [[[] for _ in range(100)] for _ in range(2000)]
        del inflight
        walked = max(walked, len(gc.get_objects()))
        if keep:
            keeper.step()
    full = gc.get_stats()[2]["collections"]
    return {"walked_max": walked, "mirror_objects": 2 * MIRROR, "full_collections": full,
            "freezes": keeper.freezes, "reclaims": keeper.reclaims}


class Node:
    def __init__(self) -> None:
        self.other: Node | None = None


def leak() -> dict[str, object]:
    """A cycle frozen while alive, then dropped: kept until the frozen
    objects grow by a quarter; then everything unfrozen, and reclaimed by the
    next full collection, not by one of the keeper's own."""
    keeper = GcKeeper()
    keeper.freeze_all()
    steps = [keeper.step()]  # nothing happened: nothing to do
    a, b = Node(), Node()
    a.other, b.other = b, a
    alive = weakref.ref(a)
    gc.collect()  # a full collection: the keeper freezes what survived it
    steps.append(keeper.step())
    del a, b
    gc.collect()
    steps.append(keeper.step())  # the frozen cycle is garbage: kept, not yet past the bound
    kept_while_frozen = alive() is not None
    grown = [[i] for i in range(keeper.baseline)]  # the frozen objects to grow by half
    gc.collect()
    steps.append(keeper.step())  # frozen: past the bound, but maybe only for the moment
    gc.collect()
    fulls = gc.get_stats()[2]["collections"]
    steps.append(keeper.step())  # still held at the next: unfrozen, the next full collection's
    collected_by_the_step = gc.get_stats()[2]["collections"] - fulls
    kept_until_the_next = alive() is not None
    unfrozen = gc.get_freeze_count()
    steps.append(keeper.step())  # no full collection since: nothing
    gc.collect()  # the next full collection: the reclaim
    steps.append(keeper.step())  # the survivors frozen again
    steps.append(keeper.step())
    still_frozen = gc.get_freeze_count() >= len(grown)
    # The heap shrinks (a fleet's nodes gone): the bound follows it down.
    before = keeper.baseline
    del grown
    gc.collect()
    steps.append(keeper.step())
    return {"steps": steps, "kept_while_frozen": kept_while_frozen,
            "collected_by_the_step": collected_by_the_step,
            "kept_until_the_next": kept_until_the_next, "unfrozen": unfrozen,
            "reclaimed": alive() is None, "reclaims": keeper.reclaims,
            "still_frozen": still_frozen, "baseline_before_shrink": before,
            "baseline_after_shrink": keeper.baseline}


def transient() -> dict[str, object]:
    """Streams open by the thousand when a full collection comes: frozen
    with its survivors, and freed as they end. What counts against the
    bound is what is still frozen at the next full collection: the heap is
    not unfrozen for objects already gone."""
    keeper = GcKeeper()
    keeper.freeze_all()
    baseline = keeper.baseline
    streams = [[[] for _ in range(50)] for _ in range(baseline // 50)]  # as many again
    gc.collect()
    steps = [keeper.step()]  # frozen with the rest
    frozen_with_streams = gc.get_freeze_count()
    del streams  # they end: frozen objects are freed with their last reference
    unfrozen_ever = gc.get_freeze_count() < baseline
    gc.collect()
    steps.append(keeper.step())
    return {"steps": steps, "baseline": baseline, "frozen_with_streams": frozen_with_streams,
            "frozen_after": gc.get_freeze_count(), "unfrozen_ever": unfrozen_ever,
            "reclaims": keeper.reclaims, "frozen_metric": keeper.frozen}


def middle() -> dict[str, object]:
    """Streams starting by the thousand, each keeping 100 objects as long as
    it lives: how many objects each collection of the middle generation
    walked, and how many young and full collections came meanwhile."""
    walked: list[int] = []

    def seen(phase: str, info: dict[str, int]) -> None:
        if phase == "start" and info["generation"] == 1:
            walked.append(len(gc.get_objects(0)) + len(gc.get_objects(1)))

    gc.collect()
    gc.freeze()
    before = [s["collections"] for s in gc.get_stats()]
    gc.set_threshold(*thresholds(7000))
    gc.callbacks.append(seen)
    streams = [[[] for _ in range(100)] for _ in range(3000)]
    gc.callbacks.remove(seen)
    after = [s["collections"] for s in gc.get_stats()]
    return {"streams": len(streams), "middles": len(walked), "walked_max": max(walked),
            "young": after[0] - before[0], "fulls": after[2] - before[2]}


if __name__ == "__main__":
    what = sys.argv[1]
    out = (churn(sys.argv[2] == "keep") if what == "churn" else leak() if what == "leak"
           else transient() if what == "transient" else middle())
    print(json.dumps(out))
