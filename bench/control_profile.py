"""bench/control_scale.py's profile of one pass: where the time of the
pass that misses its goal goes (the 10%-missing one at the largest size),
by function, from cProfile.

cProfile's own cost inflates every call (about 2x here), so the shares,
not the milliseconds, are the figure: the functions by their own time,
then the pass's phases by their time with what they call.
"""

from __future__ import annotations

import cProfile
import gc
import pstats
from collections.abc import Callable
from typing import Any

# The pass's phases (app/control/plan/: planner.py, phases.py, placing.py,
# scaling.py; app/control/placement/placer.py): their time with what they call.
PHASES = ("plan", "sweep", "sick_by_node", "placing_order", "sort_out", "trim",
          "place_missing", "_index", "_quick", "_fit", "step", "wanted")


def pass_profile(run: Callable[[], Any], top: int = 15) -> str:
    """A text profile of `run()`, one pass."""
    gc.collect()
    prof = cProfile.Profile()
    prof.enable()
    run()
    prof.disable()
    stats = pstats.Stats(prof)
    rows: list[tuple[float, float, int, str]] = []
    total = 0.0
    by_name: dict[str, float] = {}
    for (path, line, name), (_, calls, own, cum, _) in stats.stats.items():  # type: ignore[attr-defined]
        total += own
        short = f"{name} ({path.rsplit('/app/', 1)[-1].rsplit('/', 1)[-1]}:{line})"
        rows.append((own, cum, calls, short))
        if name in PHASES and "/app/control/" in path:
            by_name[name] = max(by_name.get(name, 0.0), cum)
    rows.sort(reverse=True)
    out = [f"one pass under cProfile: {total * 1e3:.0f} ms in all (cProfile's own cost "
           "included); own time by function:"]
    out += [f"  {own / total:6.1%}  {calls:7d} calls  {short}"
            for own, _, calls, short in rows[:top]]
    out.append("phases, with what they call (share of the pass):")
    out += [f"  {cum / total:6.1%}  {name}" for name, cum in
            sorted(by_name.items(), key=lambda kv: -kv[1])]
    return "\n".join(out)
