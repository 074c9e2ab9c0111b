#!/usr/bin/env python3
"""llmgw's guarantees together, under load and faults (docs/reliability.md).

Starts the fleet of bench/chaos_rig.py once, puts clients on it (the
official `openai` client, retries off, streaming and not, through haproxy
and straight to gateways, one key with a concurrency limit) and an admin
editing the catalog and client keys through haproxy, then runs schedules of
faults on it, each drawn from its seed: SIGKILL the leader gateway (and
restart it), SIGSTOP it past its lease (then SIGCONT), SIGKILL and restart
an etcd member, SIGKILL and restart an agent, SIGKILL a non-leader gateway,
SIGTERM each gateway in turn, SIGSTOP every etcd member for 60 s. After each
schedule the checks (bench/chaos_checks.py, bench/chaos_secrets.py) read
etcd's history and the clients' own outcomes; nothing asks llmgw.

`python bench/chaos.py --schedules N --seed S [--faults K]` runs N
schedules (seeds S, S+1, ..., K faults each), rewrites docs/reliability.md
after each and prints as its last line `chaos: schedules= leader_kills=
failover_p50_s= failover_max_s= failed_other= edits_lost= gpu_double_holds=
writes_after_lease= engines_duplicated= secrets_found= ...`. `--replay SEED`
runs that one schedule again on a fleet of its own (faults and targets are
drawn from the seed alone; what the fleet went through before it is not
replayed). tests/test_chaos.py runs one short schedule.
"""

from __future__ import annotations

import argparse
import itertools
import random
import shutil
import signal
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
import chaos_doc as doc  # noqa: E402
import chaos_secrets as sec  # noqa: E402
from chaos_load import BOUND, Load  # noqa: E402
from chaos_rig import MODEL, REPLICAS, Rig  # noqa: E402
from chaos_secrets import Cmdlines  # noqa: E402
from peers import ROOT, http, wait_for  # noqa: E402

FAULTS = ["kill_leader", "stop_leader", "kill_etcd", "kill_agent", "kill_follower", "rolling",
          "etcd_down"]
ETCD_DOWN_S = 60.0  # the long form's etcd outage; the short form's is shorter
# A SIGTERMed gateway's notice (3 s) and its streams' end (each runs 4 s, a
# client gives up after 60): past this it is stuck.
STOP_WAIT = 120


@dataclass
class Result:
    """One schedule's figures: its own calls and kills, and what the
    checks over all the evidence so far found new in it."""

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
    leases_expired: int = 0  # leader leases etcd answered "TTL -1" for, so far
    engines_started: int = 0  # so far
    engines_needed: int = 0  # so far
    engines_duplicated: int = 0  # so far
    streams_cut: int = 0
    streams_cut_unexplained: list[str] = field(default_factory=list)
    limit_exceeded: list[str] = field(default_factory=list)
    etcd_down: dict[str, int] = field(default_factory=dict)  # the window's calls by class
    etcd_back_s: list[float] = field(default_factory=list)  # etcd's return to a live leader
    # etcd's return to the last request refused (503) in the minute after it
    etcd_refusing_s: list[float] = field(default_factory=list)
    etcd_refused_after: int = 0  # those 503s
    secrets_found: list[str] = field(default_factory=list)
    stops_stuck: list[str] = field(default_factory=list)  # gateways SIGTERM did not stop
    notes: list[str] = field(default_factory=list)


def schedule(seed: int, faults: int = 1) -> list[str]:
    """The faults of one schedule, in order: `faults` of the seven, drawn
    from the seed (which also draws the member and agent each one hits)."""
    return random.Random(seed).sample(FAULTS, faults)


class Chaos:
    def __init__(self, rig: Rig, etcd_down_s: float = ETCD_DOWN_S) -> None:
        self.rig, self.rng, self.etcd_down_s = rig, random.Random(0), etcd_down_s
        self.faults = checks.Faults()
        self.leader_kills: list[tuple[float, str]] = []
        self.etcd_back: list[float] = []
        self.stuck: list[str] = []  # gateways that did not stop on SIGTERM

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

    def etcd_down(self) -> None:
        """Every etcd member SIGSTOPped for `etcd_down_s`, then SIGCONTed.
        SIGSTOP rather than SIGKILL: the gateways' calls to etcd then hang
        until their own timeouts instead of being refused at once (the
        harder case for a request path that must not wait on etcd), and on
        SIGCONT etcd itself finds every lease past its TTL, so the gateway
        that led must win a new election (SIGKILL and a restart would extend
        every lease instead: etcd renews them on a new raft leader)."""
        t = time.monotonic()
        for m in self.rig.members:
            m.signal(signal.SIGSTOP)
        try:
            time.sleep(self.etcd_down_s)
        finally:
            for m in self.rig.members:
                m.signal(signal.SIGCONT)
        back = time.monotonic()
        self.faults.etcd_down.append((t, back))
        for m in self.rig.members:
            wait_for(m.healthy, 60, f"{m.name} healthy after the outage")
        wait_for(self.rig.live_leader, 60, "a leader with a live lease after the outage")
        self.etcd_back.append(time.monotonic() - back)

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
            try:
                g.wait_exit(STOP_WAIT)
            except subprocess.TimeoutExpired:  # a finding: SIGKILLed, and the run goes on
                tail = " | ".join(g.proc.tail().splitlines()[-3:]) if g.proc else ""
                self.stuck.append(f"{g.name} had not exited {STOP_WAIT} s after SIGTERM "
                                  f"(SIGKILLed): {tail}"[:400])
                self.kill_gateway(g.name)
            self.restart(g, t)
            time.sleep(3)  # haproxy's checks see it up (rise 2, 1 s apart)

    def settle(self) -> None:
        self.leader()
        for g in self.rig.gws:
            wait_for(g.ready, 90, f"{g.name} ready")
        time.sleep(3)


class Run:
    """One fleet, kept up across schedules: each schedule's faults hit it
    in turn, and after each the checks read all the evidence so far (etcd's
    history is read on from where the last read ended), so a schedule's
    findings are what is new since the one before."""

    def __init__(self, tmp: Path, etcd_down_s: float = ETCD_DOWN_S, log: Any = print) -> None:
        self.rig, self.log = Rig(tmp), log
        self.chaos = Chaos(self.rig, etcd_down_s)
        self.load: Load | None = None
        self.cmdlines = Cmdlines(self.rig.tag)
        self.events: list[checks.Event] = []
        self.counted = 0  # calls already given to a schedule
        self.found: dict[str, set[str]] = {
            "gpu": set(), "lease": set(), "edits": set(), "secrets": set()}
        self.results: list[Result] = []

    def __enter__(self) -> Run:
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> None:
        rig = self.rig
        rig.start()
        self.cmdlines.start()
        for name, spec in [(MODEL, {"model": "acme/chat", "gpus": 1,
                                    "replicas": {"min": REPLICAS, "max": REPLICAS}}),
                           ("remote", {"external": {  # a provider key the gateways hold
                               "url": "http://127.0.0.1:9", "model": "m",
                               "api_key_file": str(rig.tmp / "keys" / "provider.key")}})]:
            status, body = http("PUT", f"{rig.gws[0].url}/admin/models/{name}", spec, rig.admin)
            assert status in (200, 201), body
        self.load = Load(rig)
        self.load.prepare()
        self.load.start()
        self.chaos.settle()

    def schedule(self, seed: int, plan: list[str], last: bool = False) -> Result:
        """Runs `plan`, then the checks; `last`: the load stops first (its
        last calls are this schedule's) and the secrets grep runs (it also
        runs every 10th schedule, for a run stopped before its end)."""
        self.log(f"chaos: seed={seed} faults={','.join(plan)}")
        self.chaos.rng = random.Random(seed)
        kills, backs = len(self.chaos.leader_kills), len(self.chaos.etcd_back)
        stuck = len(self.chaos.stuck)
        downs = len(self.chaos.faults.etcd_down)
        for f in plan:
            t = time.monotonic()
            getattr(self.chaos, f)()
            self.chaos.settle()
            self.log(f"chaos: {f} done in {time.monotonic() - t:.1f} s")
        assert self.load is not None
        if last:
            self.load.stop()
            time.sleep(2)
        res = Result(seed, plan)
        res.etcd_back_s = self.chaos.etcd_back[backs:]
        res.stops_stuck = self.chaos.stuck[stuck:]
        self.gather(res, self.chaos.leader_kills[kills:], self.chaos.faults.etcd_down[downs:])
        if last or len(self.results) % 10 == 9:
            res.secrets_found = self.fresh("secrets", self.secrets())
        self.results.append(res)
        return res

    def gather(self, res: Result, kills: list[tuple[float, str]],
               windows: list[tuple[float, float]]) -> None:
        rig, load = self.rig, self.load
        assert load is not None
        load.pause_admin()  # no edit in flight while etcd's end state is read
        try:
            self.events += rig.history(start=self.events[-1].rev + 1 if self.events else 1)
            final: dict[str, int | None] = {
                k: int(v.get("idle_timeout") or 0)
                for k, v in rig.range("catalog/models/").items()}
            final |= {k: 1 for k in rig.range("keys/")}
            edits = list(load.edits)
        finally:
            load.resume_admin()
        events = self.events
        new = [e for e in events if e.key.startswith("replicas/")]
        res.replica_writes = len(new) - sum(r.replica_writes for r in self.results)
        res.gpu_double_holds = self.fresh("gpu", checks.gpu_double_holds(events))
        res.writes_after_lease = self.fresh(
            "lease", checks.writes_after_lease(events, dict(rig.dead)))
        res.leases_expired = len(rig.dead)
        res.edits = len(edits) - sum(r.edits for r in self.results)
        res.edits_lost = self.fresh("edits", checks.edits_lost(edits, final))
        with load._lock:
            calls = load.calls[self.counted:]
            self.counted += len(calls)
        names = {f"gateway{i + 1}": g.name for i, g in enumerate(rig.gws)}
        served = checks.haproxy_servers(rig.haproxy_log(), names)
        faults = self.chaos.faults
        res.requests = len(calls)
        res.classes = checks.classify(calls, served, faults)
        res.streams_cut = sum(1 for c in calls if c.cut)
        res.streams_cut_unexplained = checks.streams_cut_unexplained(calls, served, faults)
        res.limit_exceeded = checks.limit_exceeded(
            [c for c in calls if c.id.startswith("l-")], BOUND)
        for w in windows:
            got = checks.classify(checks.in_window(calls, w), served, faults)
            res.etcd_down = {k: res.etcd_down.get(k, 0) + v for k, v in got.items()}
            after = checks.in_window(calls, (w[1], w[1] + 60))
            refused = [c for c in after if c.status == 503]
            res.etcd_refused_after += len(refused)
            res.etcd_refusing_s.append(max([c.end - w[1] for c in refused], default=0.0))
        res.leader_kills = len(kills)
        res.failovers = checks.failovers(events, kills)
        starts = checks.engine_starts([rig.tmp / f"agent-node-{i}" for i in (1, 2)])
        res.engines_started = sum(starts.values())
        # Each replica placed needs one engine start, no more.
        res.engines_needed = len({e.key for e in new if e.kind == "put"})
        res.engines_duplicated = checks.engines_duplicated(starts, res.engines_needed)
        for c in calls:
            if c.status != 200 or c.cut:
                res.notes.append(f"{c.id} {c.target} stream={c.stream} status={c.status} "
                                 f"cut={c.cut} {c.reason or c.error}"[:200])

    def fresh(self, kind: str, found: list[str]) -> list[str]:
        out = [f for f in found if f not in self.found[kind]]
        self.found[kind].update(out)
        return out

    def secrets(self) -> list[str]:
        """The secrets grep over all this run captured (chaos_secrets)."""
        rig, load = self.rig, self.load
        assert load is not None
        self.cmdlines.sample()
        rids = {e.key.removeprefix("replicas/") for e in self.events
                if e.key.startswith("replicas/")}
        wanted = sec.secrets_of(rig.secret, rig.admin, rig.provider_key,
                                [f"node-{i}" for i in (1, 2)], rids, load.client_keys)
        return sec.find(wanted, itertools.chain(
            sec.files(rig.tmp), sec.answers(load.calls, load.answers),
            self.cmdlines.places(), sec.etcd_values(self.events, rig.dump()),
            ((f"the argv the rig gave {slot.name}", "\0".join(slot.argv).encode())
             for slot in [*rig.gws, *rig.agents])))

    def close(self) -> None:
        if self.load is not None:
            self.load.stop()
        self.cmdlines.stop()
        self.rig.stop()


def run_schedule(tmp: Path, seed: int, plan: list[str], etcd_down_s: float = ETCD_DOWN_S,
                 log: Any = print) -> Result:
    """One schedule on a fleet of its own (the short form, a replay)."""
    with Run(tmp, etcd_down_s, log) as run:
        return run.schedule(seed, plan, last=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--schedules", type=int, default=100)
    ap.add_argument("--seed", type=int, default=int(time.time()) % 100000)
    ap.add_argument("--faults", type=int, default=1, help="faults a schedule")
    ap.add_argument("--etcd-down-s", type=float, default=ETCD_DOWN_S)
    ap.add_argument("--replay", type=int, metavar="SEED",
                    help="one schedule, by its seed, on a fleet of its own")
    ap.add_argument("--doc", type=Path, default=ROOT / "docs" / "reliability.md")
    args = ap.parse_args()
    seeds = [args.replay] if args.replay is not None else [
        args.seed + i for i in range(args.schedules)]
    print(f"chaos: seed {seeds[0]}, {len(seeds)} schedule(s), {args.faults} fault(s) each",
          flush=True)
    tmp = Path(tempfile.mkdtemp(prefix="llmgw-chaos-"))
    failed = ""
    with Run(tmp, args.etcd_down_s, lambda s: print(s, flush=True)) as run:
        for i, seed in enumerate(seeds):
            try:
                r = run.schedule(seed, schedule(seed, args.faults), last=i == len(seeds) - 1)
            except Exception as exc:  # the fleet is in an unknown state: the run ends here
                failed = f"schedule {seed} failed: {exc!r}"[:300]
                print(f"chaos: {failed}; its logs are kept in {tmp}", flush=True)
                if args.replay is None:
                    doc.write(args.doc, seeds[0], len(seeds), args.faults, args.etcd_down_s,
                              run.results, doc.summary(run.results), failed)
                break
            for line in [*r.notes, *r.edits_lost, *r.gpu_double_holds, *r.writes_after_lease,
                         *r.streams_cut_unexplained, *r.limit_exceeded, *r.secrets_found,
                         *r.stops_stuck]:
                print("  " + line)
            print(f"chaos: schedule {r.seed} ({i + 1}/{len(seeds)}): {r.classes} "
                  f"failovers={r.failovers} etcd_down={r.etcd_down} edits={r.edits} "
                  f"replica_writes={r.replica_writes} leases_expired={r.leases_expired} "
                  f"engines_started={r.engines_started} engines_needed={r.engines_needed}",
                  flush=True)
            if args.replay is None:
                doc.write(args.doc, seeds[0], len(seeds), args.faults, args.etcd_down_s,
                          run.results, doc.summary(run.results))
        s = doc.summary(run.results)
    if not failed:
        shutil.rmtree(tmp, ignore_errors=True)
    print("chaos: " + " ".join(f"{k}={v}" for k, v in s.items())
          + (f" failed=1 (logs in {tmp})" if failed else ""))


if __name__ == "__main__":
    main()
