"""How long the collector holds a gateway's loop while streams open by the
thousand: the keeper of this tree (app/gateway/gc_keeper.py) beside the
keeper of another tree, each in a process of its own, in one run.

A simulated gateway: start-up's objects frozen (`--startup`, about what a
gateway freezes), then streams opened `--open` a simulated second until
`--streams` are open, each keeping `--objects` tracked objects as long as it
lives (bench/streams.py counted about 96 a stream at 2,048 streams, with gdb)
and living `--life` seconds; each second the chunks' short-lived objects
(`--young` young collections' worth, at the gateway's thresholds) and one
`GcKeeper.step()`, as `run()` does. Every collection of the oldest
generation is timed by the collector's own callbacks; what holds the loop
is what falls within one second, as the steps of a second run back to back.

    git archive BASE | tar -x -C /tmp/before
    python bench/gc_streams.py /tmp/before
"""

from __future__ import annotations

import argparse
import gc
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def simulate(tree: Path, startup: int, streams: int, opened: int, objects: int, life: int,
             young: int, seconds: int) -> dict[str, Any]:
    sys.path.insert(0, str(tree))
    from app.gateway.gc_keeper import GcKeeper, thresholds

    gc.set_threshold(*thresholds(7000))
    kept = [[i] for i in range(startup)]  # start-up's and the mirror's objects
    keeper = GcKeeper()
    keeper.freeze_all()
    now = [0]
    began = [0.0]
    pauses: list[tuple[int, float]] = []  # (second, ms) of each full collection

    def timed(phase: str, info: dict[str, Any]) -> None:
        if info["generation"] != 2:
            return
        if phase == "start":
            began[0] = time.perf_counter()
        else:
            pauses.append((now[0], (time.perf_counter() - began[0]) * 1000))

    gc.callbacks.append(timed)
    open_: list[tuple[int, list[list[int]]]] = []
    for second in range(seconds):
        now[0] = second
        while open_ and open_[0][0] <= second - life:
            open_.pop(0)
        for _ in range(min(opened, streams - len(open_))):
            open_.append((second, [[] for _ in range(objects - 1)]))
        for _ in range(young):  # the chunks' garbage: young collections
            chunks: list[list[int]] = [[] for _ in range(7000)]
            del chunks
        keeper.step()  # run()'s step, once a second
    gc.callbacks.remove(timed)
    by_second: dict[int, float] = {}
    for second, ms in pauses:
        by_second[second] = by_second.get(second, 0.0) + ms
    return {"full": len(pauses), "longest_ms": max((ms for _, ms in pauses), default=0.0),
            "held_ms": max(by_second.values(), default=0.0),
            "sum_ms": sum(ms for _, ms in pauses), "reclaims": keeper.reclaims,
            "kept": len(kept)}


def run(tree: Path, args: argparse.Namespace) -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, __file__, "--simulate", str(tree), "--startup", str(args.startup),
         "--streams", str(args.streams), "--open", str(args.open), "--objects",
         str(args.objects), "--life", str(args.life), "--young", str(args.young),
         "--seconds", str(args.seconds)],
        capture_output=True, text=True, check=True, timeout=1800)
    out: dict[str, Any] = json.loads(done.stdout.splitlines()[-1])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("before", type=Path, nargs="?", help="the other tree")
    ap.add_argument("--simulate", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--startup", type=int, default=100_000)
    ap.add_argument("--streams", type=int, default=4096)
    ap.add_argument("--open", type=int, default=1024, help="streams opened a second")
    ap.add_argument("--objects", type=int, default=96, help="tracked objects a stream")
    ap.add_argument("--life", type=int, default=20, help="seconds a stream lives")
    ap.add_argument("--young", type=int, default=6, help="young collections a second")
    ap.add_argument("--seconds", type=int, default=120)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    if args.simulate is not None:
        print(json.dumps(simulate(args.simulate, args.startup, args.streams, args.open,
                                  args.objects, args.life, args.young, args.seconds)))
        return
    if args.before is None:
        ap.error("the other tree to compare with")
    trees = {"before": args.before, "after": ROOT}
    got: dict[str, list[dict[str, Any]]] = {"before": [], "after": []}
    for r in range(args.rounds):
        for name in (["before", "after"] if r % 2 == 0 else ["after", "before"]):
            got[name].append(run(trees[name], args))
    print(f"{args.streams:,} streams ({args.objects} objects each, {args.open:,} opened a "
          f"second, living {args.life} s), {args.startup:,} objects frozen at start-up, "
          f"{args.seconds} simulated s, {args.rounds} rounds alternated:")
    for name, rows in got.items():
        for row in rows:
            print(f"  {name:<6} full collections {row['full']}, longest {row['longest_ms']:.0f} "
                  f"ms, most in one second {row['held_ms']:.0f} ms, {row['sum_ms']:.0f} ms in "
                  f"all, {row['reclaims']} reclaims")
    held = [a["held_ms"] / b["held_ms"] for a, b in zip(got["after"], got["before"], strict=True)
            if b["held_ms"]]
    total = [a["sum_ms"] / b["sum_ms"] for a, b in zip(got["after"], got["before"], strict=True)
             if b["sum_ms"]]
    print(f"after/before: most held in one second {', '.join(f'{x:.2f}x' for x in held)}; "
          f"in all {', '.join(f'{x:.2f}x' for x in total)}")


if __name__ == "__main__":
    main()
