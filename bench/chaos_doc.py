"""docs/reliability.md and the last line, from bench/chaos.py's results."""

from __future__ import annotations

import datetime
import statistics
import subprocess
from pathlib import Path
from typing import Any

from chaos_rig import MODEL, REPLICAS, TTL
from peers import ROOT

# The section of docs/reliability.md kept by hand, which a run keeps.
HAND_BEGIN = "<!-- recorded by hand: begin -->"
HAND_END = "<!-- recorded by hand: end -->"


def kept_after(text: str, kept: str) -> str:
    """The run's page, then what was kept by hand."""
    return text.rstrip("\n") + "\n" + kept if kept else text


def _commit() -> str:
    """The commit the run's code is from: read once, as the run starts."""
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                            capture_output=True, text=True).stdout.strip() or "?"
    dirty = subprocess.run(["git", "status", "--porcelain", "--", "app", "bench", "tests"],
                           cwd=ROOT, capture_output=True, text=True).stdout.strip()
    return commit + (" with uncommitted changes" if dirty else "")


COMMIT = _commit()


def summary(results: list[Any]) -> dict[str, Any]:
    fo = [f for r in results for f in r.failovers]
    down = {k: sum(r.etcd_down.get(k, 0) for r in results)
            for k in ("ok", "refused", "killed", "target_down", "other")}
    return {
        "schedules": len(results),
        "leader_kills": sum(r.leader_kills for r in results),
        "failover_p50_s": round(statistics.median(fo), 2) if fo else "n/a",
        "failover_max_s": round(max(fo), 2) if fo else "n/a",
        "failed_other": sum(r.classes.get("other", 0) for r in results),
        "edits_lost": sum(len(r.edits_lost) for r in results),
        "gpu_double_holds": sum(len(r.gpu_double_holds) for r in results),
        "writes_after_lease": sum(len(r.writes_after_lease) for r in results),
        "engines_duplicated": results[-1].engines_duplicated if results else 0,
        "secrets_found": sum(len(r.secrets_found) for r in results),
        "stops_stuck": sum(len(r.stops_stuck) for r in results),
        "streams_cut_unexplained": sum(len(r.streams_cut_unexplained) for r in results),
        "limit_exceeded": sum(len(r.limit_exceeded) for r in results),
        "etcd_down_windows": sum(1 for r in results for f in r.faults if f == "etcd_down"),
        "etcd_down_served": down["ok"],
        "etcd_down_failed": sum(down.values()) - down["ok"],
        "etcd_down_failed_other": down["other"],
    }


def write(path: Path, seed: int, asked: int, faults: int, etcd_down_s: float,
          results: list[Any], s: dict[str, Any], failed: str = "") -> None:
    commit = COMMIT
    rows = "\n".join(
        f"| {r.seed} | {', '.join(r.faults)} | {r.requests} | {r.classes.get('ok', 0)} | "
        f"{r.classes.get('refused', 0)} | {r.classes.get('killed', 0)} | "
        f"{r.classes.get('target_down', 0)} | {r.classes.get('other', 0)} | {r.streams_cut} | "
        f"{' '.join(f'{f:.1f}' for f in r.failovers) or '-'} | "
        f"{_window(r.etcd_down, r.etcd_back_s)} | {r.edits} | "
        f"{r.replica_writes} | {r.engines_started} / {r.engines_needed} |" for r in results)
    fo = [f for r in results for f in r.failovers]
    done = ("complete" if len(results) == asked else f"then {failed}; the run ended there"
            if failed else "the run had not ended when this was written")
    back = [b for r in results for b in r.etcd_back_s]
    refusing = [b for r in results for b in r.etcd_refusing_s]
    # What is kept by hand after the run's figures (failovers measured
    # once, soaks) survives the rewrite, as it stood.
    old = path.read_text() if path.exists() else ""
    kept = ""
    if HAND_BEGIN in old and HAND_END in old:
        kept = "\n" + old[old.index(HAND_BEGIN):old.index(HAND_END) + len(HAND_END)] + "\n"
    path.write_text(kept_after(f"""# Reliability: llmgw under faults

Written by `python bench/chaos.py` (do not edit by hand): {datetime.date.today()},
commit {commit}, seed {seed}, {len(results)} of {asked} schedule(s) run ({done});
{faults} fault(s) a schedule. Replay one schedule on a fleet of its own with
`python bench/chaos.py --replay SEED --faults {faults}`.

A 3-member etcd, three gateways behind haproxy (compose/haproxy.cfg),
two agents with two GPUs each serving `{MODEL}` at {REPLICAS} replicas (the vLLM
stand-in), clients streaming and not (the `openai` client, retries off) through
haproxy and straight to gateways, one key with a concurrency limit in use, an
admin editing the catalog and client keys, an external model whose provider
key the gateways hold. The fleet stays up across the schedules; each schedule's
faults are drawn from its seed (the run's seed, plus one a schedule): SIGKILL
the leader gateway (restarted), SIGSTOP it past its lease
(LLMGW_LEASE_TTL={TTL} s) then SIGCONT, SIGKILL and restart an etcd member,
SIGKILL and restart an agent, SIGKILL a non-leader gateway, SIGTERM each
gateway in turn, SIGSTOP every etcd member for {etcd_down_s:g} s (then SIGCONT).

Every figure is read from evidence outside llmgw (bench/chaos_checks.py,
bench/chaos_secrets.py):

| figure | value | read from |
| --- | --- | --- |
| leader kills | {s['leader_kills']} | the harness |
| failover p50 / max (s) | {s['failover_p50_s']} / {s['failover_max_s']} | \
kill to a new `leader` key, seen by a live watch ({len(fo)} failovers) |
| failed requests, "other" | {s['failed_other']} | the clients, haproxy's log |
| streams cut where no gateway died | {s['streams_cut_unexplained']} | \
the clients, haproxy's log, the harness's kills |
| the limited key past its bound across the gateways (L + N - 1 streams at once) | \
{s['limit_exceeded']} | its client's streams |
| acknowledged edits lost | {s['edits_lost']} | the admin's answers, etcd at each schedule's end |
| GPUs held twice at a revision | {s['gpu_double_holds']} | etcd's `replicas/` history |
| `replicas/` writes not made under the live leader lease | {s['writes_after_lease']} | \
etcd's `leader` and `leader-write` history, lease TTLs |
| engines started beyond those needed | {s['engines_duplicated']} | the stand-ins' logs |
| gateways a SIGTERM did not stop within 120 s | {s['stops_stuck']} | the harness |
| secrets found in what the run captured | {s['secrets_found']} | logs, \
answers, command lines, etcd's values and history |
| etcd-down window served | {s['etcd_down_served']} served, {s['etcd_down_failed']} \
failed ({s['etcd_down_failed_other']} "other") in {s['etcd_down_windows']} window(s) \
of {etcd_down_s:g} s | the clients' requests sent while every member was stopped |
| etcd's return to a live leader lease (s) | {_span(back)} | etcd's `leader` key and lease |
| etcd's return to the last 503 (s) | {_span(refusing)} | \
the clients' requests in the minute after |

Failed requests are classed as refused (a 429 or 503 with a reason),
killed (in flight on a gateway SIGKILLed meanwhile), target down (sent
straight to a gateway that was not running) or other. "etcd down" is the
requests sent while every member was stopped: served / sent (other).

| seed | faults | requests | ok | refused | killed | target down | other | \
streams cut | failover s | etcd down | edits | `replicas/` writes | \
engines started / replicas placed (so far) |
| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |
{rows}
""", kept))


def _window(counts: dict[str, int], back: list[float]) -> str:
    if not counts:
        return "-"
    return (f"{counts.get('ok', 0)} / {sum(counts.values())} ({counts.get('other', 0)}), "
            f"leader in {' '.join(f'{b:.1f}' for b in back)} s")


def _span(values: list[float]) -> str:
    if not values:
        return "n/a"
    return f"{statistics.median(values):.1f} p50, {max(values):.1f} max"
