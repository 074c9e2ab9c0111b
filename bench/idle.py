"""What an idle gateway costs: two whole stacks (etcd, gateway, agent,
stand-in, as bench/before_after.py starts them), this tree's beside another
tree's, both gateways on core 0 and idle, each gateway's CPU over the same
windows. vllm-router's idle costs nothing; every periodic task of a gateway
(the election's renewals, the key shares, the usage publisher, the loop-lag
ticks, the engine-load poll) shows here.

    git archive BASE | tar -x -C /tmp/before
    python bench/idle.py /tmp/before --before-python /tmp/venv-before/bin/python
    python bench/idle.py --before-env LLMGW_ELECTION_INTERVAL=5   # one task's share
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for p in (str(ROOT), str(ROOT / "bench")):
    if p not in sys.path:
        sys.path.insert(0, p)

import peers  # noqa: E402
from router_overhead import cpu_seconds  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("before", type=Path, nargs="?", default=ROOT,
                    help="the tree the 'before' gateway runs (default: this one)")
    peers.add_before_options(ap, "LLMGW_ELECTION_INTERVAL=5")
    ap.add_argument("--windows", type=int, default=4)
    ap.add_argument("--seconds", type=float, default=30.0, help="a window")
    ap.add_argument("--settle", type=float, default=10.0, help="seconds idle before the first")
    args = ap.parse_args(argv)
    if len(os.sched_getaffinity(0)) >= 2:
        os.sched_setaffinity(0, {1})
    tmp = Path(tempfile.mkdtemp(prefix="idle-"))
    (tmp / "a").mkdir()
    (tmp / "b").mkdir()
    before = peers.Llmgw(tmp / "a", 0, 1, dict(args.before_env), python=args.before_python,
                         tree=args.before)
    after = peers.Llmgw(tmp / "b", 0, 1)
    gateways = (("before", before), ("after", after))
    ratios = []
    try:
        before.start()
        after.start()
        time.sleep(args.settle)
        for _ in range(args.windows):
            c0 = {name: cpu_seconds([gw.gateway.pid]) for name, gw in gateways}
            t0 = time.monotonic()
            time.sleep(args.seconds)
            dt = time.monotonic() - t0
            ms = {name: (cpu_seconds([gw.gateway.pid]) - c0[name]) / dt * 1e3
                  for name, gw in gateways}
            ratios.append(ms["after"] / ms["before"] if ms["before"] else float("nan"))
            print(" ".join(f"{name} {v:.2f} ms/s" for name, v in ms.items()), flush=True)
    finally:
        before.stop()
        after.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    print("after/before " + ", ".join(f"{r:.2f}" for r in ratios))
    return 0


if __name__ == "__main__":
    sys.exit(main())
