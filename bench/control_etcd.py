"""bench/control_scale.py's etcd parts: what agents write, what etcd takes,
what a gateway's mirror holds (docs/design/scale.md).

- `agent_rates()`: simulated agents (the real agent client, `GatewayClient`)
  beat and report through a real gateway on the real etcd at the agent's
  own intervals divided by `speed`; etcd's own counters (raft proposals
  committed, lease renewals, Txn requests) before and after, less a
  baseline window without agents, per agent per second of agent time.
- `sustained()`: what this etcd commits at most: processes of concurrent
  clients putting values of an inventory's size on keys bound to leases,
  or renewing leases, for a few seconds (the client's CPU shares the
  machine: a floor of etcd's rate, not its ceiling).
- `mirror_mib()`: the Python heap a gateway's mirror takes once loaded
  with a preloaded fleet and its typed views built (tracemalloc).
"""

from __future__ import annotations

import asyncio
import random
import subprocess
import sys
import time
import tracemalloc
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent

# The agent's intervals (app/agent/config.py, app/agent/nodeops.py, and
# Agent.report()'s full report), in seconds.
HEARTBEAT_S = 5.0
REDISCOVER_S = 60.0  # free memory and utilisation: the inventory changes
FULL_REPORT_S = 15.0  # the statuses are sent whole, changed or not
NODE_TTL_S = 30  # the gateways' LLMGW_NODE_TTL: a renewal once per third


def inventory(name: str, gpus: int = 8, step: int = 0) -> dict[str, Any]:
    """A node's inventory as an 8-GPU agent sends it, with what changes
    every rediscovery (free memory, utilisation) drawn from `step`."""
    return {
        "name": name, "address": "127.0.0.1", "engines": ["vllm"], "version": _version(),
        "driver_version": "580.65.06", "cuda_version": "13.0",
        "gpu_discovery": "nvml", "cpus": 192, "memory_mib": 2_000_000,
        "api_url": "", "vllm_build": "cu13", "vllm_version": "0.33.0",
        "gpus": [{"index": g, "name": "NVIDIA H200", "memory_mib": 143_771,
                  "uuid": f"GPU-{abs(hash((name, g))):032x}"[:40],
                  "memory_free_mib": 143_000 - (step * 37 + g) % 9_000,
                  "utilization": (step * 13 + g) % 101} for g in range(gpus)]}


def _version() -> str:
    from app import __version__
    return __version__


def etcd_counters(endpoint: str) -> dict[str, float]:
    """Raft proposals committed (every write), lease renewals, Txn requests."""
    with urllib.request.urlopen(f"http://{endpoint}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    want = {"etcd_server_proposals_committed_total": "writes",
            "etcd_debugging_lease_renewed_total": "renewals",
            'grpc_server_msg_received_total{grpc_method="Txn"': "txns",
            'grpc_server_msg_received_total{grpc_method="Put"': "puts"}
    out = {v: 0.0 for v in want.values()}
    for line in text.splitlines():
        for prefix, name in want.items():
            if line.startswith(prefix):
                out[name] += float(line.rsplit(" ", 1)[1])
    return out


@dataclass
class AgentRates:
    agents: int
    seconds: float  # of agent time, at the agent's own intervals
    writes: float  # per agent per second
    renewals: float
    txns: float
    beats: int
    reports: int
    by_key: dict[str, float]  # keys written per agent per second, by their first part


async def _agent(i: int, url: str, token: str, speed: float, stop: asyncio.Event,
                 counts: dict[str, int]) -> None:
    from app.agent.gateway_client import GatewayClient

    name = f"scale-{i:05d}"
    client = GatewayClient([url], name, token, tls=_TLS)
    await client.start()
    rand = random.Random(i)
    loop = asyncio.get_running_loop()
    start = loop.time() - rand.uniform(0, REDISCOVER_S / speed)
    await asyncio.sleep(rand.uniform(0, HEARTBEAT_S / speed))
    last_report = float("-inf")
    try:
        while not stop.is_set():
            step = int((loop.time() - start) // (REDISCOVER_S / speed))
            await client.heartbeat(inventory(name, step=step))
            counts["beats"] += 1
            if loop.time() - last_report >= FULL_REPORT_S / speed:
                # Unchanged statuses, sent whole now and then (Agent.report);
                # this node has no replicas, so the report is empty.
                await client.report([])
                counts["reports"] += 1
                last_report = loop.time()
            await asyncio.sleep(HEARTBEAT_S / speed)
    finally:
        await client.close()


_TLS: Any = None


async def _count_puts(endpoint: str, prefix: str, kinds: dict[str, int]) -> None:
    """Counts the keys written under `prefix` by their first part (nodes,
    status, usage...): which writes the agents cause."""
    from app.store.etcd.store import EtcdStore

    store = await EtcdStore.open([endpoint], prefix)
    try:
        rev = (await store.range("nodes/")).revision
        async for batch in store.watch("", rev + 1):
            for ev in batch.events:
                kind = ev.key.split("/", 1)[0]
                kinds[kind] = kinds.get(kind, 0) + 1
    finally:
        await store.close()


async def agent_rates(endpoint: str, prefix: str, url: str, secret: str, agents: int,
                      seconds: float, speed: float) -> AgentRates:
    """Per agent per second (at the agent's real intervals) of etcd writes,
    lease renewals and Txn requests, less a baseline window."""
    import ssl

    from app.wire.tokens import node_token

    global _TLS
    _TLS = ssl.create_default_context()
    before = etcd_counters(endpoint)
    await asyncio.sleep(seconds)
    base = {k: v - before[k] for k, v in etcd_counters(endpoint).items()}
    stop = asyncio.Event()
    counts = {"beats": 0, "reports": 0}
    tasks = [asyncio.create_task(_agent(i, url, node_token(secret, f"scale-{i:05d}"), speed,
                                        stop, counts)) for i in range(agents)]
    # Every agent's first heartbeat grants a lease and puts: a start, not
    # the steady rate; the window begins a few heartbeat periods later.
    await asyncio.sleep(4 * HEARTBEAT_S / speed)
    kinds: dict[str, int] = {}
    watcher = asyncio.create_task(_count_puts(endpoint, prefix, kinds))
    before = etcd_counters(endpoint)
    beats0, reports0 = counts["beats"], counts["reports"]
    await asyncio.sleep(seconds)
    after = etcd_counters(endpoint)
    watcher.cancel()
    stop.set()
    await asyncio.gather(*tasks, return_exceptions=True)
    agent_s = agents * seconds * speed
    rate = {k: max(0.0, after[k] - before[k] - base[k]) / agent_s for k in after}
    return AgentRates(agents, agent_s, rate["writes"], rate["renewals"], rate["txns"],
                      counts["beats"] - beats0, counts["reports"] - reports0,
                      {k: v / agent_s for k, v in sorted(kinds.items())})


# -- what etcd sustains ------------------------------------------------------------


async def _load(endpoint: str, kind: str, seconds: float, clients: int, size: int,
                worker: int) -> int:
    from app.store.base import Put
    from app.store.etcd.store import EtcdStore

    store = await EtcdStore.open([endpoint], f"/sustain{worker}/")
    value = b"x" * size
    done = 0
    try:
        leases = [await store.grant(60) for _ in range(clients)]
        deadline = time.monotonic() + seconds

        async def one(c: int) -> None:
            nonlocal done
            while time.monotonic() < deadline:
                if kind == "put":
                    await store.txn([], [Put(f"nodes/n{c}", value, lease=leases[c])])
                else:
                    await store.keepalive(leases[c])
                done += 1

        await asyncio.gather(*(one(c) for c in range(clients)))
    finally:
        await store.close()
    return done


def sustained(endpoint: str, kind: str, seconds: float = 8.0, procs: int = 2,
              clients: int = 32, size: int = 2000) -> float:
    """Operations per second etcd committed for `procs` processes of
    `clients` concurrent callers each (`kind`: "put" or "keepalive")."""
    cmd = [sys.executable, str(Path(__file__)), "_load", endpoint, kind, str(seconds),
           str(clients), str(size)]
    start = time.monotonic()
    runs = [subprocess.Popen([*cmd, str(w)], cwd=ROOT, stdout=subprocess.PIPE, text=True)
            for w in range(procs)]
    total = 0
    for run in runs:
        out, _ = run.communicate(timeout=seconds + 120)
        total += int(out.strip().splitlines()[-1])
    return total / max(seconds, time.monotonic() - start - 1.5)  # less the start-up


# -- the mirror's memory --------------------------------------------------------------


async def mirror_mib(endpoint: str, prefix: str) -> tuple[float, int]:
    """MiB of Python heap a mirror loaded from etcd holds, with every typed
    view the control plane reads built, and the keys it holds."""
    from app.control.mirror import Mirror
    from app.store.etcd.store import EtcdStore

    store = await EtcdStore.open([endpoint], prefix)
    try:
        tracemalloc.start()
        base = tracemalloc.get_traced_memory()[0]
        mirror = Mirror(store)
        await mirror.resync()
        views = (mirror.models(), mirror.nodes(), mirror.replicas(), mirror.statuses(),
                 mirror.nodeconfs(), mirror.usages())
        held = tracemalloc.get_traced_memory()[0] - base
        tracemalloc.stop()
        keys = sum(1 for _ in mirror.items(""))
        del views, mirror
    finally:
        await store.close()
    return held / 2**20, keys


if __name__ == "__main__" and sys.argv[1:2] == ["_load"]:
    sys.path.insert(0, str(ROOT))
    _, _, ep, kind_, secs, n, sz, w = sys.argv
    print(asyncio.run(_load(ep, kind_, float(secs), int(n), int(sz), int(w))))
