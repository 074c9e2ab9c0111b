#!/usr/bin/env python3
"""llmgw at two commits side by side in one run: two stacks (etcd, gateway,
agent, stand-in) as bench/router_overhead.py starts them, the gateways on
core 0, wrk alternating between them (A B, then B A) at each point; CPU per
request is the steadier figure on a shared machine (req/s is the proxy's
share of its core over it).

    git archive BASE | tar -x -C /tmp/before
    python bench/before_after.py /tmp/before 4 4 bench/RESULTS-hotpath.md

Or one tree on two interpreters (each a venv's python with llmgw's
dependencies): the "before" gateway on `--before-python`.

    python bench/before_after.py . 8 3 /tmp/interp.md --before-python /tmp/venv-pyenv/bin/python
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for p in (str(ROOT), str(ROOT / "bench")):
    if p not in sys.path:
        sys.path.insert(0, p)

import load  # noqa: E402
import peers  # noqa: E402
import sections  # noqa: E402
from router_overhead import cpu_seconds  # noqa: E402

Row = tuple[float, float, float, float, float, int]  # req/s, CPU/req us, share, p50, p99, errors


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("before", type=Path, help="the tree the 'before' gateway runs")
    ap.add_argument("duration", type=float, help="seconds of wrk a point")
    ap.add_argument("rounds", type=int, help="points a concurrency, alternated")
    ap.add_argument("out", type=Path, help="where the run's lines are written")
    peers.add_before_options(ap, "LLMGW_GC_THRESHOLD=700")
    ap.add_argument("--section", default="",
                    help="write the run as this section of OUT (bench/sections.py), "
                    "headed by --title, instead of OUT whole")
    ap.add_argument("--title", default="llmgw before/after, one run (bench/before_after.py)")
    ap.add_argument("--streams", default="",
                    help="comma-separated stream counts: after the requests, each count of "
                    "SSE streams (bench/streams.py's step) on each gateway, alternated; "
                    "CPU a chunk")
    args = ap.parse_args()
    before_root, dur, rounds, out = args.before.resolve(), args.duration, args.rounds, args.out
    os.sched_setaffinity(0, {1})
    lines: list[str] = []

    def say(text: str) -> None:
        print(text, flush=True)
        lines.append(text)

    stream_opts = None
    if args.streams:  # bench/streams.py's defaults; its chunk interval is the stand-ins'
        import streams

        stream_opts = streams.parse_args([])
        os.environ["STANDIN_CHUNK_MS"] = str(stream_opts.chunk_ms)
    tmp = Path(tempfile.mkdtemp(prefix="ab-"))
    (tmp / "a").mkdir()
    (tmp / "b").mkdir()
    before_env = dict(args.before_env)
    a = peers.Llmgw(tmp / "a", 0, 1, before_env, python=args.before_python, tree=before_root)
    b = peers.Llmgw(tmp / "b", 0, 1)
    res: dict[tuple[str, int], list[Row]] = {}
    # Named, not given as paths: no path of this machine in RESULTS.
    before_tree = "this tree" if before_root == ROOT else f"the tree in {before_root.name}"
    settings = "".join(f", {k}={v}" for k, v in before_env.items())
    say(f"load average before {os.getloadavg()[0]:.2f}; before = {before_tree}{settings} on "
        f"{peers.interpreter(a.python, before_root)}, "
        f"after = this tree on {peers.interpreter(b.python)}; "
        f"{dur:g} s a point, {rounds} rounds")
    try:
        a.start()
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
        if stream_opts is not None:
            compare_streams(a, b, [int(n) for n in args.streams.split(",")], rounds,
                            stream_opts, say)
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
    text = f"## {args.title}\n\n```\n" + "\n".join(lines) + "\n```\n"
    if args.section:
        sections.replace_section(out, args.section, text)
    else:
        out.write_text(text)


def compare_streams(a: peers.Llmgw, b: peers.Llmgw, counts: list[int], rounds: int,
                    opts: argparse.Namespace, say: Callable[[str], None]) -> None:
    """bench/streams.py's step, with its options `opts`, on each gateway in turn."""
    import asyncio

    import streams
    import uvloop

    got: dict[tuple[str, int], list[float]] = {}
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        for n in counts:
            for r in range(rounds):
                order = [("before", a), ("after", b)]
                for name, gw in order if r % 2 == 0 else order[::-1]:
                    assert gw.engine_pid is not None
                    peer = peers.Peer("llmgw", gw.url, gw.client_key)
                    s = streams.measure(runner, peer, n, [gw.gateway.pid], gw.engine_pid, opts)
                    user, kernel = s.user_kernel_per_chunk_us()
                    got.setdefault((name, n), []).append(user)
                    say(f"{name:6} {n:4} streams: {s.clean} clean, CPU a chunk "
                        f"{s.cpu_per_chunk_us():5.1f} us (user {user:5.1f}, kernel "
                        f"{kernel:5.1f}), delay p99 {s.p99_ms():.1f} ms")
            bu, au = (statistics.median(got[(k, n)]) for k in ("before", "after"))
            say(f"{n} streams: user CPU a chunk before {bu:.1f} after {au:.1f} us "
                f"(after/before {au / bu:.2f})")


if __name__ == "__main__":
    main()
