#!/usr/bin/env python3
"""llmgw's guarantees together, under load and faults (docs/reliability.md).

Starts the fleet of bench/chaos_rig.py, puts clients on it (the official
`openai` client, retries off, streaming and not, through haproxy and
straight to gateways, one key with a concurrency limit) and an admin editing
the catalog and client keys through haproxy, then runs a schedule of faults
drawn from the seed: SIGKILL the leader gateway (and restart it), SIGSTOP it
past its lease (then SIGCONT), SIGKILL and restart an etcd member, SIGKILL
and restart an agent, SIGKILL a non-leader gateway, SIGTERM each gateway in
turn. The checks (bench/chaos_checks.py) read etcd's history and the
clients' own outcomes; nothing asks llmgw.

`python bench/chaos.py --schedules N --seed S` runs N schedules (seeds S,
S+1, ...), writes docs/reliability.md and prints as its last line
`chaos: schedules= leader_kills= failover_p50_s= failover_max_s= failed_other=
edits_lost= gpu_double_holds= writes_after_lease= engines_duplicated=`.
tests/test_chaos.py runs one short schedule.
"""

from __future__ import annotations

import argparse
import datetime
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

for _p in (str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)):
    if _p not in sys.path:
        sys.path.insert(0, _p)
import chaos_checks as checks  # noqa: E402
from chaos_load import Load  # noqa: E402
from chaos_rig import MODEL, REPLICAS, TTL, Rig  # noqa: E402
from peers import ROOT, http, wait_for  # noqa: E402

FAULTS = ["kill_leader", "stop_leader", "kill_etcd", "kill_agent", "kill_follower", "rolling"]


@dataclass
class Result:
    seed: int
    faults: list[str]
    requests: int = 0
    classes: dict[str, int] = field(default_factory=dict)
    failovers: list[float] = field(default_factory=list)
    leader_kills: int = 0
    edits: int = 0
    edits_lost: list[str] = field(default_factory=list)
    gpu_double_holds: list[str] = field(default_factory=list)
    writes_after_lease: list[str] = field(default_factory=list)
    replica_writes: int = 0
    leases_expired: int = 0  # leader leases etcd answered "TTL -1" for
    engines_started: int = 0
    engines_needed: int = 0
    engines_duplicated: int = 0
    notes: list[str] = field(default_factory=list)


def schedule(seed: int, faults: int = len(FAULTS)) -> list[str]:
    """The faults of one schedule, in order: `faults` of the six, drawn."""
    rng = random.Random(seed)
    return rng.sample(FAULTS, faults)


class Chaos:
    def __init__(self, rig: Rig, rng: random.Random) -> None:
        self.rig, self.rng = rig, rng
        self.faults = checks.Faults()
        self.leader_kills: list[tuple[float, str]] = []

    def gw(self, name: str) -> Any:
        return next(g for g in self.rig.gws if g.name == name)

    def leader(self) -> str:
        return str(wait_for(self.rig.leader_id, 60, "a leader key"))

    def restart(self, slot: Any, since: float) -> None:
        slot.start()
        wait_for(slot.ready, 90, f"{slot.name} ready again")
        self.faults.down[slot.name].append((since, time.monotonic()))

    def kill_gateway(self, name: str) -> float:
        t = time.monotonic()
        self.gw(name).signal(signal.SIGKILL)
        self.faults.kills[name].append(t)
        self.gw(name).wait_exit(10)
        return t

    def kill_leader(self) -> None:
        old = self.leader()
        t = self.kill_gateway(old)
        self.leader_kills.append((t, old))
        wait_for(lambda: self.rig.leader_id() not in ("", old), 60, "a new leader")
        self.restart(self.gw(old), t)

    def stop_leader(self) -> None:
        old = self.leader()
        slot, t = self.gw(old), time.monotonic()
        slot.signal(signal.SIGSTOP)
        try:  # past its lease: another gateway leads, then 2 s more
            wait_for(lambda: self.rig.leader_id() not in ("", old), 60, "a leader after a stop")
            time.sleep(2)
        finally:
            slot.signal(signal.SIGCONT)
        wait_for(slot.ready, 60, f"{old} serving after SIGCONT")
        self.faults.down[old].append((t, time.monotonic()))

    def kill_etcd(self) -> None:
        m = self.rng.choice(self.rig.members)
        m.kill()
        time.sleep(2)
        m.start(self.rig.env())
        wait_for(m.healthy, 60, f"{m.name} healthy again")

    def kill_agent(self) -> None:
        a = self.rng.choice(self.rig.agents)
        a.signal(signal.SIGKILL)  # its group: its engines run on in theirs
        a.wait_exit(10)
        time.sleep(1)
        a.start()

    def kill_follower(self) -> None:
        lead = self.leader()
        name = self.rng.choice([g.name for g in self.rig.gws if g.name != lead])
        t = self.kill_gateway(name)
        time.sleep(1)
        self.restart(self.gw(name), t)

    def rolling(self) -> None:
        for g in self.rig.gws:
            t = time.monotonic()
            g.signal(signal.SIGTERM, group=False)
            g.wait_exit(120)
            self.restart(g, t)
            time.sleep(3)  # haproxy's checks see it up (rise 2, 1 s apart)

    def settle(self) -> None:
        self.leader()
        for g in self.rig.gws:
            wait_for(g.ready, 90, f"{g.name} ready")
        time.sleep(3)


def run_schedule(tmp: Path, seed: int, faults: int = len(FAULTS),
                 log: Any = print) -> Result:
    plan = schedule(seed, faults)
    log(f"chaos: seed={seed} faults={','.join(plan)}")
    res = Result(seed, plan)
    rig = Rig(tmp)
    load: Load | None = None
    try:
        rig.start()
        status, body = http("PUT", f"{rig.gws[0].url}/admin/models/{MODEL}", {
            "model": "acme/chat", "gpus": 1, "replicas": {"min": REPLICAS, "max": REPLICAS}},
            rig.admin)
        assert status in (200, 201), body
        load = Load(rig)
        load.prepare()
        load.start()
        chaos = Chaos(rig, random.Random(seed))
        chaos.settle()
        for f in plan:
            t = time.monotonic()
            getattr(chaos, f)()
            chaos.settle()
            log(f"chaos: {f} done in {time.monotonic() - t:.1f} s")
        load.stop()
        time.sleep(2)
        gather(rig, load, chaos, res)
    finally:
        if load is not None:
            load.stop()
        rig.stop()
    return res


def gather(rig: Rig, load: Load, chaos: Chaos, res: Result) -> None:
    events = rig.history()
    res.replica_writes = sum(1 for e in events if e.key.startswith("replicas/"))
    res.gpu_double_holds = checks.gpu_double_holds(events)
    res.writes_after_lease = checks.writes_after_lease(events, dict(rig.dead))
    res.leases_expired = len(rig.dead)
    final: dict[str, int | None] = {}
    for k, v in rig.range("catalog/models/").items():
        final[k] = int(v.get("idle_timeout") or 0)
    for k in rig.range("keys/"):
        final[k] = 1
    res.edits = len(load.edits)
    res.edits_lost = checks.edits_lost(load.edits, final)
    names = {f"gateway{i + 1}": g.name for i, g in enumerate(rig.gws)}
    served = checks.haproxy_servers(rig.haproxy_log(), names)
    res.requests = len(load.calls)
    res.classes = checks.classify(load.calls, served, chaos.faults)
    res.leader_kills = len(chaos.leader_kills)
    res.failovers = checks.failovers(events, chaos.leader_kills)
    starts = checks.engine_starts([rig.tmp / f"agent-node-{i}" for i in (1, 2)])
    res.engines_started = sum(starts.values())
    # Each replica placed needs one engine start, no more.
    res.engines_needed = len({e.key for e in events
                              if e.key.startswith("replicas/") and e.kind == "put"})
    res.engines_duplicated = checks.engines_duplicated(starts, res.engines_needed)
    for c in load.calls:
        if c.status != 200 or c.cut:
            res.notes.append(f"{c.id} {c.target} stream={c.stream} status={c.status} "
                             f"cut={c.cut} {c.reason or c.error}"[:200])


def summary(results: list[Result]) -> dict[str, Any]:
    fo = [f for r in results for f in r.failovers]
    return {
        "schedules": len(results),
        "leader_kills": sum(r.leader_kills for r in results),
        "failover_p50_s": round(statistics.median(fo), 2) if fo else "n/a",
        "failover_max_s": round(max(fo), 2) if fo else "n/a",
        "failed_other": sum(r.classes.get("other", 0) for r in results),
        "edits_lost": sum(len(r.edits_lost) for r in results),
        "gpu_double_holds": sum(len(r.gpu_double_holds) for r in results),
        "writes_after_lease": sum(len(r.writes_after_lease) for r in results),
        "engines_duplicated": sum(r.engines_duplicated for r in results),
    }


def write_doc(path: Path, seed: int, results: list[Result], s: dict[str, Any]) -> None:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                            capture_output=True, text=True).stdout.strip() or "?"
    dirty = subprocess.run(["git", "status", "--porcelain", "--", "app", "bench", "tests"],
                           cwd=ROOT, capture_output=True, text=True).stdout.strip()
    commit += " with uncommitted changes" if dirty else ""
    rows = "\n".join(
        f"| {r.seed} | {', '.join(r.faults)} | {r.requests} | {r.classes.get('ok', 0)} | "
        f"{r.classes.get('refused', 0)} | {r.classes.get('killed', 0)} | "
        f"{r.classes.get('target_down', 0)} | {r.classes.get('other', 0)} | "
        f"{' '.join(f'{f:.1f}' for f in r.failovers) or '-'} | {r.edits} | "
        f"{r.replica_writes} | {r.engines_started} / {r.engines_needed} |" for r in results)
    path.write_text(f"""# Reliability: llmgw under faults

Written by `python bench/chaos.py` (do not edit by hand): {datetime.date.today()},
commit {commit}, seed {seed}, {len(results)} schedule(s) run.

A 3-member etcd, three gateways behind haproxy (compose/haproxy.cfg),
two agents with two GPUs each serving `{MODEL}` at {REPLICAS} replicas (the vLLM
stand-in), clients streaming and not (the `openai` client, retries off) through
haproxy and straight to gateways, one key with a concurrency limit in use, an
admin editing the catalog and client keys. Faults, in an order drawn from the
seed: SIGKILL the leader gateway (restarted), SIGSTOP it past its lease
(LLMGW_LEASE_TTL={TTL} s) then SIGCONT, SIGKILL and restart an etcd member,
SIGKILL and restart an agent, SIGKILL a non-leader gateway, SIGTERM each
gateway in turn.

Every figure is read from evidence outside llmgw (bench/chaos_checks.py):

| figure | value | read from |
| --- | --- | --- |
| leader kills | {s['leader_kills']} | the harness |
| failover p50 / max (s) | {s['failover_p50_s']} / {s['failover_max_s']} | \
kill to a new `leader` key, seen by a live watch |
| failed requests, "other" | {s['failed_other']} | the clients, haproxy's log |
| acknowledged edits lost | {s['edits_lost']} | the admin's answers, etcd at the end |
| GPUs held twice at a revision | {s['gpu_double_holds']} | etcd's `replicas/` history |
| `replicas/` writes with no live leader lease | {s['writes_after_lease']} | \
etcd's `leader` history, lease TTLs |
| engines started beyond those needed | {s['engines_duplicated']} | the stand-ins' logs |

Failed requests are classed as refused (a 429 or 503 with a reason),
killed (in flight on a gateway SIGKILLed meanwhile), target down (sent
straight to a gateway that was not running) or other:

| seed | faults | requests | ok | refused | killed | target down | other | \
failover s | edits | `replicas/` writes | engines started / replicas placed |
| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |
{rows}

Not run yet: etcd stopped entirely for 60 s (the long form's last fault).
""")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--schedules", type=int, default=3)
    ap.add_argument("--seed", type=int, default=int(time.time()) % 100000)
    ap.add_argument("--doc", type=Path, default=ROOT / "docs" / "reliability.md")
    args = ap.parse_args()
    print(f"chaos: seed {args.seed}", flush=True)
    results = []
    for i in range(args.schedules):
        with tempfile.TemporaryDirectory(prefix="llmgw-chaos-") as tmp:
            r = run_schedule(Path(tmp), args.seed + i,
                             log=lambda s: print(s, flush=True))
        for line in [*r.notes, *r.edits_lost, *r.gpu_double_holds, *r.writes_after_lease]:
            print("  " + line)
        print(f"chaos: schedule {r.seed}: {r.classes} failovers={r.failovers} "
              f"edits={r.edits} replica_writes={r.replica_writes} "
              f"leases_expired={r.leases_expired} "
              f"engines_started={r.engines_started} engines_needed={r.engines_needed}", flush=True)
        results.append(r)
    s = summary(results)
    write_doc(args.doc, args.seed, results, s)
    print("chaos: " + " ".join(f"{k}={v}" for k, v in s.items()))


if __name__ == "__main__":
    main()

