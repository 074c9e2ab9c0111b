"""The control plane at fleet scale: figures, not a timed test.

1. One placement + reconcile pass (`plan()`, app/control/plan.py, with its
   inputs built as the reconciler builds them: models, nodes, replicas,
   statuses, engine loads, scaling targets, floors) on synthetic fleets of
   250, 1,000 and 4,000 nodes x 8 GPUs carrying 500 models x 4 replicas of
   one GPU each: in steady state (every replica placed and ready) and with
   10% of the replicas missing (the pass places them).
2. A catalog edit on one of three in-process gateways, timed until the two
   others resolve it in their route tables, `--edits` times, against a real
   etcd of the benchmark's own that holds the 1,000-node fleet (so each
   edit wakes the leader's pass and every gateway's router rebuild).

Goal (docs/architecture.md, Scale): <= 50 ms per pass at 1,000 nodes,
growth no worse than linear (4,000 / 1,000 <= 4), edit p99 <= 300 ms.

    python bench/control_scale.py               # ~1 min
    python bench/control_scale.py --edits 20 --no-etcd-preload

The last line is for scripts:
`control_scale: pass_ms_1000=<median> growth_4000_over_1000=<ratio> edit_p99_ms=<p99>`.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import itertools
import logging
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))  # its throwaway etcd (etcd_server.py)

from app.control import state as s  # noqa: E402
from app.control.plan import Plan, plan, wanted  # noqa: E402
from app.control.scaling import Scaler  # noqa: E402

GPUS_PER_NODE = 8
MODELS = 500
REPLICAS_PER_MODEL = 4
NOW = 1_800_000_000.0


@dataclass
class Fleet:
    models: dict[str, s.StoredModel]
    nodes: dict[str, s.NodeInfo]
    replicas: dict[str, s.Replica]
    statuses: dict[str, s.ReplicaStatus]
    loads: dict[str, float]


def fleet(node_count: int) -> Fleet:
    """Every model's replicas spread round robin, one GPU each, all ready."""
    models = {
        f"org/model-{m:03d}": s.StoredModel.model_validate({
            "name": f"org/model-{m:03d}", "model": f"org/weights-{m:03d}", "gpus": 1,
            "replicas": {"min": REPLICAS_PER_MODEL, "max": REPLICAS_PER_MODEL},
            "aliases": [f"alias-{m:03d}"]})
        for m in range(MODELS)}
    nodes = {
        f"node-{n:04d}": s.NodeInfo(
            name=f"node-{n:04d}", address=f"10.{n // 250}.{n % 250}.1", engines=["vllm"],
            gpus=[s.GpuInfo(index=g, memory_mib=143_000) for g in range(GPUS_PER_NODE)])
        for n in range(node_count)}
    names = sorted(nodes)
    used: dict[str, int] = {}
    replicas: dict[str, s.Replica] = {}
    statuses: dict[str, s.ReplicaStatus] = {}
    loads: dict[str, float] = {}
    slot = itertools.count()
    for m, (name, spec) in enumerate(sorted(models.items())):
        for i in range(REPLICAS_PER_MODEL):
            node = names[next(slot) % node_count]
            gpu = used.get(node, 0)
            used[node] = gpu + 1
            rid = f"model-{m:03d}-{i:04x}"
            prof = spec.profile_list[0]
            replicas[rid] = s.Replica(
                id=rid, model=name, node=node, gpus=[gpu], engine=prof.engine,
                weights=spec.model or "", weights_revision=spec.revision, profile=prof.name,
                engine_args=list(prof.engine_args))
            statuses[rid] = s.ReplicaStatus(
                id=rid, node=node, phase="ready", url=f"http://{nodes[node].address}:8000")
            loads[rid] = float((m * 7 + i) % 16)
    return Fleet(models, nodes, replicas, statuses, loads)


def one_pass(f: Fleet, replicas: Mapping[str, s.Replica], suffix: Callable[[], str]) -> Plan:
    """What `Reconciler.tick()` computes between reading the mirror and
    writing: floors, the scaler's targets, and the plan."""
    floors = {name: wanted(spec, None, NOW) for name, spec in f.models.items()}
    scaler = Scaler(window=300.0, default_target=16)
    targets = scaler.step(f.models, replicas, f.loads, floors, 0.0)
    return plan(
        f.models, f.nodes, replicas, now=NOW, drain_seconds=60.0, new_suffix=suffix,
        absent_for={}, node_grace=30.0, statuses=f.statuses, failed=set(),
        inflight={}, last_used={}, idle_slack=0.0, nodeconfs={}, quotas={},
        targets=targets, loads=f.loads)


def time_passes(f: Fleet, missing: bool, repeat: int) -> tuple[float, Plan]:
    """Median ms of `repeat` passes; with `missing`, every 10th replica is gone."""
    replicas = ({rid: r for i, (rid, r) in enumerate(sorted(f.replicas.items())) if i % 10}
                if missing else f.replicas)
    times: list[float] = []
    result = Plan()
    for _ in range(repeat):
        counter = itertools.count()

        def suffix(c: itertools.count[int] = counter) -> str:
            return f"new{next(c):05d}"

        gc.collect()
        start = time.perf_counter()
        result = one_pass(f, replicas, suffix)
        times.append((time.perf_counter() - start) * 1000)
    expected = len(f.replicas) - len(replicas)
    if (len(result.create), len(result.drain), len(result.delete)) != (expected, 0, 0):
        raise SystemExit(f"unexpected plan: {len(result.create)} creates (want {expected}), "
                         f"{len(result.drain)} drains, {len(result.delete)} deletes, "
                         f"unplaced {dict(list(result.unplaced.items())[:3])}")
    return statistics.median(times), result


def passes(sizes: list[int], repeat: int) -> dict[int, tuple[float, float]]:
    out: dict[int, tuple[float, float]] = {}
    for n in sizes:
        f = fleet(n)
        steady, _ = time_passes(f, False, repeat)
        short, made = time_passes(f, True, repeat)
        out[n] = (steady, short)
        print(f"pass  {n:5d} nodes x {GPUS_PER_NODE} GPUs, {len(f.replicas)} replicas: "
              f"steady {steady:7.1f} ms   10% missing {short:7.1f} ms "
              f"({len(made.create)} placed)", flush=True)
    return out


# -- catalog edits across gateways ----------------------------------------------


async def _preload(endpoint: str, prefix: str, f: Fleet) -> None:
    """The fleet's state in etcd, 100 keys per transaction."""
    from app.store.base import Put
    from app.store.etcd import EtcdStore

    store = await EtcdStore.open([endpoint], prefix)
    try:
        puts: list[Put] = []
        for name, spec in f.models.items():
            puts.append(Put(s.MODELS + name, spec.model_dump_json().encode()))
        for name, info in f.nodes.items():
            puts.append(Put(s.NODES + name, info.model_dump_json().encode()))
        for rid, r in f.replicas.items():
            puts.append(Put(s.REPLICAS + rid, r.model_dump_json().encode()))
            # A closed loopback port: an engine load poll is refused at once
            # rather than waiting out a connect to an address nobody has.
            st = f.statuses[rid].model_copy(update={"url": "http://127.0.0.1:9"})
            puts.append(Put(s.STATUS + rid, st.model_dump_json().encode()))
        for i in range(0, len(puts), 100):
            res = await store.txn([], puts[i:i + 100])
            if not res.succeeded:
                raise SystemExit("preloading the fleet failed")
    finally:
        await store.close()


async def _no_poll() -> dict[str, Any]:
    return {}


async def edits(count: int, preload_nodes: int, engine_polls: bool = False) -> list[float]:
    import httpx
    from etcd_server import EtcdServer, find_etcd_binary

    from app.gateway.main import create_app
    from app.gateway.settings import Settings

    binary = find_etcd_binary()
    if binary is None:
        raise SystemExit("no etcd binary (apt-get install etcd-server)")
    admin = "bench-admin-token-0123456789"
    with tempfile.TemporaryDirectory(prefix="control-scale-") as tmp:
        server = EtcdServer(binary, Path(tmp) / "etcd" / "data")
        server.start()
        prefix = "/bench/"
        try:
            if preload_nodes:
                start = time.perf_counter()
                await _preload(server.endpoint, prefix, fleet(preload_nodes))
                print(f"edit  preloaded {preload_nodes} nodes' state in "
                      f"{time.perf_counter() - start:.1f} s", flush=True)
            apps = [create_app(Settings.model_validate({
                "etcd_endpoints": server.endpoint, "etcd_prefix": prefix,
                "secret": "bench-secret-0123456789abcdef", "admin_token": admin,
                "gateway_id": f"gw{i}", "port": 19500 + i, "data_dir": Path(tmp) / f"gw{i}",
                "local_agent": False})) for i in range(3)]
            for app in apps:
                if not engine_polls:
                    # Three gateways share this process's one event loop,
                    # where each would have its own: their engine load polls
                    # (every ready replica's /metrics, each second) would
                    # triple-count against the edit path. `--engine-polls`
                    # keeps them.
                    app.state.gateway.proxy.loads.poll = _no_poll
                await app.state.gateway.start()
            client = httpx.AsyncClient(transport=httpx.ASGITransport(app=apps[0]),
                                       base_url="http://gw",
                                       headers={"Authorization": f"Bearer {admin}"})
            try:
                return await _time_edits(apps, client, count)
            finally:
                await client.aclose()
                for app in apps:
                    await app.state.gateway.stop()
        finally:
            server.stop()


async def _until(pred: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
    deadline = time.perf_counter() + timeout
    while not pred():
        if time.perf_counter() > deadline:
            raise SystemExit(f"timed out waiting for {what}")
        await asyncio.sleep(0.001)


async def _time_edits(apps: list[Any], client: Any, count: int) -> list[float]:
    others = [app.state.gateway for app in apps[1:]]
    await _until(lambda: all(app.state.gateway.ready for app in apps), "gateways ready")
    name = "org/edited"
    body: dict[str, Any] = {"model": "org/edited-weights", "gpus": 1,
                            "replicas": {"min": 0, "max": 1}, "idle_timeout": 600}
    resp = await client.put(f"/admin/models/{name}", json=body)
    if resp.status_code >= 300:
        raise SystemExit(f"PUT failed: {resp.status_code} {resp.text}")
    await _until(lambda: all(gw.table.resolve(name) == name for gw in others), "the model")
    times: list[float] = []
    for i in range(count):
        alias = f"edited-alias-{i}"
        start = time.perf_counter()
        resp = await client.put(f"/admin/models/{name}", json={**body, "aliases": [alias]})
        if resp.status_code >= 300:
            raise SystemExit(f"PUT failed: {resp.status_code} {resp.text}")
        def seen(a: str = alias) -> bool:
            return all(gw.table.resolve(a) == name for gw in others)

        await _until(seen, f"alias {alias} on the other gateways")
        times.append((time.perf_counter() - start) * 1000)
    return times


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * len(ordered)) - 1))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--sizes", default="250,1000,4000", help="fleet sizes, in nodes")
    parser.add_argument("--repeat", type=int, default=5, help="passes per figure (median)")
    parser.add_argument("--edits", type=int, default=100)
    parser.add_argument("--engine-polls", action="store_true",
                        help="keep the gateways' engine load polls during the edits")
    parser.add_argument("--preload-nodes", type=int, default=1000,
                        help="fleet held in etcd during the edits (0: an empty store)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.ERROR)
    sizes = [int(n) for n in args.sizes.split(",")]
    figures = passes(sizes, args.repeat)
    base = figures.get(1000, figures[sizes[0]])
    print(f"goal  steady pass at 1000 nodes / 50 ms: x{base[0] / 50:.2f}; "
          f"10% missing / 50 ms: x{base[1] / 50:.2f}")
    for n, (steady, short) in figures.items():
        print(f"ratio {n:5d} / 1000 nodes: steady x{steady / base[0]:.2f}, "
              f"10% missing x{short / base[1]:.2f} (nodes x{n / 1000:.2f})")
    p99 = float("nan")
    if args.edits:
        times = asyncio.run(edits(args.edits, args.preload_nodes, args.engine_polls))
        p50, p99 = percentile(times, 0.5), percentile(times, 0.99)
        print("edit  each (ms):", " ".join(f"{t:.0f}" for t in times))
        print(f"edit  {len(times)} edits on gw0 until gw1 and gw2 resolve them: "
              f"p50 {p50:.1f} ms  p99 {p99:.1f} ms  max {max(times):.1f} ms "
              f"(p99 / goal 300 ms: x{p99 / 300:.2f})")
    growth = figures[4000][0] / base[0] if 4000 in figures else float("nan")
    print(f"control_scale: pass_ms_1000={base[0]:.1f} growth_4000_over_1000={growth:.2f} "
          f"edit_p99_ms={p99:.1f}")


if __name__ == "__main__":
    main()
