#!/usr/bin/env python3
"""llmgw at two commits side by side in one run: two stacks (etcd, gateway,
agent, stand-in) as bench/router_overhead.py starts them, the gateways on
core 0, wrk alternating between them (A B, then B A) at each point; CPU per
request is the steadier figure on a shared machine (req/s is the proxy's
share of its core over it).

    git archive BASE | tar -x -C /tmp/before
    python bench/before_after.py /tmp/before 4 4 bench/RESULTS-hotpath.md
"""

from __future__ import annotations

import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for p in (str(ROOT), str(ROOT / "bench")):
    if p not in sys.path:
        sys.path.insert(0, p)

import load  # noqa: E402
import peers  # noqa: E402
from router_overhead import cpu_seconds  # noqa: E402

Row = tuple[float, float, float, float, float, int]  # req/s, CPU/req us, share, p50, p99, errors


def main() -> None:
    before_root, dur, rounds, out = (Path(sys.argv[1]).resolve(), float(sys.argv[2]),
                                     int(sys.argv[3]), Path(sys.argv[4]))
    os.sched_setaffinity(0, {1})
    lines: list[str] = []

    def say(text: str) -> None:
        print(text, flush=True)
        lines.append(text)

    tmp = Path(tempfile.mkdtemp(prefix="ab-"))
    (tmp / "a").mkdir()
    (tmp / "b").mkdir()
    a, b = peers.Llmgw(tmp / "a", 0, 1), peers.Llmgw(tmp / "b", 0, 1)
    res: dict[tuple[str, int], list[Row]] = {}
    say(f"load average before {os.getloadavg()[0]:.2f}; before = {before_root}, after = "
        f"{ROOT}; {dur:g} s a point, {rounds} rounds")
    try:
        peers.ROOT = before_root  # the processes' cwd: `python -m app.cli` runs that code
        a.start()
        peers.ROOT = ROOT
        b.start()
        for gw in (a, b):
            load.run_wrk(gw.url, gw.client_key, peers.MODEL, 64, 1)
        for c in (1, 64, 256):
            for r in range(rounds):
                order = [("before", a), ("after", b)]
                for name, gw in order if r % 2 == 0 else order[::-1]:
                    c0 = cpu_seconds([gw.gateway.pid])
                    w = load.run_wrk(gw.url, gw.client_key, peers.MODEL, c, dur)
                    used = cpu_seconds([gw.gateway.pid]) - c0
                    cpu = used / max(1, w.requests) * 1e6
                    res.setdefault((name, c), []).append(
                        (w.ok_rps, cpu, used / dur, w.p50_ms, w.p99_ms, w.errors))
                    say(f"{name:6} c={c:<4} req/s {w.ok_rps:7.0f} CPU/req {cpu:5.0f} us "
                        f"CPU share {used / dur:4.2f} p50 {w.p50_ms:6.2f} p99 {w.p99_ms:7.2f} "
                        f"errors {w.errors}")
    finally:
        a.stop()
        b.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    say(f"load average after {os.getloadavg()[0]:.2f}")

    def med(rows: list[Row], i: int) -> float:
        return statistics.median(x[i] for x in rows)

    for c in (1, 64, 256):
        bb, aa = res[("before", c)], res[("after", c)]
        say(f"c={c}: CPU/req before {med(bb, 1):.0f} after {med(aa, 1):.0f} us (after/before "
            f"{med(aa, 1) / med(bb, 1):.2f}); req/s {med(bb, 0):.0f} -> {med(aa, 0):.0f} "
            f"({med(aa, 0) / med(bb, 0):.2f}); p50 {med(bb, 3):.2f} -> {med(aa, 3):.2f} ms; "
            f"p99 {med(bb, 4):.2f} -> {med(aa, 4):.2f} ms; errors "
            f"{sum(x[5] for x in bb)} / {sum(x[5] for x in aa)}")
    out.write_text("# llmgw before/after, one run (bench/before_after.py)\n\n```\n"
                   + "\n".join(lines) + "\n```\n")


if __name__ == "__main__":
    main()
