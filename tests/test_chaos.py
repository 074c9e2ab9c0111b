"""The chaos suite (bench/chaos.py): its checks, each seen to flag a crafted
history that breaks what it guards, and one short schedule of faults on a
real fleet (3-member etcd, three gateways behind haproxy, two agents with
the vLLM stand-in) in which every must-be-0 count is 0."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

from tests.support.etcd import etcd_binary
from tests.support.procs import ROOT

sys.path.insert(0, str(ROOT / "bench"))
import chaos
import chaos_checks as checks
from chaos_checks import Call, Edit, Event


def leader(rev: int, gw: str, lease: int) -> Event:
    return Event(rev, "leader", "put", {"id": gw}, lease, rev)


def replica(rev: int, rid: str, node: str, gpus: list[int]) -> Event:
    return Event(rev, f"replicas/{rid}", "put", {"id": rid, "node": node, "gpus": gpus})


def test_gpu_double_holds_flags_two_replicas_on_one_gpu() -> None:
    good = [leader(2, "gw0", 7), replica(3, "a", "node-1", [0]), replica(4, "b", "node-1", [1]),
            Event(5, "replicas/a", "delete"), replica(6, "c", "node-1", [0]),
            replica(7, "d", "node-2", [0])]
    assert checks.gpu_double_holds(good) == []
    bad = [*good[:3], replica(5, "c", "node-1", [1, 0])]
    found = checks.gpu_double_holds(bad)
    assert len(found) == 2 and "node-1 GPU 0" in found[0] and "node-1 GPU 1" in found[1]


def test_writes_after_lease_flags_a_write_with_no_live_leader() -> None:
    history = [leader(2, "gw0", 7), replica(3, "a", "node-1", [0]),
               Event(4, "leader", "delete"), replica(5, "b", "node-1", [1]),
               leader(6, "gw1", 8), replica(7, "c", "node-2", [0])]
    assert checks.writes_after_lease(history, {}) == [
        "revision 5: put replicas/b with no leader key"]
    # The leader key still there, but etcd said its lease was gone first.
    found = checks.writes_after_lease(history, {8: 6})
    assert len(found) == 2 and "by gw1, whose lease 8 was gone at revision 6" in found[1]
    assert checks.writes_after_lease(history[:3] + history[4:], {7: 10}) == []


def test_edits_lost_flags_an_acknowledged_edit_missing_at_the_end() -> None:
    edits = [Edit("catalog/models/x", 601, True), Edit("catalog/models/x", 602, False),
             Edit("keys/k", 1, True), Edit("keys/k", None, True), Edit("keys/j", 1, True)]
    # x may hold the unacknowledged later edit; k was revoked; j is there.
    assert checks.edits_lost(edits, {"catalog/models/x": 602, "keys/j": 1}) == []
    assert checks.edits_lost(edits, {"catalog/models/x": 601, "keys/j": 1}) == []
    lost = checks.edits_lost(edits, {"catalog/models/x": 601, "keys/k": 1})
    assert lost == ["keys/k: 1 at the end, acknowledged None",
                    "keys/j: None at the end, acknowledged 1"]


def test_classify_flags_a_stream_cut_where_no_gateway_died() -> None:
    faults = checks.Faults()
    faults.kills["gw1"].append(10.0)
    faults.down["gw2"].append((20.0, 25.0))
    calls = [Call("a", "haproxy", True, 9.0, 10.5, 0, cut=True),  # gw1, killed under it
             Call("b", "haproxy", True, 30.0, 31.0, 0, cut=True),  # gw1 again, alive
             Call("c", "gw2", False, 21.0, 21.0, 0),  # gw2 down then
             Call("d", "haproxy", False, 1.0, 1.1, 429, "Too many concurrent requests"),
             Call("e", "haproxy", False, 1.0, 1.1, 503, ""),  # no reason given
             Call("f", "gw0", False, 1.0, 1.1)]
    served = checks.haproxy_servers(
        "127.0.0.1:1 [01/Dec/2026:16:36:24.600] llmgw gateways/gateway2 0/0/0/13/267 200 1 - - "
        '---- 3/3/2/0/0 0/0 {a} "POST /v1/chat/completions HTTP/1.1"\n'
        "127.0.0.1:2 [01/Dec/2026:16:36:24.600] llmgw gateways/gateway2 0/0/0/13/267 200 1 - - "
        '---- 3/3/2/0/0 0/0 {b} "POST /v1/chat/completions HTTP/1.1"\n',
        {"gateway2": "gw1"})
    assert served == {"a": "gw1", "b": "gw1"}
    assert checks.classify(calls, served, faults) == {
        "ok": 1, "refused": 1, "killed": 1, "target_down": 1, "other": 2}


def test_engines_duplicated_flags_a_replica_started_twice(tmp_path: Path) -> None:
    logs = tmp_path / "agent" / "logs"
    logs.mkdir(parents=True)
    (logs / "r1.log").write_text(f"{checks.STARTED}\n")
    (logs / "r2.log.1").write_text(f"{checks.STARTED}\n")
    (logs / "r2.log").write_text("Shutting down\n")
    starts = checks.engine_starts([tmp_path / "agent"])
    assert starts == {"r1": 1, "r2": 1} and checks.engines_duplicated(starts, 2) == 0
    (logs / "r1.log").write_text(f"{checks.STARTED}\n" * 2)  # restarted, not adopted
    assert checks.engines_duplicated(checks.engine_starts([tmp_path / "agent"]), 2) == 1
    assert checks.engines_duplicated({"r1": 1, "r2": 1, "r3": 1}, 2) == 1


def test_failovers_time_each_kill_to_the_next_leader() -> None:
    events = [Event(2, "leader", "put", {"id": "gw0"}, 7, 2, seen=1.0),
              Event(9, "leader", "put", {"id": "gw1"}, 8, 9, seen=15.5)]
    assert checks.failovers(events, [(10.0, "gw0"), (20.0, "gw1")]) == [5.5]


def test_a_short_schedule_keeps_every_guarantee(tmp_path: Path) -> None:
    etcd_binary()
    if shutil.which("haproxy") is None and not Path("/usr/sbin/haproxy").exists():
        pytest.skip("haproxy is not installed (apt-get install haproxy)")
    seed = 12  # kill_agent, kill_etcd, kill_follower, kill_leader, stop_leader
    print(f"chaos seed {seed}")
    r = chaos.run_schedule(tmp_path, seed, faults=5)
    detail = "\n".join(r.notes)
    print(f"chaos: {r.classes} failovers={r.failovers} edits={r.edits} "
          f"replica_writes={r.replica_writes} leases_expired={r.leases_expired} "
          f"engines={r.engines_started}/{r.engines_needed}")
    assert r.replica_writes >= chaos.REPLICAS and r.requests > 50, detail
    assert r.classes["other"] == 0, detail
    assert r.classes["ok"] > 0.8 * r.requests, detail
    assert r.edits > 10 and r.edits_lost == [], r.edits_lost
    assert r.gpu_double_holds == [] and r.writes_after_lease == []
    assert r.engines_needed > chaos.REPLICAS, "churn placed no replica"
    assert r.engines_started >= chaos.REPLICAS and r.engines_duplicated == 0
    assert len(r.failovers) == r.leader_kills == 1
    # Each leader killed or stopped lost its lease: the lease check had evidence.
    assert r.leases_expired >= 2
