"""A piped stream chunk's CPU in process: the engine connection's read
callback (app/router/upstream.py) through the stream's chain (the framing,
the continuation's record, the meter: relay_stream.py) to the client
socket's writer (direct_body.py), with `--streams` streams' objects taken in
turn, so that each chunk finds its stream's objects as a busy gateway does
(out of the CPU's nearest caches). No sockets: the transports only count.

Side by side in one run: the bytes alone (each read handed to the client's
transport, nothing parsed: the floor of any path), reads of whole chunks
(each an event in a chunk of its own, as vLLM sends them), and the same
reads each cut in two (llhttp reads them). With `--before TREE` (and its
interpreter, `--before-python`, whose venv holds that tree's compiled
router), the same figures for another tree, in a process of its own,
alternated with this one's.

    git archive BASE | tar -x -C /tmp/before
    python bench/chunk_path.py --before /tmp/before --before-python /tmp/venv-before/bin/python
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, cast

ROOT = Path(__file__).resolve().parent.parent

# The stand-in's event (bench/standin.py), as one chunk of a chunked body.
EVENT = (b'data: {"id":"chatcmpl-standin","object":"chat.completion.chunk","created":1700000000,'
         b'"model":"m","choices":[{"index":0,"delta":{"content":"@12345.678901 "},'
         b'"finish_reason":null}]}\n\n')
CHUNK = b"%x\r\n%b\r\n" % (len(EVENT), EVENT)
HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
BODY = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}


class Transport:
    """Counts what is written; never full."""

    def __init__(self) -> None:
        self.writes = 0

    def is_closing(self) -> bool:
        return False

    def write(self, data: bytes) -> None:
        self.writes += 1

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass

    def close(self) -> None:
        pass


def measure(tree: Path, streams: int, chunks: int, repeats: int) -> dict[str, Any]:
    """us a chunk, best of `repeats`, for each way, with the tree's router."""
    sys.path.insert(0, str(tree))
    from app.router import continuation, direct_body, relay_stream, upstream
    from app.router.timeouts import Timeouts, Watch
    from app.router.usage.meter import Meter

    async def run() -> dict[str, Any]:
        loop = asyncio.get_running_loop()
        pool = upstream.UpstreamClient(5.0)
        conns, chains, bare = [], [], []

        async def receive() -> dict[str, Any]:
            return {"type": "http.disconnect"}

        for _ in range(streams):
            conn = upstream._Connection(pool, ("http", "engine", 80), loop)
            conn.connection_made(cast(asyncio.Transport, Transport()))
            conn.send(b"POST /v1/chat/completions HTTP/1.1\r\n\r\n")
            conn.data_received(HEAD)
            chain = relay_stream._Chain(None, True, continuation.Splice(
                BODY, "/chat/completions", "m", True), Meter())
            chain.flow = direct_body.ClientFlow(cast(asyncio.Transport, Transport()))
            chain.clock = loop.time
            chain.watch = Watch(receive, Timeouts(), loop.time(), loop)
            chain.watch.close()  # no timer: nothing here expires
            conn._sink = chain  # as Response.pipe sets it
            conns.append(conn)
            chains.append(chain)
            bare.append(Transport())
        gc.collect()
        gc.freeze()
        rounds = max(1, chunks // streams)
        first, second = CHUNK[:len(CHUNK) // 2], CHUNK[len(CHUNK) // 2:]

        def whole() -> None:
            for _ in range(rounds):
                for conn in conns:
                    conn.data_received(CHUNK)

        def cut() -> None:
            for _ in range(rounds // 2):
                for conn in conns:
                    conn.data_received(first)
                    conn.data_received(second)

        def alone() -> None:
            for _ in range(rounds):
                for t in bare:
                    t.write(CHUNK)

        best: dict[str, float] = {}
        for _ in range(repeats):
            for name, way, n in (("bytes alone", alone, rounds * streams),
                                 ("whole chunks", whole, rounds * streams),
                                 ("cut chunks", cut, rounds // 2 * streams)):
                t0 = time.perf_counter()
                way()
                us = (time.perf_counter() - t0) / n * 1e6
                best[name] = min(best.get(name, us), us)
                for chain in chains:  # the continuation's record, bounded
                    assert chain.splice is not None
                    chain.splice._kept = []
        return {"us": best}

    return asyncio.run(run())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--streams", default="1,512,2048")
    ap.add_argument("--chunks", type=int, default=200_000, help="chunks a measurement")
    ap.add_argument("--repeats", type=int, default=5, help="measurements a way (best kept)")
    ap.add_argument("--rounds", type=int, default=2, help="each tree this many times, alternated")
    ap.add_argument("--before", type=Path, help="another tree, measured beside this one")
    ap.add_argument("--before-python", default=sys.executable)
    ap.add_argument("--one", type=Path, help=argparse.SUPPRESS)  # a child: measure TREE, print JSON
    args = ap.parse_args(argv)
    counts = [int(n) for n in args.streams.split(",")]
    if args.one is not None:
        print(json.dumps({n: measure(args.one, n, args.chunks, args.repeats) for n in counts}))
        return 0
    trees = [("after", sys.executable, ROOT)]
    if args.before is not None:
        trees.insert(0, ("before", args.before_python, args.before.resolve()))
    got: dict[str, list[dict[str, Any]]] = {}
    for r in range(args.rounds):
        for name, python, tree in trees if r % 2 == 0 else trees[::-1]:
            out = subprocess.run(
                [python, str(Path(__file__).resolve()), "--one", str(tree), "--streams",
                 args.streams, "--chunks", str(args.chunks), "--repeats", str(args.repeats)],
                cwd=tree, capture_output=True, text=True, timeout=900, check=True)
            got.setdefault(name, []).append(json.loads(out.stdout.splitlines()[-1]))
    print(f"us a chunk in process, best of {args.repeats} x {args.chunks:,} chunks, "
          f"median of {args.rounds} runs a tree")
    def median(name: str, n: int, way: str) -> float:
        return float(statistics.median(run[str(n)]["us"][way] for run in got[name]))

    for n in counts:
        for name, _, _ in trees:
            us = {way: median(name, n, way) for way in got[name][0][str(n)]["us"]}
            floor = us["bytes alone"]
            print(f"{n:5} streams, {name:6}: " + ", ".join(
                f"{way} {v:.3f} ({v / floor:.1f}x the bytes alone)" if way != "bytes alone"
                else f"{way} {v:.3f}" for way, v in us.items()))
        if args.before is not None:
            ratio = ", ".join(f"{way} {median('after', n, way) / median('before', n, way):.2f}"
                              for way in ("whole chunks", "cut chunks"))
            print(f"{n:5} streams, after/before: {ratio}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
