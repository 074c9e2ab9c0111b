"""Keeps CPython's full collections from walking the mirror
(docs/design/hot-path.md, "The garbage collector").

A gateway's heap is mostly its mirror: at 10,000 nodes about 415,000
objects the collector tracks, and a full collection of them holds the
process, every request and stream with it, for about 270 ms. Start-up
freezes the mirror's first load out of collections, but the mirror does not
stay as loaded: each status report, inventory or catalog edit replaces its
parsed value. Within minutes at fleet scale most of the mirror is new
objects again, and CPython runs a full collection whenever its survivors
grew by a quarter since the last: a 270 ms stall every few tens of seconds.

The keeper freezes again after each full collection (what survived it is,
like the first load, what the gateway keeps), so that the next walks only
what is new since. Freezing is not collecting: a frozen object is still
freed when its last reference goes (a replaced mirror value is), but a
frozen cycle that becomes garbage later is not, until unfrozen. So when the
frozen objects have grown by `growth` (a quarter: CPython's own rule for
its oldest generation) since the last reclaim, the keeper unfreezes them
all, and the next full collection CPython runs walks the whole heap once:
that is the reclaim, and the step after it freezes the survivors. What
leaks while frozen stays bounded by that share, and a fleet that does not
grow is walked whole only that rarely. The reclaim is not a collection of
its own right behind the full collection that found it due (with 4,096
streams open, that pair held the loop 426 ms in one go): the next full
collection comes when CPython's own rule brings it, the survivors of the
last having grown by a quarter.

What counts as grown is what a freeze froze and still holds at the next
full collection, counted before that one's survivors are frozen: a freeze
also takes every object in flight, and thousands of streams open at a full
collection are freed within seconds as they end (a frozen object still goes
with its last reference). Counted just after the freeze, the streams of
bench/streams.py's 2,048 took the frozen objects past the bound by
themselves, and the whole heap was unfrozen for objects gone moments later.
A leaked cycle, or a fleet grown, is still there at the next collection.

`step()` is the one-step method; `run()` calls it every `every` s on the
event loop. Whether a full collection ended since is read from the
collector's own count of them (`gc.get_stats()`): a collection may run in
any thread, and freezing waits for the loop's step.
"""

from __future__ import annotations

import asyncio
import gc
import logging
from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

logger = logging.getLogger(__name__)


# The collector's second and third thresholds. CPython collects the middle
# generation once more young collections than the second came since its
# last (its default 10: at the 11th), and the oldest once more middle ones
# than the third (10: at the 121st young one). Each object that outlives a
# young collection is walked once in a middle one either way; but with 1 a
# middle collection walks what two young ones left, not eleven: with
# thousands of streams starting, each keeping some 100 objects as long as it
# lives, a middle collection held the loop 14-20 ms with 10. A full
# collection comes at the 122nd young one, as rare as before.
MIDDLE_THRESHOLD = 1
OLDEST_THRESHOLD = 60


def thresholds(first: int) -> tuple[int, int, int]:
    """The collector's thresholds for a gateway whose first is `first`
    (`LLMGW_GC_THRESHOLD`)."""
    return first, MIDDLE_THRESHOLD, OLDEST_THRESHOLD


def _full_collections() -> int:
    return int(gc.get_stats()[2]["collections"])


class GcKeeper(Collector):
    """`freeze_all()` once start-up or the mirror's first load is built;
    `step()` / `run()` as above."""

    def __init__(self, growth: float = 0.25, every: float = 1.0) -> None:
        self.growth, self.every = growth, every
        self.baseline = gc.get_freeze_count()  # frozen after the last reclaim
        self.frozen = self.baseline  # frozen after the last freeze
        self.freezes = 0
        self.reclaims = 0
        self.due = False  # unfrozen: the next full collection is a reclaim
        self._fulls = _full_collections()  # full collections seen so far

    def freeze_all(self) -> None:
        """A collection, then everything alive frozen: start-up's objects,
        the mirror's first load. The frozen count from here is the bound's
        base."""
        gc.collect()
        gc.freeze()
        self.baseline = self.frozen = gc.get_freeze_count()
        self._fulls = _full_collections()
        self.due = False  # a reclaim due was this collection: nothing was frozen

    def step(self) -> str | None:
        """After a full collection: freezes what survived it, and says what
        it did: "freeze"; "due" when what earlier freezes froze and still
        holds is past the bound, so everything is unfrozen, the next full
        collection to walk it all; "reclaim" when that collection came; None
        when no full collection ended since the last step. Counting the
        frozen objects walks them (~3 ms at 400,000), so it is done only
        here, before the freeze and after."""
        fulls = _full_collections()
        if fulls == self._fulls:
            return None
        self._fulls = fulls
        if not self.due:
            held = gc.get_freeze_count()  # what earlier freezes froze, still alive
            if self.baseline and held > self.baseline * (1 + self.growth):
                gc.unfreeze()
                self.due = True
                self.frozen = 0
                return "due"
        gc.freeze()
        frozen = gc.get_freeze_count()
        if self.due:  # that collection walked the whole heap: the reclaim
            self.due = False
            self.reclaims += 1
            logger.info("reclaimed the frozen objects: %d frozen, %d after the last reclaim",
                        frozen, self.baseline)
            self.baseline = self.frozen = frozen
            return "reclaim"
        if not self.baseline or frozen < self.baseline:
            self.baseline = frozen  # the heap shrank (nodes gone): the bound follows
        self.frozen = frozen
        self.freezes += 1
        return "freeze"

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.every)
            self.step()

    def collect(self) -> Iterator[Metric]:
        yield GaugeMetricFamily(
            "llmgw_gc_frozen_objects",
            "Objects of this process frozen out of garbage collections (start-up's, the "
            "mirror's, what survived the last full collection); 0 while a reclaim is due",
            value=self.frozen)
        yield CounterMetricFamily(
            "llmgw_gc_reclaims",
            "Full collections that walked this process's whole heap, unfrozen because the "
            "frozen objects had grown by a quarter since the last reclaim", value=self.reclaims)
