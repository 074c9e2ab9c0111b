"""The checks bench/chaos.py runs after a schedule of faults, each a pure
function of evidence gathered outside llmgw: etcd's own history (every event
under the prefix from revision 1, read back with a watch), the times the
harness saw those events and did its kills, the leases etcd said were gone,
what clients and the admin were answered, haproxy's log and the engines' own
logs. None asks a gateway what it thinks (docs/architecture.md, "Invariants").

Each check was seen to fail on a history that breaks what it guards
(tests/test_chaos.py, the `test_*_flags_*` tests), and on a real run of
bench/chaos.py's short form against a scratch copy of llmgw broken on
purpose (then thrown away): each docstring says how ("Broken llmgw").
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Event:
    """One event of etcd's history: `key` relative to the prefix."""

    rev: int
    key: str
    kind: str  # "put" | "delete"
    value: dict[str, Any] | None = None
    lease: int = 0
    create_rev: int = 0
    seen: float = 0.0  # when the harness's live watch got it (monotonic); 0 = not seen live
    raw: str = ""  # the value as etcd holds it (the secrets grep reads it)


def by_revision(events: Iterable[Event]) -> list[list[Event]]:
    groups: dict[int, list[Event]] = defaultdict(list)
    for e in events:
        groups[e.rev].append(e)
    return [groups[r] for r in sorted(groups)]


def gpu_double_holds(events: Iterable[Event]) -> list[str]:
    """GPUs held by two replicas at one revision: `replicas/` replayed
    revision by revision, each (node, GPU) claimed by at most one replica.
    Seen to fail: two replicas put on node-1 GPU 0 by one history. Broken
    llmgw: the placer seeing no GPU taken (its count of GPUs taken reading no
    replica): "revision 20: node-2 GPU 0 held by ['chat-6fee7407',
    'chat-a85084f6']" in a two-fault run."""
    held: dict[str, tuple[str, tuple[int, ...]]] = {}
    found: set[tuple[str, int, frozenset[str]]] = set()
    out = []
    for group in by_revision(events):
        touched = False
        for e in group:
            if not e.key.startswith("replicas/"):
                continue
            touched = True
            rid = e.key.removeprefix("replicas/")
            if e.kind == "delete" or e.value is None:
                held.pop(rid, None)
            else:
                held[rid] = (str(e.value.get("node")),
                             tuple(int(g) for g in e.value.get("gpus") or []))
        if not touched:
            continue
        owners: dict[tuple[str, int], list[str]] = defaultdict(list)
        for rid, (node, gpus) in held.items():
            for g in gpus:
                owners[(node, g)].append(rid)
        for (node, g), rids in owners.items():
            if len(rids) > 1 and (node, g, frozenset(rids)) not in found:
                found.add((node, g, frozenset(rids)))
                out.append(f"revision {group[0].rev}: {node} GPU {g} held by {sorted(rids)}")
    return out


def writes_after_lease(events: Iterable[Event], dead: dict[int, int]) -> list[str]:
    """Writes to `replicas/` by anyone but the live leader. Every fenced
    leader transaction puts `leader-write` `{id, lease}` beside its writes
    (docs/architecture.md, "State"), so the history names each write's
    writer: it must be the lease the `leader` key was bound to at that
    revision (a transaction does not touch the key), that lease must not
    have been seen gone (`dead`: lease id -> the revision etcd answered
    "TTL -1" at) before it, and the key must be there. Seen to fail: a
    replica put after the leader key's delete, one after its lease was
    reported expired, one signed by another lease than the leader key's, and
    one unsigned (tests/test_chaos.py). Broken llmgw: with the fence gone
    (`Elector.fence()` returning no compare) and a gateway that once led
    leading for good (`is_leader` true ever after), the schedule
    stop_leader, etcd_down, stop_leader (seed 12, etcd down 8 s) reported 5
    writes, e.g. "revision 167: put replicas/churn-18edaf1a by gw0 under
    lease 4651270858288875631, while the leader key was gw1's, lease
    363844013032171325" and "revision 124: delete replicas/churn-cddeb55f
    by gw0 with no leader key" (gpu_double_holds caught 2 of them)."""
    leader: Event | None = None
    out = []
    for group in by_revision(events):
        writes = [e for e in group if e.key.startswith("replicas/")]
        signed = next((e for e in group if e.key == "leader-write" and e.kind == "put"), None)
        by = (signed.value or {}) if signed is not None else {}
        for w in writes:
            what = f"revision {w.rev}: {w.kind} {w.key}"
            if signed is None:
                out.append(f"{what} with no leader-write beside it")
            elif leader is None:
                out.append(f"{what} by {by.get('id')} with no leader key")
            elif by.get("lease") != leader.lease:
                out.append(f"{what} by {by.get('id')} under lease {by.get('lease')}, while the "
                           f"leader key was {(leader.value or {}).get('id')}'s, lease "
                           f"{leader.lease}")
            elif leader.lease in dead and dead[leader.lease] < w.rev:
                out.append(f"{what} by {by.get('id')}, whose lease {leader.lease} was gone "
                           f"at revision {dead[leader.lease]}")
        for e in group:
            if e.key == "leader":
                leader = e if e.kind == "put" else None
    return out


@dataclass
class Edit:
    """One admin write: the etcd key it targets and what it leaves there
    (`marker`: a number read back from the value; None: the key absent)."""

    key: str
    marker: int | None
    acked: bool


def edits_lost(edits: Iterable[Edit], final: dict[str, int | None]) -> list[str]:
    """Acknowledged edits missing at the end: a key's final marker must be
    its last acknowledged edit's, or that of a later edit whose outcome the
    admin did not learn. Seen to fail: an acknowledged put absent at the end.
    Broken llmgw: a catalog change to `edit-1` answered as made but never
    written (its ops dropped, only `catalog/serial` bumped, app/api/admin.py):
    "catalog/models/edit-1: None at the end, acknowledged 657"."""
    per_key: dict[str, list[Edit]] = defaultdict(list)
    for e in edits:
        per_key[e.key].append(e)
    out = []
    for key, ops in per_key.items():
        acked = [i for i, op in enumerate(ops) if op.acked]
        if not acked:
            continue
        allowed = {op.marker for op in ops[acked[-1]:] if op is ops[acked[-1]] or not op.acked}
        got = final.get(key)
        if got not in allowed:
            out.append(f"{key}: {got!r} at the end, acknowledged {ops[acked[-1]].marker!r}")
    return out


@dataclass
class Call:
    """One client request as the client saw it."""

    id: str
    target: str  # "haproxy" or a gateway's name
    stream: bool
    start: float
    end: float
    status: int = 200  # 0: no HTTP answer (connection failed or cut)
    reason: str = ""  # the error's message, for an HTTP error
    cut: bool = False  # a stream that ended without its finish_reason
    error: str = ""
    answered: float = 0.0  # when the answer's head came (a stream's first byte)
    finished: float = 0.0  # when a stream's finish_reason came; 0: never
    body: str = ""  # what the client was answered (the secrets grep reads it)


@dataclass
class Faults:
    """What the harness did, on the monotonic clock: SIGKILLs per process
    name, and windows in which a gateway was not serving (from its signal
    until it was ready again)."""

    kills: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    down: dict[str, list[tuple[float, float]]] = field(default_factory=lambda: defaultdict(list))
    etcd_down: list[tuple[float, float]] = field(default_factory=list)  # every member stopped


def classify(calls: Iterable[Call], served_by: dict[str, str], faults: Faults,
             slack: float = 1.0) -> dict[str, int]:
    """Every failed call is `refused` (a 429 or 503 with a reason),
    `killed` (in flight on a gateway SIGKILLed while it ran: the gateway
    named by haproxy's log for it, or the one it was sent to),
    `target_down` (sent straight to a gateway that was not running) or
    `other`; streams cut elsewhere are `other` too. Seen to fail: a cut
    stream on a gateway no one killed is `other`. Broken llmgw: the relay
    breaking off 2 % of its streams' chunks (see streams_cut_unexplained):
    failed "other" = 11."""
    counts = {"ok": 0, "refused": 0, "killed": 0, "target_down": 0, "other": 0}
    for c in calls:
        if c.status == 200 and not c.cut:
            counts["ok"] += 1
            continue
        if c.status in (429, 503) and c.reason:
            counts["refused"] += 1
            continue
        gw = c.target if c.target != "haproxy" else served_by.get(c.id, "")
        killed = any(c.start - slack <= t <= c.end + slack for t in faults.kills.get(gw, []))
        if killed and (c.status in (0, 502, 504) or c.cut):
            counts["killed"] += 1
        elif c.target != "haproxy" and c.status == 0 and not c.cut and any(
                a - slack <= c.start <= b + slack for a, b in faults.down.get(gw, [])):
            counts["target_down"] += 1
        else:
            counts["other"] += 1
    return counts


HAPROXY_LINE = re.compile(r" gateways/(\S+) .*?\{([^}|]*)")


def haproxy_servers(log: str, names: dict[str, str]) -> dict[str, str]:
    """Request id (captured X-Chaos-Id) -> the gateway haproxy sent it to,
    from its httplog lines (`names`: haproxy's server name -> gateway's)."""
    out = {}
    for m in HAPROXY_LINE.finditer(log):
        if m.group(2):
            out[m.group(2)] = names.get(m.group(1), m.group(1))
    return out


def failovers(events: Iterable[Event], kills: list[tuple[float, str]]) -> list[float]:
    """Seconds from each leader kill (time, the killed leader's id) to the
    first `leader` put naming another gateway, as the live watch saw it."""
    puts = sorted((e.seen, str((e.value or {}).get("id")))
                  for e in events if e.key == "leader" and e.kind == "put" and e.seen)
    out = []
    for t, old in kills:
        after = [s - t for s, who in puts if s >= t and who != old]
        if after:
            out.append(after[0])
    return out


STARTED = "Application startup complete."


def engine_starts(work_dirs: Iterable[Path]) -> dict[str, int]:
    """Replica id -> engine starts, counted from the stand-ins' own logs in
    the agents' work dirs (rotated copies included)."""
    counts: dict[str, int] = defaultdict(int)
    for wd in work_dirs:
        for f in sorted((wd / "logs").glob("*.log*")):
            rid = f.name.split(".log", 1)[0]
            counts[rid] += f.read_text(errors="replace").count(STARTED)
    return dict(counts)


def engines_duplicated(starts: dict[str, int], needed: int) -> int:
    """Starts beyond what the catalog needs: a replica started twice, or
    more replicas started than the catalog asks for. Seen to fail: one
    replica's log with two starts. Broken llmgw: the agent adopting no
    engine on restart (`Agent.adopt` reading no record) starts its replicas
    again after a `kill_agent`: engines_duplicated=1 (4 started, 3 needed)."""
    return max(0, sum(starts.values()) - needed, sum(max(0, n - 1) for n in starts.values()))


def in_window(calls: Iterable[Call], window: tuple[float, float]) -> list[Call]:
    """The calls sent while `window` lasted (an etcd-down window, a schedule)."""
    return [c for c in calls if window[0] <= c.start < window[1]]


def streams_cut_unexplained(calls: Iterable[Call], served_by: dict[str, str],
                            faults: Faults, slack: float = 1.0) -> list[str]:
    """Streams cut where neither their gateway nor their engine died: the
    gateway is the one haproxy's log names (or the one it was sent to), and
    it must have been SIGKILLed while the stream ran. Engines are never
    killed by the faults (an agent's SIGKILL leaves them running), so no
    engine death explains a cut. Seen to fail: a stream cut on a gateway no
    one killed (tests/test_chaos.py). Broken llmgw: the relay raising
    UpstreamError after 2 % of its chunks (app/router/relay.py): 11 streams
    cut with no kill of their gateway, and the same 11 failed "other"."""
    out = []
    for c in calls:
        if not c.cut:
            continue
        gw = c.target if c.target != "haproxy" else served_by.get(c.id, "")
        if not any(c.start - slack <= t <= c.end + slack for t in faults.kills.get(gw, [])):
            out.append(f"stream {c.id} via {c.target} (served by {gw or '?'}) cut at "
                       f"{c.end:.1f} with no kill of its gateway: {c.error}"[:200])
    return out


def limit_exceeded(calls: Iterable[Call], limit: int, slack: float = 0.5) -> list[str]:
    """Moments at which more than `limit` of one key's streams were held
    at once across all the gateways, as its client saw them (`limit`: the
    bound the gateways promise together for a concurrency limit L, L + N - 1
    with N gateways, docs/design/client-keys.md): a stream is
    held from its answer (the gateway admitted it before answering) until
    `slack` s before its finish_reason came (the gateway frees the slot
    once it has sent it). Seen to fail: three overlapping streams of a key
    limited to two (tests/test_chaos.py). Broken llmgw: each gateway
    admitting the whole concurrency limit, its claim ignored
    (app/router/usage/limits.py): 5 streams held at once against the bound of 4,
    3 times in a one-fault run."""
    spans = sorted((c.answered, c.finished - slack, c.id) for c in calls
                   if c.stream and c.status == 200 and not c.cut and c.answered
                   and c.finished - slack > c.answered)
    out = []
    for start, _, _ in spans:
        held = [i for s, e, i in spans if s <= start < e]
        if len(held) > limit:
            out.append(f"at {start:.1f}: {len(held)} streams held at once "
                       f"(limit {limit}): {sorted(held)}")
    return out
