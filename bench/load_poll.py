#!/usr/bin/env python3
"""The engine-load poll's CPU per node asked (app/router/engine_load.py),
at fleet sizes a gateway meets.

Not a test (pytest never collects bench/). From the repository root:

    python bench/load_poll.py                 # 500, 2000 nodes; ~1 min
    python bench/load_poll.py --nodes 10000

Each node's agent is stood in for by one process (on core 1 where there
are two) serving `GET /node/v1/loads` on a few ports, an answer of 8
replicas each, as an agent of an 8-GPU node gives; the poller runs here (on
core 0) over a route table of `nodes` x 8 replicas, each node its own agent
(its own name and token: its own ask). A round is timed by this process's
CPU time (`time.process_time`), so another process's load on the machine
moves it less than wall time. Printed beside each figure: how much of one
core a gateway spends on the poll at one round a second, and the round's
wall time (a round longer than the poll's interval makes the figures stale:
routing on in-flight counts only, and scaling down held).

Last line: `load_poll: cpu_us_per_node= core_share_10000= round_s_N=`.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import aiohttp
import uvloop

ROOT = Path(__file__).resolve().parents[1]
for p in (str(ROOT), str(ROOT / "bench")):
    if p not in sys.path:
        sys.path.insert(0, p)

import peers  # noqa: E402

from app.router.engine_load import EngineLoadPoller, NodeAgent  # noqa: E402
from app.router.published import Endpoint  # noqa: E402
from app.router.table import RouteTable  # noqa: E402
from app.router.upstream import UpstreamClient  # noqa: E402
from app.wire.loads import loads_answer, read_capped  # noqa: E402

GPUS = 8

# The stand-in agents: a raw asyncio server answering every GET with one
# canned answer (the answer's size is an 8-replica node's).
_AGENTS = textwrap.dedent("""
    import asyncio, json, sys
    import uvloop
    body = sys.argv[1].encode()
    head = (b"HTTP/1.1 200 OK\\r\\ncontent-type: application/json\\r\\n"
            b"content-length: " + str(len(body)).encode() + b"\\r\\n\\r\\n")
    class P(asyncio.Protocol):
        def connection_made(self, t): self.t, self.buf = t, b""
        def data_received(self, d):
            self.buf += d
            while b"\\r\\n\\r\\n" in self.buf:
                _, self.buf = self.buf.split(b"\\r\\n\\r\\n", 1)
                self.t.write(head + body)
    async def main():
        loop = asyncio.get_running_loop()
        for port in sys.argv[2:]:
            await loop.create_server(P, "127.0.0.1", int(port), backlog=4096)
        print("ready", flush=True)
        await asyncio.Event().wait()
    uvloop.run(main())
""")


class AiohttpPoller(EngineLoadPoller):
    """The baseline: the same poll, its asks through aiohttp (as before)."""

    def __init__(self, *args: Any, session: aiohttp.ClientSession, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._session = session

    async def _get(self, client: UpstreamClient, base_url: str, path: str, token: str,
                   cap: int) -> tuple[int, bytes]:
        async with self._session.get(base_url + path, timeout=aiohttp.ClientTimeout(30),
                                     headers={"Authorization": f"Bearer {token}"}) as resp:
            body = await read_capped(resp.content, cap) if resp.status == 200 else b""
            return resp.status, body


class Directory:
    def __init__(self, agents: dict[str, NodeAgent]) -> None:
        self._agents = agents

    def agents(self) -> dict[str, NodeAgent]:
        return self._agents


async def measure(nodes: int, ports: list[int], rounds: int, baseline: bool,
                  ) -> tuple[float, float]:
    """(CPU us per node asked, wall s of the slowest round); `baseline`:
    through aiohttp."""
    table = RouteTable()
    eps: dict[str, list[Endpoint]] = {}
    agents: dict[str, NodeAgent] = {}
    for n in range(nodes):
        url = f"http://127.0.0.1:{ports[n % len(ports)]}"
        agent = NodeAgent(f"node-{n}", url, (f"token-{n}",))
        for g in range(GPUS):
            rid = f"r-{n}-{g}"
            eps.setdefault(f"m{n % 500}", []).append(Endpoint(rid, url + f"/e{g}", "k"))
            agents[rid] = agent
    table.set_endpoints(eps)
    client = UpstreamClient(10.0)
    async with aiohttp.ClientSession() as session:
        poller = (AiohttpPoller(table, lambda: client, directory=Directory(agents),
                                timeout=30.0, session=session) if baseline else
                  EngineLoadPoller(table, lambda: client, directory=Directory(agents),
                                   timeout=30.0))
        await poller.poll()  # connections opened
        cpu, worst = [], 0.0
        for _ in range(rounds):
            gc.collect()
            c0, w0 = time.process_time(), time.monotonic()
            await poller.poll()
            cpu.append(time.process_time() - c0)
            worst = max(worst, time.monotonic() - w0)
    await client.close()
    return min(cpu) / nodes * 1e6, worst


def main() -> None:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--nodes", default="500,2000")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--ports", type=int, default=8)
    args = p.parse_args()
    sizes = [int(x) for x in args.nodes.split(",")]
    found: set[int] = set()
    while len(found) < args.ports:  # one stand-in process listens on them all
        found.add(peers.free_port())
    ports = sorted(found)
    figures = {f"r-0-{g}": {"running": 1.0, "waiting": 0.0, "kv": 0.1, "age_s": 0.2}
               for g in range(GPUS)}
    body = json.dumps(loads_answer("node", {}) | {"loads": figures})
    two = (os.cpu_count() or 1) >= 2
    pin = ["taskset", "-c", "1"] if two else []
    proc = subprocess.Popen([*pin, sys.executable, "-c", _AGENTS, body, *map(str, ports)],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        if two:
            os.sched_setaffinity(0, {0})
        print(f"{'nodes':>7} {'client':>8} {'CPU us/node':>12} {'core at 1/s':>12} "
              f"{'round s':>8} {'CPU vs aiohttp':>15}")
        out: dict[tuple[int, bool], tuple[float, float]] = {}
        for n in sizes:
            for baseline in (True, False):  # side by side, at each size
                per, wall = uvloop.run(measure(n, ports, args.rounds, baseline))
                out[n, baseline] = (per, wall)
                ratio = per / out[n, True][0]
                print(f"{n:>7} {'aiohttp' if baseline else 'llmgw':>8} {per:>12.1f} "
                      f"{per * n / 1e6:>12.2f} {wall:>8.2f} {ratio:>14.2f}x", flush=True)
    finally:
        proc.terminate()
        proc.wait()
    per = min(v[0] for (_, b), v in out.items() if not b)
    base = min(v[0] for (_, b), v in out.items() if b)
    print(f"load_poll: cpu_us_per_node={per:.1f} aiohttp_cpu_us_per_node={base:.1f} "
          f"ratio={per / base:.2f} core_share_10000={per * 10000 / 1e6:.2f} "
          + " ".join(f"round_s_{n}={w:.2f}" for (n, b), (_, w) in out.items() if not b))


if __name__ == "__main__":
    main()
