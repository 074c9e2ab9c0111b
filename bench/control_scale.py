"""The control plane at fleet scale: figures, not a timed test.

1. One placement + reconcile pass (`plan()`, app/control/plan/planner.py, with its
   inputs built as the reconciler builds them: models, nodes, replicas,
   statuses, engine loads, scaling targets, floors) on a synthetic fleet of
   10,000 nodes x 8 GPUs carrying 5,000 models x 4 replicas of one GPU
   each: in steady state (every replica placed and ready) and with 10% of
   the replicas missing (the pass places them). Wall and CPU time (the
   thread's): on a shared machine the wall time measures the others too.
   And a full fleet (bench/control_full.py): models waiting for room, and
   every model rolling at once; and a gateway's publish after one change
   (bench/control_publish.py); and the full collections of a gateway whose
   mirror is replaced as agents report (bench/control_gc.py).
2. A catalog edit on one of three `llmgw serve` processes on a real etcd
   holding 2,000 models (one replica each, on 250 nodes), timed from the
   PUT's answer until both others list the new alias on /v1/models
   (bench/control_edits.py).
3. etcd (bench/control_etcd.py): the writes, lease renewals and Txn
   requests simulated agents (the real agent client, the agent's
   intervals, through a real gateway) cost per agent, times 10,000; beside
   what this etcd sustains (puts of an inventory's size on lease-bound
   keys, lease renewals); and the Python heap a gateway's mirror takes
   loaded with the 10,000-node fleet.

Goal (docs/design/scale.md): a pass <= 200 ms at 10,000 nodes, edit
p99 <= 300 ms at 2,000 models, heartbeats within what etcd sustains.

    python bench/control_scale.py                      # ~9 min on 2 loaded cores
    python bench/control_scale.py --sizes 1000 --edits 20 --no-etcd

Writes its section of bench/RESULTS.md (between its markers) with the
load average before and after. The last line is for scripts:
`control_scale: pass_ms_10000= pass_cpu_ms_10000= gc_full_max_ms_10000= edit_p99_ms_2000=
etcd_writes_per_s_10000= etcd_sustained_puts_per_s= mirror_mib_10000=`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import itertools
import json
import logging
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import sections  # noqa: E402
from control_edits import preload  # noqa: E402
from control_fleet import MODELS, REPLICAS_PER_MODEL, Fleet, fleet  # noqa: E402
from control_full import full_passes  # noqa: E402
from control_gc import churn_pauses  # noqa: E402
from control_profile import pass_profile  # noqa: E402
from control_publish import publish_stream, publish_times  # noqa: E402

from app.control import state as s  # noqa: E402
from app.control.plan.phases import Plan  # noqa: E402
from app.control.plan.planner import PlanInput, PlanPolicy, plan, wanted  # noqa: E402
from app.control.plan.scaling import Scaler  # noqa: E402

GPUS_PER_NODE = 8
NOW = 1_800_000_000.0


def one_pass(f: Fleet, replicas: Mapping[str, s.Replica], suffix: Callable[[], str]) -> Plan:
    """What `Reconciler.tick()` computes between reading the mirror and
    writing: floors, the scaler's targets, and the plan."""
    floors = {name: wanted(spec, None, NOW) for name, spec in f.models.items()}
    scaler = Scaler(window=300.0, default_target=16)
    targets = scaler.step(f.models, replicas, f.loads, floors, 0.0)
    return plan(PlanInput(
            f.models, f.nodes, replicas, now=NOW, absent_for={}, statuses=f.statuses,
            failed=set(), inflight={}, last_used={}, nodeconfs={}, quotas={}, targets=targets,
            loads=f.loads),
            PlanPolicy(drain_seconds=60.0, new_suffix=suffix, node_grace=30.0, idle_slack=0.0))


def tenth_gone(f: Fleet) -> dict[str, s.Replica]:
    """The fleet's replicas less every 10th (by id): the 10%-missing pass's."""
    return {rid: r for i, (rid, r) in enumerate(sorted(f.replicas.items())) if i % 10}


@contextlib.contextmanager
def gateway_heap() -> Iterator[None]:
    """As a gateway holds its mirror: frozen once loaded, at its GC threshold
    (app/gateway/assembly.py); else each full collection walks the whole fleet."""
    from app.gateway.gc_keeper import thresholds

    before = gc.get_threshold()
    gc.collect()
    gc.freeze()
    gc.set_threshold(*thresholds(7000))
    try:
        yield
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)


def time_passes(f: Fleet, missing: bool, repeat: int) -> tuple[float, float, Plan]:
    """Median wall and CPU ms of `repeat` passes; with `missing`, every 10th
    replica is gone."""
    replicas = tenth_gone(f) if missing else f.replicas
    walls: list[float] = []
    cpus: list[float] = []
    result = Plan()
    for _ in range(repeat):
        counter = itertools.count()

        def suffix(c: itertools.count[int] = counter) -> str:
            return f"new{next(c):05d}"

        gc.collect()
        start, cpu = time.perf_counter(), time.thread_time()
        result = one_pass(f, replicas, suffix)
        walls.append((time.perf_counter() - start) * 1000)
        cpus.append((time.thread_time() - cpu) * 1000)
    expected = len(f.replicas) - len(replicas)
    if (len(result.create), len(result.drain), len(result.delete)) != (expected, 0, 0):
        raise SystemExit(f"unexpected plan: {len(result.create)} creates (want {expected}), "
                         f"{len(result.drain)} drains, {len(result.delete)} deletes, "
                         f"unplaced {dict(list(result.unplaced.items())[:3])}")
    return statistics.median(walls), statistics.median(cpus), result


def profile_missing(nodes: int, models: int) -> str:
    """bench/control_profile.py's profile of a pass with every 10th replica gone."""
    f = fleet(nodes, models)
    short = tenth_gone(f)
    suffixes = itertools.count()
    return pass_profile(lambda: one_pass(f, short, lambda: f"p{next(suffixes):05d}"))


# Per size: (steady wall, steady CPU, 10% missing wall, 10% missing CPU), ms,
# the fleet frozen as a gateway's mirror is; then the same with nothing frozen.
PassFigures = tuple[float, float, float, float, float, float, float, float]


def passes(sizes: list[int], models: int, repeat: int) -> dict[int, PassFigures]:
    out: dict[int, PassFigures] = {}
    for n in sizes:
        f = fleet(n, models)
        with gateway_heap():
            steady, steady_cpu, _ = time_passes(f, False, repeat)
            short, short_cpu, made = time_passes(f, True, repeat)
        # Nothing frozen: every full collection during a pass walks the fleet.
        loose = time_passes(f, False, repeat)[:2] + time_passes(f, True, repeat)[:2]
        out[n] = (steady, steady_cpu, short, short_cpu, *loose)
        print(f"pass  {n:5d} nodes x {GPUS_PER_NODE} GPUs, {len(f.models)} models, "
              f"{len(f.replicas)} replicas: steady {steady:.0f} ms (CPU {steady_cpu:.0f}), "
              f"10% missing {short:.0f} ms (CPU {short_cpu:.0f}; {len(made.create)} placed); "
              f"nothing frozen: steady {loose[0]:.0f} ms, 10% missing {loose[2]:.0f} ms"
              f"  load {load()}", flush=True)
    return out


def loop_stalls(f: Fleet, missing: bool = True) -> tuple[float, float]:
    """The longest an event loop waited while one pass ran on it (as the
    reconciler ran plan() before) and while one ran in a worker thread (as
    it does now, asyncio.to_thread): what a request on the leader gateway
    waits behind a pass, in ms. With the fleet not frozen, the thread's
    figure was ~300 ms here: collections walking the fleet, GIL held."""
    replicas = tenth_gone(f) if missing else f.replicas
    counter = itertools.count()

    def suffix() -> str:
        return f"new{next(counter):05d}"

    async def measure(inline: bool) -> float:
        worst, done = 0.0, False

        async def ticker() -> None:
            nonlocal worst
            while not done:
                t = time.perf_counter()
                await asyncio.sleep(0.001)
                worst = max(worst, time.perf_counter() - t - 0.001)

        tick = asyncio.create_task(ticker())
        await asyncio.sleep(0.01)
        if inline:
            one_pass(f, replicas, suffix)
            await asyncio.sleep(0.002)  # the ticker wakes late: that wait is the stall
        else:
            await asyncio.to_thread(one_pass, f, replicas, suffix)
        done = True
        await tick
        return worst * 1000

    with gateway_heap():
        return asyncio.run(measure(True)), asyncio.run(measure(False))


def load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * len(ordered)) - 1))]


def edit_figures(count: int, models: int) -> list[float]:
    from control_edits import edits

    async def fill(endpoint: str, prefix: str) -> str:
        await preload(endpoint, prefix, fleet(max(1, models // 8), models, 1))
        return f"{models} models, one replica each, on {max(1, models // 8)} nodes"

    return asyncio.run(edits(count, fill))


async def etcd_figures(nodes: int, models: int, agents: int, seconds: float,
                       speed: float) -> dict[str, float]:
    """What agents write per agent, what etcd sustains, the mirror's heap."""
    import control_etcd as ce
    from control_edits import Gateways
    from etcd_server import EtcdServer, find_etcd_binary

    binary = find_etcd_binary()
    if binary is None:
        raise SystemExit("no etcd binary (apt-get install etcd-server)")
    out: dict[str, float] = {}
    size = len(json.dumps(ce.inventory("node-00000")))
    with tempfile.TemporaryDirectory(prefix="control-etcd-") as tmp_name:
        tmp = Path(tmp_name)
        server = EtcdServer(binary, tmp / "etcd" / "data")
        server.start()
        try:
            out["puts"] = ce.sustained(server.endpoint, "put", size=size)
            out["renewals"] = ce.sustained(server.endpoint, "keepalive")
            print(f"etcd  sustained: {out['puts']:.0f} puts/s of {size} B on lease-bound "
                  f"keys, {out['renewals']:.0f} lease renewals/s (2 processes x 32 "
                  f"clients)  load {load()}", flush=True)
            # The node TTL sped up as the agents are: renewals once per third.
            ttl = {"LLMGW_NODE_TTL": str(max(3, round(ce.NODE_TTL_S / speed)))}
            gws = Gateways(tmp, server.endpoint, "/agents/", count=1, env=ttl)
            try:
                gws.wait_ready()
                r = await ce.agent_rates(server.endpoint, "/agents/", gws.urls[0], gws.secret,
                                         agents, seconds, speed)
            finally:
                gws.stop()
            out |= {"agent_writes": r.writes, "agent_renewals": r.renewals,
                    "agent_txns": r.txns}
            print(f"agent {r.agents} simulated agents, {r.seconds:.0f} agent-seconds at the "
                  f"agent's intervals / {speed:g} ({r.beats} heartbeats, {r.reports} "
                  f"reports): per agent per second {r.writes:.4f} writes, {r.renewals:.3f} "
                  f"lease renewals, {r.txns:.3f} Txn requests; keys written per agent per "
                  f"second: {r.by_key}  load {load()}", flush=True)
            f = fleet(nodes, models)
            await preload(server.endpoint, "/mirror/", f)
            out["mirror_mib"], keys = await ce.mirror_mib(server.endpoint, "/mirror/")
            print(f"mirror {nodes} nodes, {len(f.models)} models, {len(f.replicas)} replicas "
                  f"and statuses ({keys} keys): {out['mirror_mib']:.0f} MiB of Python heap "
                  f"with its views  load {load()}", flush=True)
        finally:
            server.stop()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--sizes", default="10000", help="fleet sizes, in nodes")
    parser.add_argument("--models", type=int, default=MODELS)
    parser.add_argument("--repeat", type=int, default=5, help="passes per figure (median)")
    parser.add_argument("--edits", type=int, default=100)
    parser.add_argument("--edit-models", type=int, default=2000)
    parser.add_argument("--no-etcd", action="store_true", help="skip part 3")
    parser.add_argument("--agents", type=int, default=40, help="simulated agents")
    parser.add_argument("--agent-seconds", type=float, default=25.0)
    parser.add_argument("--speed", type=float, default=5.0,
                        help="the agent's intervals divided by this")
    parser.add_argument("--results", type=Path, default=ROOT / "bench" / "RESULTS.md")
    args = parser.parse_args()
    logging.basicConfig(level=logging.ERROR)
    before, began = load(), time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    print(f"load  before: {before} (nproc {os.cpu_count()})", flush=True)
    sizes = [int(n) for n in args.sizes.split(",")]
    figures = passes(sizes, args.models, args.repeat)
    top = max(sizes)
    lines = [f"pass: {n:,} nodes x {GPUS_PER_NODE} GPUs, {args.models:,} models x "
             f"{REPLICAS_PER_MODEL} replicas, the fleet frozen as a gateway's mirror is: "
             f"steady {w:.0f} ms (CPU {c:.0f}), 10% missing {mw:.0f} ms (CPU {mc:.0f}); "
             f"with nothing frozen (full collections walking the fleet during the pass): "
             f"steady {lw:.0f} ms (CPU {lc:.0f}), 10% missing {lmw:.0f} ms (CPU {lmc:.0f}); "
             f"medians of {args.repeat}"
             for n, (w, c, mw, mc, lw, lc, lmw, lmc) in figures.items()]
    profile = profile_missing(top, args.models)
    print(profile, flush=True)
    for line in full_passes(fleet, top, NOW):
        lines.append(line)
        print(f"{line}  load {load()}", flush=True)
    pub = publish_times(fleet(top, args.models))
    lines.append(f"publish on a gateway's event loop, {top:,} nodes: after a status report "
                 f"{pub['status']:.0f} ms, a node's inventory {pub['node']:.0f} ms, a catalog "
                 f"edit {pub['catalog edit']:.0f} ms (bench/control_publish.py; medians of 5)")
    print(lines[-1], flush=True)
    stream = publish_stream(fleet(top, args.models))
    lines.append(f"publishing under 300 status reports a second, {top:,} nodes, 3 s: "
                 + "; ".join(f"{name} {v['publishes_per_s']:.1f} publishes/s taking "
                             f"{100 * v['loop_share']:.0f}% of the loop, a 10 ms timer late "
                             f"by p99 {v['lag_p99_ms']:.0f} ms (max {v['lag_max_ms']:.0f})"
                             for name, v in stream.items())
                 + " (bench/control_publish.py)")
    print(lines[-1], flush=True)
    churned = churn_pauses(top)
    plain, kept = churned["plain"], churned["kept"]
    lines.append(
        f"full collections while the mirror is replaced, {top:,} nodes, 300 simulated s of "
        f"290 writes/s and a loaded gateway's young collections (bench/control_gc.py): "
        f"frozen once only {plain['full']} of up to {plain['max_ms']:.0f} ms, "
        f"{plain['sum_ms']:.0f} ms in all; frozen again after each (app/gateway/"
        f"gc_keeper.py) {kept['full']} of up to {kept['max_ms']:.1f} ms, "
        f"{kept['sum_ms']:.0f} ms in all, {kept['reclaims']} reclaims")
    print(f"{lines[-1]}  load {load()}", flush=True)
    stall_inline, stall_thread = loop_stalls(fleet(top, args.models))
    lines.append(f"event loop stall behind one pass (10% missing, {top:,} nodes): on the loop "
                 f"{stall_inline:.0f} ms, in a worker thread (the reconciler's way) "
                 f"{stall_thread:.1f} ms")
    print(lines[-1], flush=True)
    p99 = float("nan")
    if args.edits:
        times = edit_figures(args.edits, args.edit_models)
        p50, p99 = percentile(times, 0.5), percentile(times, 0.99)
        print("edit  each (ms):", " ".join(f"{t:.0f}" for t in times))
        lines.append(f"edit: {len(times)} alias changes PUT on gw0 until gw1 and gw2 list "
                     f"them, {args.edit_models:,} models: p50 {p50:.1f} ms, p99 {p99:.1f} ms, "
                     f"max {max(times):.1f} ms")
        print(f"{lines[-1]}  load {load()}", flush=True)
    e: dict[str, float] = {}
    if not args.no_etcd:
        e = asyncio.run(etcd_figures(top, args.models, args.agents, args.agent_seconds,
                                     args.speed))
        lines.append(
            f"etcd: per agent {e['agent_writes']:.4f} writes/s, {e['agent_renewals']:.3f} "
            f"renewals/s, {e['agent_txns']:.3f} Txn/s; at 10,000 agents "
            f"{e['agent_writes'] * 10_000:.0f} writes/s, {e['agent_renewals'] * 10_000:.0f} "
            f"renewals/s; etcd sustains {e['puts']:.0f} puts/s, {e['renewals']:.0f} "
            f"renewals/s; mirror of {top:,} nodes {e['mirror_mib']:.0f} MiB")
    nan = float("nan")
    w, c, mw, mc, *_ = figures[top]
    summary = (f"control_scale: pass_ms_{top}={max(w, mw):.1f} pass_cpu_ms_{top}="
               f"{max(c, mc):.1f} loop_stall_ms_{top}={stall_thread:.1f} "
               f"gc_full_max_ms_{top}={kept['max_ms']:.1f} "
               f"gc_full_max_ms_{top}_frozen_once={plain['max_ms']:.1f} "
               f"publish_ms_{top}={max(pub.values()):.1f} "
               f"edit_p99_ms_{args.edit_models}={p99:.1f} "
               f"etcd_writes_per_s_10000={e.get('agent_writes', nan) * 10_000:.1f} "
               f"etcd_sustained_puts_per_s={e.get('puts', nan):.0f} "
               f"mirror_mib_{top}={e.get('mirror_mib', nan):.1f}")
    write_results(args.results, began, before, load(), lines, summary, profile, top)
    print(summary)


def write_results(path: Path, began: str, before: str, after: str, lines: list[str],
                  summary: str, profile: str, top: int) -> None:
    """Replaces this benchmark's section of `path`, leaving the others."""
    sections.replace_section(path, "control_scale", "\n".join([
        "## Control plane at fleet scale (bench/control_scale.py)", "",
        f"Written on {began}: nproc {os.cpu_count()}, load average {before} before, "
        f"{after} after (1, 5, 15 min). Wall times on a shared machine count the "
        "other sessions' work too; CPU times are the pass's own.", "",
        *[f"- {line}" for line in lines], "",
        f"### Where the pass's time goes: 10% missing, {top:,} nodes (bench/control_profile.py)",
        "", "```", profile, "```", "", summary]))

if __name__ == "__main__":
    main()
