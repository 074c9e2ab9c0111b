"""How late the gateway's event loop runs, and how long the garbage collector
holds it (`GET /metrics`; docs/design/metrics.md).

Every request, chunk and timer of a gateway process waits on one event loop:
whatever holds it (a full collection walking the heap, a parse of a large
document, a blocking call that should have been in a thread) adds its time
to every request open then. A timer due every `every` seconds measures how
late it fires (`llmgw_event_loop_lag_seconds`), and the collector's own
callbacks time each collection (`llmgw_gc_pause_seconds`), so that a stall
can be told from load, and a stall from a collection from any other.

A stall of a second or more is also logged (once a minute at most), with
the longest collection since the last: it is what an operator sees in the
log when every client saw its stream hang.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client.core import HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from app.gateway.request_metrics import Histogram

logger = logging.getLogger(__name__)

# From about the timer's own resolution to what no client would sit through.
LAG_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
# A young collection takes microseconds, a full one of a large heap seconds.
GC_BUCKETS = (0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
              2.5)
GENERATIONS = (0, 1, 2)


class LoopLag(Collector):
    """`step(due, now)` records one tick; `run()` ticks every `every` s;
    `watch_gc()` / `unwatch_gc()` hook the collector's callbacks (a process
    holds one list of them, so a test's gateway must unhook)."""

    def __init__(self, every: float = 0.1, stall: float = 1.0, warn_every: float = 60.0,
                 clock: Callable[[], float] = time.monotonic,
                 timer: Callable[[], float] = time.perf_counter) -> None:
        self.every, self.stall, self.warn_every = every, stall, warn_every
        self._clock, self._timer = clock, timer
        self.lag = Histogram(LAG_BUCKETS)
        self.gc = {g: Histogram(GC_BUCKETS) for g in GENERATIONS}
        self.worst_gc = 0.0  # the longest collection since the last warning
        self._gc_began: float | None = None
        self._warned = float("-inf")

    def step(self, due: float, now: float) -> float:
        """Records how late a tick due at `due` ran at `now`; returns it."""
        lag = max(0.0, now - due)
        self.lag.observe(lag)
        if lag >= self.stall and now - self._warned >= self.warn_every:
            self._warned = now
            logger.warning("the event loop stalled %.2f s (the longest garbage collection "
                           "since the last such warning: %.3f s); every open request waited "
                           "as long", lag, self.worst_gc)
            self.worst_gc = 0.0
        return lag

    async def run(self) -> None:
        """Ticks until cancelled. Each tick is a plain timer callback that
        sets the next: no task step, future or running-loop lookup (which
        asks the kernel for the process id) per tick, as `asyncio.sleep` in
        a loop costs; ten a second on an idle gateway were a sixth of its
        loop's work (docs/design/hot-path.md, "An idle gateway")."""
        loop = asyncio.get_running_loop()
        handle: asyncio.TimerHandle

        def tick(due: float) -> None:
            nonlocal handle
            try:
                self.step(due, self._clock())
            finally:
                handle = loop.call_later(self.every, tick, self._clock() + self.every)

        handle = loop.call_later(self.every, tick, self._clock() + self.every)
        try:
            await loop.create_future()  # ended by the service's cancellation
        finally:
            handle.cancel()

    # --- the collector's callbacks ---------------------------------------------

    def watch_gc(self) -> None:
        if self._on_gc not in gc.callbacks:
            gc.callbacks.append(self._on_gc)

    def unwatch_gc(self) -> None:
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)

    def _on_gc(self, phase: str, info: dict[str, Any]) -> None:
        # Called by the collector, in whichever thread allocated; the GIL
        # is held throughout a collection, so the two calls pair up.
        if phase == "start":
            self._gc_began = self._timer()
            return
        began, self._gc_began = self._gc_began, None
        hist = self.gc.get(info.get("generation", -1))
        if began is None or hist is None:
            return
        took = self._timer() - began
        hist.observe(took)
        self.worst_gc = max(self.worst_gc, took)

    # --- Prometheus -------------------------------------------------------------

    def collect(self) -> Iterator[Metric]:
        lag = HistogramMetricFamily(
            "llmgw_event_loop_lag_seconds",
            f"How late a timer due every {self.every:g} s ran on this process's event "
            "loop: what every open request waited then")
        lag.add_metric([], self.lag.cumulative(), self.lag.sum)
        yield lag
        pauses = HistogramMetricFamily(
            "llmgw_gc_pause_seconds",
            "Garbage collections of this process by generation, and how long each "
            "held it", labels=["generation"])
        for g, hist in self.gc.items():
            pauses.add_metric([str(g)], hist.cumulative(), hist.sum)
        yield pauses
