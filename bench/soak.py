"""A month of uptime, compressed: does etcd's database stay bounded?

A fleet of `--nodes` simulated nodes (500) heartbeats and reports its
replicas' status through the real agent API, with the real agent's client
(`app.agent.gateway_client.GatewayClient`, what `llmgw agent` uses), across
`--gateways` (3) `llmgw serve` processes on an etcd of the benchmark's own,
while this script samples etcd's database size (its maintenance Status:
`dbSize`, the file; `dbSizeInUse`, the pages holding data). Run twice on a
fresh etcd each: with the leader's compaction (the figure) and with it off
(LLMGW_ETCD_COMPACTION_INTERVAL=0, the baseline).

Time is compressed by `--speed` S (default 12: an hour of the fleet in five
minutes): every period a real fleet has is divided by S (a node beats every
5/S s, sends a full status report every 15/S s; gateways compact every
300/S s, check usage every 2/S s, write it at least every 30/S s, write key
usage every 5/S s), so one wall second holds S seconds of a fleet's writes
and the slope is said per fleet hour (per wall hour x 1/S... i.e. MB per wall
second x 3600 / S). Worst case on purpose: every heartbeat carries a new GPU
utilisation and every status report a new `detail` (a starting engine's
progress), so each is a write; a real agent refreshes utilisation now and
then and a ready engine's status does not change. Each node holds one
replica (one GPU, `--nodes` / 10 models of 10 replicas), placed by the leader.
If this machine cannot keep up, fewer beats are made than asked: the achieved
rate (store revisions per fleet hour) is printed beside the figures.

    python bench/soak.py                               # ~11 min: 2 runs of 5 min
    python bench/soak.py --hours 0.25 --speed 6 --nodes 200    # a loaded machine

The last line is for scripts: `soak: etcd_db_mb_start=X etcd_db_mb_end=Y
slope_mb_per_hour=Z baseline_slope_mb_per_hour=W` (start, end, slope: the
compacting run's; slope: least squares over the run's second half, after
the fleet is placed and etcd's file has grown to its working size).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import ssl
import statistics
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from loop_seen import scrape  # noqa: E402
from peers import Process, free_port, http, wait_for  # noqa: E402

from app import __version__  # noqa: E402
from app.agent.gateway_client import GatewayClient, GatewayUnreachable  # noqa: E402
from app.wire.tokens import node_token  # noqa: E402

SECRET = "soak-secret-0123456789abcdef"
ADMIN = "soak-admin-token-0123456789"
# A real fleet's periods, in seconds, before compression.
HEARTBEAT_S, FULL_REPORT_S = 5.0, 15.0
COMPACTION_S, USAGE_S, USAGE_REFRESH_S, KEY_USAGE_S = 300.0, 2.0, 30.0, 5.0
MB = 1024 * 1024
TLS = ssl.create_default_context()


@dataclass
class Run:
    label: str
    samples: list[tuple[float, int, int]] = field(default_factory=list)  # t, dbSize, inUse
    beats: int = 0
    reports: int = 0
    failures: int = 0
    placed: int = 0  # nodes that know their replica
    revisions: int = 0
    seconds: float = 0.0
    # The first gateway's heap (app/gateway/gc_keeper.py): t, RSS, frozen
    # objects, reclaims, full collections (its one process's, at --workers 1).
    heap: list[tuple[float, int, int, int, int]] = field(default_factory=list)

    def slope_mb_per_hour(self, speed: float) -> float:
        """dbSize's least-squares slope over the second half, per fleet hour."""
        return _slope([(t, size / MB) for t, size, _ in self.samples], speed)

    def rss_slope_mb_per_hour(self, speed: float) -> float:
        """The first gateway's RSS, the same way."""
        return _slope([(t, rss / MB) for t, rss, *_ in self.heap], speed)


def heap_of(url: str, pid: int) -> tuple[int, int, int, int]:
    """A gateway's RSS (bytes), frozen objects, reclaims and full
    collections so far, from /proc and its /metrics."""
    rss = 0
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1]) * 1024
    got = scrape(url)
    return (rss, int(got.get(("llmgw_gc_frozen_objects", ()), 0)),
            int(got.get(("llmgw_gc_reclaims_total", ()), 0)),
            int(got.get(("llmgw_gc_pause_seconds_count", (("generation", "2"),)), 0)))


def _slope(points: list[tuple[float, float]], speed: float) -> float:
    half = points[len(points) // 2:]
    if len(half) < 2:
        return float("nan")
    return statistics.linear_regression([t for t, _ in half],
                                        [y for _, y in half]).slope * 3600 / speed


def etcd_status(client_url: str) -> dict[str, Any]:
    """etcd's maintenance Status (dbSize, dbSizeInUse), via its HTTP gateway."""
    req = urllib.request.Request(f"{client_url}/v3/maintenance/status", data=b"{}",
                                 method="POST")
    with urllib.request.urlopen(req, timeout=5.0) as resp:
        return dict(json.loads(resp.read()))


def readable(client_url: str, revision: int) -> str:
    """Whether etcd still serves a read at `revision` ("kept"/"compacted")."""
    body = json.dumps({"key": "AA==", "revision": revision, "count_only": True}).encode()
    req = urllib.request.Request(f"{client_url}/v3/kv/range", data=body, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=5.0) as resp:
            resp.read()
    except urllib.error.HTTPError as exc:
        return "compacted" if b"compacted" in exc.read() else f"error {exc.code}"
    return "kept"


async def node(i: int, urls: list[str], period: float, report_every: int,
               stop: asyncio.Event, run: Run) -> None:
    """One simulated agent: heartbeats, learns its replicas, reports them."""
    name = f"soak-{i:04d}"
    # One TLS context for all (unused on http): each default one loads the
    # system's CAs, a blocking tenth of a second on a loaded machine.
    client = GatewayClient(urls[i % len(urls):] + urls[:i % len(urls)], name,
                           node_token(SECRET, name), tls=TLS)
    await client.start()
    rand = random.Random(i)
    await asyncio.sleep(rand.uniform(0, period))  # not all in step
    replicas: list[str] = []
    beat = 0
    try:
        while not stop.is_set():
            beat += 1
            inventory = {"name": name, "address": "127.0.0.1", "engines": ["vllm"],
                         "version": __version__,
                         "gpus": [{"index": 0, "memory_mib": 81_920,
                                   "memory_free_mib": 2_000, "utilization": beat % 101}]}
            try:
                await client.heartbeat(inventory)
                run.beats += 1
                if beat % report_every == 1:
                    if not replicas:
                        got = await client.assignments("", 0.0)
                        replicas = [r["id"] for r in got["replicas"]]
                        run.placed += bool(replicas)
                    await client.report([
                        {"id": rid, "node": name, "phase": "starting",
                         "detail": f"loading weights, step {beat}", "updated": time.time()}
                        for rid in replicas])
                    run.reports += 1
            except GatewayUnreachable:
                run.failures += 1
            await asyncio.sleep(period)
    finally:
        await client.close()


def gateway_env(i: int, port: int, etcd: str, speed: float, compaction: bool,
                data: Path, workers: int = 1) -> dict[str, str]:
    env = dict(os.environ)
    env.update({
        "LLMGW_WORKERS": str(workers),
        "LLMGW_ETCD_ENDPOINTS": etcd, "LLMGW_SECRET": SECRET, "LLMGW_ADMIN_TOKEN": ADMIN,
        "LLMGW_GATEWAY_ID": f"soak-gw{i}", "LLMGW_PORT": str(port),
        "LLMGW_DATA_DIR": str(data / f"gw{i}"), "LLMGW_LOCAL_AGENT": "false",
        "LLMGW_LOG_LEVEL": "warning",
        "LLMGW_ETCD_COMPACTION_INTERVAL": str(COMPACTION_S / speed if compaction else 0),
        "LLMGW_USAGE_INTERVAL": str(USAGE_S / speed),
        "LLMGW_USAGE_REFRESH": str(USAGE_REFRESH_S / speed),
        "LLMGW_KEY_USAGE_INTERVAL": str(KEY_USAGE_S / speed),
    })
    return env


async def soak(args: argparse.Namespace, compaction: bool) -> Run:
    run = Run("compaction every %.0f s" % (COMPACTION_S / args.speed) if compaction
              else "compaction off (baseline)")
    etcd_bin = shutil.which("etcd") or "/usr/bin/etcd"
    with tempfile.TemporaryDirectory(prefix="soak-") as tmp_name:
        tmp = Path(tmp_name)
        client_port, peer_port = free_port(), free_port()
        client_url = f"http://127.0.0.1:{client_port}"
        procs = [Process("etcd", [
            etcd_bin, "--name", "soak", "--data-dir", str(tmp / "etcd"),
            "--listen-client-urls", client_url, "--advertise-client-urls", client_url,
            "--listen-peer-urls", f"http://127.0.0.1:{peer_port}",
            "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer_port}",
            "--initial-cluster", f"soak=http://127.0.0.1:{peer_port}",
            "--log-level", "warn"], tmp / "etcd.log").start()]
        try:
            wait_for(lambda: etcd_status(client_url), 15, "etcd", procs[0].alive)
            urls = []
            for i in range(args.gateways):
                port = free_port()
                urls.append(f"http://127.0.0.1:{port}")
                procs.append(Process(f"gw{i}", [sys.executable, "-m", "app.cli", "serve"],
                                     tmp / f"gw{i}.log", env=gateway_env(
                                         i, port, f"127.0.0.1:{client_port}", args.speed,
                                         compaction, tmp, args.workers)).start())
            for url, proc in zip(urls, procs[1:], strict=True):
                wait_for(ready(url), 60, f"{proc.name} ready", proc.alive)
            for m in range(max(1, args.nodes // 10)):
                status, body = http("PUT", f"{urls[0]}/admin/models/soak/m{m:03d}", {
                    "model": f"org/w{m:03d}", "gpus": 1, "replicas": {"min": 10, "max": 10}},
                    ADMIN)
                if status >= 300:
                    raise SystemExit(f"PUT model failed: {status} {body}")
            await measure(args, urls, client_url, run, procs[1].pid)
        finally:
            for proc in reversed(procs):
                proc.stop()
    return run


def ready(url: str) -> Callable[[], bool]:
    return lambda: http("GET", url + "/readyz")[0] == 200


async def measure(args: argparse.Namespace, urls: list[str], client_url: str,
                  run: Run, gw_pid: int) -> None:
    stop = asyncio.Event()
    period = HEARTBEAT_S / args.speed
    report_every = round(FULL_REPORT_S / HEARTBEAT_S)
    nodes = [asyncio.create_task(node(i, urls, period, report_every, stop, run))
             for i in range(args.nodes)]
    # Warm-up, not measured: every node registered and holding its replica.
    deadline = time.monotonic() + 120
    while run.placed < args.nodes and time.monotonic() < deadline:  # noqa: ASYNC110
        await asyncio.sleep(1)
    print(f"{run.label}: {run.placed} of {args.nodes} nodes hold their replica; measuring",
          flush=True)
    run.beats = run.reports = run.failures = 0
    wall = args.hours * 3600 / args.speed
    start = time.monotonic()
    first_revision = int(etcd_status(client_url)["header"]["revision"])
    revisions: list[tuple[float, int]] = []
    try:
        while (now := time.monotonic() - start) < wall:
            st = await asyncio.to_thread(etcd_status, client_url)
            revisions.append((now, int(st["header"]["revision"])))
            # History two compaction intervals old: gone with compaction on.
            old = [r for at, r in revisions if at <= now - 2 * COMPACTION_S / args.speed]
            kept = "-" if not old else await asyncio.to_thread(readable, client_url, old[-1])
            run.samples.append((now, int(st["dbSize"]), int(st.get("dbSizeInUse", 0))))
            rss, frozen, reclaims, fulls = await asyncio.to_thread(heap_of, urls[0], gw_pid)
            run.heap.append((now, rss, frozen, reclaims, fulls))
            print(f"{run.label}: t={now:6.1f} s  dbSize {int(st['dbSize']) / MB:7.2f} MB  "
                  f"in use {int(st.get('dbSizeInUse', 0)) / MB:7.2f} MB  "
                  f"revision {st['header']['revision']}, 2 intervals ago {kept}  "
                  f"beats {run.beats}  reports {run.reports}  failures {run.failures}  "
                  f"gw0: RSS {rss / MB:.1f} MB, frozen {frozen:,}, full collections {fulls}, "
                  f"reclaims {reclaims}", flush=True)
            await asyncio.sleep(args.sample)
    finally:
        stop.set()
        await asyncio.gather(*nodes, return_exceptions=True)
    run.seconds = time.monotonic() - start
    run.revisions = int(etcd_status(client_url)["header"]["revision"]) - first_revision


def summary(run: Run, speed: float) -> str:
    fleet_hours = run.seconds * speed / 3600
    return (f"{run.label}: {run.seconds:.0f} s wall = {fleet_hours:.2f} fleet hours; "
            f"{run.beats / fleet_hours:,.0f} heartbeats and {run.reports / fleet_hours:,.0f} "
            f"reports per fleet hour ({run.failures} failed); "
            f"{run.revisions / fleet_hours:,.0f} store revisions per fleet hour; dbSize "
            f"{run.samples[0][1] / MB:.2f} -> {run.samples[-1][1] / MB:.2f} MB (in use "
            f"{run.samples[-1][2] / MB:.2f} MB); slope {run.slope_mb_per_hour(speed):+.2f} "
            f"MB per fleet hour; gw0's RSS {run.heap[0][1] / MB:.1f} -> "
            f"{run.heap[-1][1] / MB:.1f} MB (slope {run.rss_slope_mb_per_hour(speed):+.2f} MB "
            f"per fleet hour), frozen objects {run.heap[0][2]:,} -> {run.heap[-1][2]:,}, "
            f"{run.heap[-1][4] - run.heap[0][4]} full collections and "
            f"{run.heap[-1][3] - run.heap[0][3]} reclaims over the run")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--nodes", type=int, default=500)
    parser.add_argument("--gateways", type=int, default=3)
    parser.add_argument("--workers", type=int, default=1,
                        help="processes per gateway (1: the heap figures are one process's)")
    parser.add_argument("--speed", type=float, default=12.0,
                        help="time compression: fleet seconds per wall second")
    parser.add_argument("--hours", type=float, default=1.0, help="fleet hours per run")
    parser.add_argument("--sample", type=float, default=5.0, help="wall seconds per sample")
    parser.add_argument("--no-baseline", action="store_true",
                        help="skip the run with compaction off")
    args = parser.parse_args()
    baseline = None if args.no_baseline else asyncio.run(soak(args, compaction=False))
    compacted = asyncio.run(soak(args, compaction=True))
    if baseline is not None:
        print(summary(baseline, args.speed))
    print(summary(compacted, args.speed))
    base_slope = baseline.slope_mb_per_hour(args.speed) if baseline else float("nan")
    print(f"soak: etcd_db_mb_start={compacted.samples[0][1] / MB:.2f} "
          f"etcd_db_mb_end={compacted.samples[-1][1] / MB:.2f} "
          f"slope_mb_per_hour={compacted.slope_mb_per_hour(args.speed):.2f} "
          f"baseline_slope_mb_per_hour={base_slope:.2f} "
          f"gw_rss_slope_mb_per_hour={compacted.rss_slope_mb_per_hour(args.speed):.2f} "
          f"gw_frozen_end={compacted.heap[-1][2]} "
          f"gw_reclaims={compacted.heap[-1][3] - compacted.heap[0][3]}")


if __name__ == "__main__":
    main()
