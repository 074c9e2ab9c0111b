"""What a stream costs a proxy besides its chunks: its connection, request,
engine exchange, start and end. llmgw (cluster mode, as bench/streams.py
starts it) beside vllm-router, both on core 0, alternated: N streams of 3
chunks each, started over `--ramp` seconds, the proxy's CPU per stream from
the kernel's per-thread run time (/proc/PID/task/TID/schedstat, in
nanoseconds: a stream is too short for /proc/PID/stat's 10 ms ticks).

bench/streams.py's streams are 250 chunks long; there, each 100 us a stream
costs is 0.4 us a chunk, some 3% of a proxy's CPU per chunk.

    python bench/stream_setup.py --streams 512 --rounds 6

`--before TREE --before-python PY` adds a third proxy to the rotation: llmgw
as another tree runs it (PY: an environment holding that tree's compiled
copy), its own stack beside this one's.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
from pathlib import Path

import uvloop

ROOT = Path(__file__).resolve().parents[1]
for p in (str(ROOT), str(ROOT / "bench")):
    if p not in sys.path:
        sys.path.insert(0, p)

import peers  # noqa: E402
import streams  # noqa: E402
from router_overhead import group  # noqa: E402

CHUNK_MS = 20  # the stand-in's pace: a stream of 3 chunks lasts 60 ms


def run_ns(pids: list[int]) -> int:
    """The processes' run time so far, every thread's, in nanoseconds."""
    total = 0
    for pid in pids:
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tids:
            try:
                with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                    total += int(f.read().split()[0])
            except (OSError, ValueError, IndexError):
                continue  # a thread gone between the listing and the read
    return total


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--streams", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--ramp", type=float, default=2.0)
    ap.add_argument("--vllm-router-venv", type=Path, default=Path("/tmp/bench-vrouter"))
    ap.add_argument("--before", type=Path, default=None,
                    help="another tree of llmgw, run beside this one as 'llmgw-before'")
    peers.add_before_options(ap, "LLMGW_GC_THRESHOLD=700")
    args = ap.parse_args(argv)
    n = args.streams
    # 3 chunks a stream: streams.py asks the stand-in for (ramp + steady) /
    # chunk-ms of them; its pace is the environment's.
    opts = streams.parse_args(["--chunk-ms", str((args.ramp + 1.0) / 3 * 1000),
                               "--ramp", str(args.ramp), "--steady", "1"])
    os.environ["STANDIN_CHUNK_MS"] = str(CHUNK_MS)
    if len(os.sched_getaffinity(0)) >= 2:
        os.sched_setaffinity(0, {1})
    tmp = Path(tempfile.mkdtemp(prefix="stream-setup-"))
    gw = peers.Llmgw(tmp, 0, 1)
    old: peers.Llmgw | None = None
    if args.before is not None:
        (tmp / "before").mkdir()
        old = peers.Llmgw(tmp / "before", 0, 1, dict(args.before_env),
                          python=args.before_python, tree=args.before)
    started: list[peers.Peer] = []  # stopped on the way out, whatever ends the run
    with peers.running(gw, tmp, others=lambda: started):
        gw.start()
        standin = gw.engine_pid
        assert standin is not None
        standins = {"llmgw": standin, "vllm-router": standin}
        vr = peers.start_vllm_router(tmp, 0, gw.engine_url, gw.engine_key,
                                     args.vllm_router_venv)
        started.append(vr)
        router = vr.proc
        assert router is not None
        targets = {"llmgw": (peers.Peer("llmgw", gw.url, gw.client_key, None, ""),
                             [gw.gateway.pid]),
                   "vllm-router": (vr, group(router.pid))}
        try:
            if old is not None:
                old.start()
                assert old.engine_pid is not None
                targets["llmgw-before"] = (
                    peers.Peer("llmgw-before", old.url, old.client_key, None, ""),
                    [old.gateway.pid])
                standins["llmgw-before"] = old.engine_pid
            _rounds(targets, standins, n, opts, args.rounds)
        finally:
            if old is not None:
                old.stop()
    return 0


def _rounds(targets: dict[str, tuple[peers.Peer, list[int]]], standins: dict[str, int],
            n: int, opts: argparse.Namespace, rounds: int) -> None:
    """Each proxy's step in turn, the order reversed every other round; the
    medians printed."""
    per_stream: dict[str, list[float]] = {name: [] for name in targets}
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        for name, (peer, _) in targets.items():  # warm: engine connections, imports
            streams.measure(runner, peer, n, [], standins[name], opts)
        for r in range(rounds):
            order = list(targets) if r % 2 == 0 else list(reversed(targets))
            for name in order:
                peer, pids = targets[name]
                before = run_ns(pids)
                step = streams.measure(runner, peer, n, [], standins[name], opts)
                us = (run_ns(pids) - before) / n / 1e3
                per_stream[name].append(us)
                print(f"{name:12s} round {r + 1}: {n} streams, {step.clean} clean, "
                      f"{step.chunks} chunks, {us:.0f} us of CPU a stream", flush=True)
    mine, theirs = (statistics.median(per_stream[k]) for k in ("llmgw", "vllm-router"))
    print(f"median CPU a stream of 3 chunks: llmgw {mine:.0f} us, vllm-router {theirs:.0f} us "
          f"({mine / theirs:.2f}x); over bench/streams.py's 250-chunk streams the "
          f"difference is {(mine - theirs) / 250:+.2f} us a chunk")
    if "llmgw-before" in per_stream:
        was = statistics.median(per_stream["llmgw-before"])
        print(f"median CPU a stream of 3 chunks: llmgw-before {was:.0f} us, llmgw {mine:.0f} us "
              f"(after/before {mine / was:.2f}; before/vllm-router {was / theirs:.2f}x)")


if __name__ == "__main__":
    sys.exit(main())
