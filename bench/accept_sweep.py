"""What a connection costs the gateway's loop to accept: `accept.Loop`
(app/gateway/accept.py: what waits in the queue taken in one sweep) beside
libuv alone (uvloop's own accept, one connection a turn), and beside another
tree's `accept.Loop` with `--before TREE`.

A server of each kind (a bare protocol: one read, one write, closed at the
client's end) runs in its own process on core 0; this process, the client,
on core 1 opens `--burst` connections at a time, so that all but the first
of each burst wait in the queue for a sweep, and reads one answer on each.
The figure is the server's CPU per connection from the kernel's run time
(schedstat, nanoseconds: stream_setup.run_ns), each kind in turn, `--rounds` times.

    python bench/accept_sweep.py --connections 4000 --burst 16 --rounds 5 --before /tmp/before
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for p in (str(ROOT), str(ROOT / "bench")):
    if p not in sys.path:
        sys.path.insert(0, p)

from stream_setup import run_ns  # noqa: E402

from app.ports import free_port  # noqa: E402

LIBUV = "libuv alone"


class _Answer(asyncio.Protocol):
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport: asyncio.Transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.transport.write(b"ok")

    def eof_received(self) -> None:
        self.transport.close()


def serve(tree: str, port: int, sweep: bool) -> None:
    """The server: `tree`'s accept.Loop, or uvloop's own."""
    sys.path.insert(0, tree)
    import uvloop

    from app.gateway.accept import Loop

    async def main() -> None:
        loop = asyncio.get_running_loop()
        await loop.create_server(_Answer, "127.0.0.1", port, backlog=2048)
        print("ready", flush=True)
        await asyncio.Event().wait()

    with asyncio.Runner(loop_factory=Loop if sweep else uvloop.new_event_loop) as runner:
        runner.run(main())


def measure(tree: str, sweep: bool, connections: int, burst: int) -> float:
    """The server's CPU per connection, in microseconds."""
    port = free_port("127.0.0.1")
    proc = subprocess.Popen([sys.executable, __file__, "--serve", tree, str(port),
                             "sweep" if sweep else "libuv"], stdout=subprocess.PIPE)
    try:
        assert proc.stdout is not None
        if proc.stdout.readline().strip() != b"ready":
            raise SystemExit(f"the {tree} server did not start")
        os.sched_setaffinity(proc.pid, {0})
        start, done = run_ns([proc.pid]), 0
        while done < connections:
            socks = [socket.create_connection(("127.0.0.1", port), timeout=10)
                     for _ in range(burst)]
            for s in socks:
                s.sendall(b"x")
            for s in socks:
                if s.recv(2) != b"ok":
                    raise SystemExit("no answer")
                s.close()
            done += burst
        return (run_ns([proc.pid]) - start) / done / 1e3
    finally:
        proc.kill()
        proc.wait()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--connections", type=int, default=4000)
    ap.add_argument("--burst", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--before", help="another tree whose accept.Loop runs beside this one's")
    ap.add_argument("--serve", nargs=3, metavar=("TREE", "PORT", "KIND"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.serve:
        tree, port, kind = args.serve
        serve(tree, int(port), kind == "sweep")
        return 0
    if not {0, 1} <= os.sched_getaffinity(0):
        raise SystemExit("two cores needed: the server on one, the client on the other")
    os.sched_setaffinity(0, {1})
    kinds = {"accept.Loop": (str(ROOT), True), LIBUV: (str(ROOT), False)}
    if args.before:
        kinds[f"accept.Loop, {args.before}"] = (args.before, True)
    got: dict[str, list[float]] = {name: [] for name in kinds}
    for r in range(args.rounds):
        order = list(kinds.items())
        for name, (tree, sweep) in order if r % 2 == 0 else reversed(order):
            got[name].append(measure(tree, sweep, args.connections, args.burst))
    print(f"{args.connections} connections a round in bursts of {args.burst}, "
          f"{args.rounds} rounds; server CPU per connection, us:")
    base = statistics.median(got[LIBUV])
    for name, values in got.items():
        med = statistics.median(values)
        print(f"- {name}: {med:.1f} (rounds {', '.join(f'{v:.1f}' for v in values)}; "
              f"{med - base:+.1f} against libuv alone)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
