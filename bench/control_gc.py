"""bench/control_scale.py's garbage collections on a gateway whose mirror
is replaced value by value, as a fleet reporting for a while replaces it
(docs/design/hot-path.md, "The mirror out of full collections").

The 10,000-node fleet, frozen once loaded as a gateway freezes its mirror's
first load; then `seconds` simulated seconds, each replacing
`writes_per_s` values (half nodes' inventories, half replica statuses: the
write rate control_scale measures for 10,000 agents) and running a loaded
gateway's young collections (one every 0.2 s, 8,000 objects of requests in
flight each time, which so age into the oldest generation). Every full
collection CPython runs meanwhile is timed by its own callbacks: without
the keeper (app/gateway/gc_keeper.py) and with it, each in a process of its
own.
"""

from __future__ import annotations

import gc
import itertools
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def churn(nodes: int, seconds: int, writes_per_s: int, keep: bool) -> dict[str, Any]:
    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(ROOT / "bench"))
    from control_fleet import fleet

    from app.gateway.gc_keeper import GcKeeper, thresholds

    gc.set_threshold(*thresholds(7000))  # the gateway's (LLMGW_GC_THRESHOLD)
    pauses: list[float] = []
    began = [0.0]

    def timed(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            began[0] = time.perf_counter()
        elif info["generation"] == 2:
            pauses.append((time.perf_counter() - began[0]) * 1000)

    f = fleet(nodes)
    keeper = GcKeeper()
    keeper.freeze_all()
    gc.callbacks.append(timed)
    node_names = itertools.cycle(list(f.nodes))
    status_ids = itertools.cycle(list(f.statuses))
    for _ in range(seconds):
        for _ in range(writes_per_s // 2):
            n = next(node_names)
            f.nodes[n] = f.nodes[n].model_copy(deep=True)
            r = next(status_ids)
            f.statuses[r] = f.statuses[r].model_copy(deep=True)
        for _ in range(5):
            inflight: list[list[int]] = [[] for _ in range(8000)]
            gc.collect(1)
            del inflight
        if keep:
            keeper.step()
    return {"full": len(pauses), "max_ms": max(pauses, default=0.0),
            "sum_ms": sum(pauses), "reclaims": keeper.reclaims}


def churn_pauses(nodes: int, seconds: int = 300, writes_per_s: int = 290
                 ) -> dict[str, dict[str, Any]]:
    """{"plain": ..., "kept": ...}: full collections, the longest, their sum."""
    out = {}
    for name in ("plain", "kept"):
        done = subprocess.run(
            [sys.executable, __file__, str(nodes), str(seconds), str(writes_per_s), name],
            capture_output=True, text=True, check=True, timeout=1800)
        out[name] = json.loads(done.stdout.splitlines()[-1])
    return out


if __name__ == "__main__":
    n, secs, rate, mode = sys.argv[1:5]
    print(json.dumps(churn(int(n), int(secs), int(rate), mode == "kept")))
