"""Loaded by a proxy that bench/router_overhead.py starts with this folder on
PYTHONPATH (--gc-probe, --gc-tune); inert anywhere else.

BENCH_GC_PROBE=FILE: times every collection of Python's cyclic GC (which
stops the event loop while it runs) and appends the totals per generation
to FILE on SIGUSR2: `gcstats gen0=N,SECONDS,MAX gen1=... gen2=...` (count and
seconds since start; MAX, the longest pause since the previous SIGUSR2).

BENCH_GC_TUNE=T0,T1,T2: the what-if of --gc-tune: those thresholds at once,
and on SIGUSR1 (sent once setup is done) a collection then `gc.freeze()`,
which leaves every object alive by then out of later collections.
"""

from __future__ import annotations

import gc
import os
import signal
import time
from types import FrameType
from typing import Any

_PROBE = os.environ.get("BENCH_GC_PROBE", "")
_TUNE = os.environ.get("BENCH_GC_TUNE", "")
_stats: dict[int, list[float]] = {0: [0, 0.0, 0.0], 1: [0, 0.0, 0.0], 2: [0, 0.0, 0.0]}
_started = [0.0]


def _timer(phase: str, info: dict[str, Any]) -> None:
    if phase == "start":
        _started[0] = time.perf_counter()
        return
    took = time.perf_counter() - _started[0]
    s = _stats[int(info["generation"])]
    s[0] += 1
    s[1] += took
    s[2] = max(s[2], took)


def _dump(signum: int, frame: FrameType | None) -> None:
    with open(_PROBE, "a") as f:
        f.write("gcstats " + " ".join(
            f"gen{g}={int(s[0])},{s[1]:.4f},{s[2]:.4f}" for g, s in sorted(_stats.items()))
            + f" frozen={gc.get_freeze_count()}\n")
    for s in _stats.values():
        s[2] = 0.0  # the next line's longest pause is over its own window


def _freeze(signum: int, frame: FrameType | None) -> None:
    gc.collect()
    gc.freeze()


if _PROBE:
    gc.callbacks.append(_timer)
    signal.signal(signal.SIGUSR2, _dump)
if _TUNE:
    t0, t1, t2 = (int(x) for x in _TUNE.split(","))
    gc.set_threshold(t0, t1, t2)
    signal.signal(signal.SIGUSR1, _freeze)
