"""What llmgw's own /metrics says of its event loop over a step: two scrapes
of `llmgw_event_loop_lag_seconds` and `llmgw_gc_pause_seconds`
(app/gateway/loop_lag.py), and of `llmgw_gc_frozen_objects` and
`llmgw_gc_reclaims_total` (app/gateway/gc_keeper.py), and the difference,
so that a step's delays can be told apart: the loop held (by a collection
or anything else) or the process short of CPU; and whether the frozen
objects grow under load (cycles frozen while alive, garbage since)."""

from __future__ import annotations

from dataclasses import dataclass

import httpx
from prometheus_client.parser import text_string_to_metric_families

Scrape = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(url: str, prefixes: tuple[str, ...] = ("llmgw_event_loop_lag_seconds",
                                                  "llmgw_gc_")) -> Scrape:
    """The samples of a gateway's /metrics whose names start with `prefixes`."""
    r = httpx.get(url + "/metrics", timeout=10)
    r.raise_for_status()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(r.text) for s in fam.samples
            if s.name.startswith(prefixes)}


@dataclass
class LoopSeen:
    ticks: int = 0
    over_10ms: int = 0
    over_50ms: int = 0
    worst_le: str = "-"  # the bound of the highest bucket a tick fell in
    gc_counts: tuple[int, int, int] = (0, 0, 0)
    gc_ms: tuple[float, float, float] = (0.0, 0.0, 0.0)
    # Frozen objects before and after (growing: cycles frozen while alive,
    # garbage since, or the heap grown), and the reclaims over the step.
    frozen: tuple[int, int] = (0, 0)
    reclaims: int = 0

    def line(self) -> str:
        worst = "" if self.worst_le == "-" else f", the worst within {self.worst_le} s"
        gcs = ", ".join(f"gen{g} {n} ({ms:.0f} ms)"
                        for g, (n, ms) in enumerate(zip(self.gc_counts, self.gc_ms, strict=True)))
        return (f"{self.ticks} ticks, {self.over_10ms} over 10 ms, {self.over_50ms} over 50 ms"
                f"{worst}; collections {gcs}; frozen objects {self.frozen[0]:,} -> "
                f"{self.frozen[1]:,}, {self.reclaims} reclaims")


def between(before: Scrape, after: Scrape) -> LoopSeen:
    def d(name: str, labels: tuple[tuple[str, str], ...] = ()) -> float:
        key = (name, labels)
        return after.get(key, 0.0) - before.get(key, 0.0)

    lag = "llmgw_event_loop_lag_seconds"
    ticks = d(lag + "_count")
    buckets = sorted(((float(dict(labels)["le"]), dict(labels)["le"]) for name, labels in after
                      if name == lag + "_bucket"))
    worst = "-"
    for _bound, le in buckets:  # the first bound holding every tick
        if ticks and d(lag + "_bucket", (("le", le),)) >= ticks:
            worst = le
            break
    gc = "llmgw_gc_pause_seconds"
    counts = [int(d(gc + "_count", (("generation", str(g)),))) for g in range(3)]
    ms = [d(gc + "_sum", (("generation", str(g)),)) * 1e3 for g in range(3)]
    return LoopSeen(
        ticks=int(ticks),
        over_10ms=int(ticks - d(lag + "_bucket", (("le", "0.01"),))),
        over_50ms=int(ticks - d(lag + "_bucket", (("le", "0.05"),))),
        worst_le=worst,
        gc_counts=(counts[0], counts[1], counts[2]),
        gc_ms=(ms[0], ms[1], ms[2]),
        frozen=(int(before.get(("llmgw_gc_frozen_objects", ()), 0)),
                int(after.get(("llmgw_gc_frozen_objects", ()), 0))),
        reclaims=int(d("llmgw_gc_reclaims_total")),
    )
