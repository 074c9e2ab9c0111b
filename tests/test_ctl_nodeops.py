"""`llmgw ctl node ...` and `llmgw ctl quota ...` against a real all-in-one
gateway with its local node "gpu-1", run as an operator runs them; their
effect read over the admin API and in placement (a model's status)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

from tests.support.procs import FAKE_BIN, Cluster, GatewayProc, put_model, wait_for
from tests.test_ctl import admin_get, ok_on, one_line_error, run_on


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayProc]:
    c = Cluster(tmp_path_factory.mktemp("ctl-nodeops"), None, "")
    try:
        gw = c.gateway("gw-ops", local_node="gpu-1", local_gpus="1",
                       vllm_bin=str(FAKE_BIN / "vllm"))
        wait_for(lambda: any(n["name"] == "gpu-1" for n in get(gw, "/admin/nodes")), 20,
                 "the local node")
        yield gw
    finally:
        c.close()


run = run_on
ok = ok_on
get = admin_get


def delete_model(gw: GatewayProc, name: str) -> None:
    with gw.admin() as admin:
        assert admin.delete(f"/admin/models/{name}").status_code == 204


def grid(text: str) -> dict[str, str]:
    """`node conf`'s two columns: label -> value."""
    return {label: value.strip() for label, value in
            (line.split("  ", 1) for line in text.splitlines() if line.strip())}


def cells(table: str, bar: str) -> list[list[str]]:
    """A table's rows of four columns (header: "┃", body: "│")."""
    return [[c.strip() for c in line.split(bar)[1:-1]]
            for line in table.splitlines() if line.count(bar) == 5]


def conf(gw: GatewayProc) -> dict[str, Any]:
    return dict(get(gw, "/admin/nodes/gpu-1/conf"))


def test_cordon_drain_uncordon(gw: GatewayProc) -> None:
    shown = grid(ok(gw, "node", "conf", "gpu-1"))
    assert shown == {"node": "gpu-1", "state": "schedulable", "pool": "default",
                     "labels": "none", "engine build": "auto"}, shown
    assert json.loads(ok(gw, "node", "conf", "gpu-1", "--json")) == conf(gw)

    assert ok(gw, "node", "cordon", "gpu-1") == (
        "node gpu-1: cordoned, pool default, labels none, engine build auto\n")
    assert (conf(gw)["cordoned"], conf(gw)["draining"]) == (True, False)
    # The node's listing says so too (the agent's report alone does not).
    (listed,) = get(gw, "/admin/nodes")
    assert listed["conf"]["cordoned"] is True and listed["conf"]["pool"] == "default"
    row = next(ln for ln in ok(gw, "nodes").splitlines() if "gpu-1" in ln)
    assert "cordoned" in row, row
    # Placement sees it: a new model's replica has nowhere to go.
    put_model(gw, "w", {"model": "acme/w", "gpus": 1})
    assert get(gw, "/admin/models/w")["status"]["unplaced"] == "gpu-1: cordoned"

    assert ok(gw, "node", "drain", "gpu-1").startswith("node gpu-1: draining, pool default")
    assert (conf(gw)["cordoned"], conf(gw)["draining"]) == (True, True)
    assert json.loads(ok(gw, "node", "uncordon", "gpu-1", "--json")) == conf(gw)
    assert (conf(gw)["cordoned"], conf(gw)["draining"]) == (False, False)
    assert get(gw, "/admin/models/w")["status"]["unplaced"] is None  # fits again
    delete_model(gw, "w")

    said = one_line_error(run(gw, "node", "cordon", "nope"))
    assert "404" in said and "No such node" in said and "'nope'" in said


def test_pool_and_labels_keep_the_rest(gw: GatewayProc) -> None:
    ok(gw, "node", "cordon", "gpu-1")
    shown = grid(ok(gw, "node", "conf", "gpu-1", "--pool", "p1", "--label", "zone=a",
                    "--label", "rack=3"))
    assert (shown["state"], shown["pool"], shown["labels"]) == (
        "cordoned", "p1", "rack=3, zone=a"), shown
    assert (conf(gw)["pool"], conf(gw)["labels"]) == ("p1", {"zone": "a", "rack": "3"})

    ok(gw, "node", "conf", "gpu-1", "--unlabel", "rack", "--label", "gen=h100")
    after = conf(gw)
    assert (after["pool"], after["labels"], after["cordoned"]) == (
        "p1", {"zone": "a", "gen": "h100"}, True)
    ok(gw, "node", "conf", "gpu-1", "--pool", "default", "--unlabel", "zone",
       "--unlabel", "gen")
    ok(gw, "node", "uncordon", "gpu-1")
    assert {k: conf(gw)[k] for k in ("pool", "labels", "cordoned")} == {
        "pool": "default", "labels": {}, "cordoned": False}

    for args, hint in ((["--label", "zone"], "--label"), (["--label", "bad name=x"], "--label"),
                       (["--pool", "bad pool"], "--pool"),
                       (["--label", "a=1", "--unlabel", "a"], "--unlabel")):
        bad = run(gw, "node", "conf", "gpu-1", *args)
        assert bad.returncode == 2 and hint in bad.stderr, (args, bad.stderr)
    said = one_line_error(run(gw, "node", "conf", "nope", "--pool", "p2"))
    assert "404" in said and "No such node" in said
    assert conf(gw)["pool"] == "default"


def test_quotas(gw: GatewayProc) -> None:
    assert json.loads(ok(gw, "quota", "list", "--json")) == []
    assert ok(gw, "quota", "set", "team-a", "--max-gpus", "0") == "quota team-a: at most 0 GPUs\n"
    put_model(gw, "qm", {"model": "acme/qm", "gpus": 1, "quota": "team-a"})
    assert get(gw, "/admin/models/qm")["status"]["unplaced"] == (
        "gpu-1: quota team-a: 0 of 0 GPUs held, needs 1 more")

    listed = json.loads(ok(gw, "quota", "list", "--json"))
    assert listed[0].pop("etag").startswith('"'), listed  # what If-Match takes
    assert listed == [{"scope": "team-a", "max_gpus": 0, "used_gpus": 0, "models": ["qm"]}]
    table = ok(gw, "quota", "list")
    assert cells(table, "┃") == [["SCOPE", "MAX GPUS", "USED GPUS", "MODELS"]]
    assert cells(table, "│") == [["team-a", "0", "0", "qm"]]

    assert ok(gw, "quota", "delete", "team-a") == "quota team-a deleted\n"
    # Its model still names the scope: listed, without a limit (and the
    # leader may have placed qm already: USED GPUS is 0 or 1).
    (row,) = cells(ok(gw, "quota", "list"), "│")
    assert (row[0], row[1], row[3]) == ("team-a", "no limit", "qm"), row
    delete_model(gw, "qm")

    said = one_line_error(run(gw, "quota", "delete", "team-a"))
    assert "404" in said and "no quota is set for scope 'team-a'" in said
    bad = run(gw, "quota", "set", "team-a", "--max-gpus", "-1")
    assert bad.returncode == 2 and "--max-gpus" in bad.stderr
    said = one_line_error(run(gw, "quota", "set", "bad scope", "--max-gpus", "1"))
    assert "400" in said and "quota scope 'bad scope'" in said
    assert json.loads(ok(gw, "quota", "list", "--json")) == []


def test_if_match_conditions_node_conf_and_quota_writes(gw: GatewayProc) -> None:
    """`--if-match ETAG` (as `node conf` and `quota list --json` show it):
    the write is made only if the record is still at ETAG; else the
    gateway's 412 is one line and nothing is written."""
    ok(gw, "node", "cordon", "gpu-1")  # a conf stored: it has an ETag
    tag = grid(ok(gw, "node", "conf", "gpu-1"))["etag"]
    assert tag.startswith('"') and tag.endswith('"'), tag
    ok(gw, "node", "uncordon", "gpu-1")  # another admin's change: the ETag moves on
    said = one_line_error(run(gw, "node", "conf", "gpu-1", "--pool", "p9", "--if-match", tag))
    assert "412" in said and "If-Match does not hold" in said, said
    assert (conf(gw)["pool"], conf(gw)["cordoned"]) == ("default", False)
    now = grid(ok(gw, "node", "conf", "gpu-1"))["etag"]
    assert now != tag
    shown = grid(ok(gw, "node", "conf", "gpu-1", "--pool", "p9", "--if-match", now.strip('"')))
    assert shown["pool"] == "p9" and shown["etag"] != now, shown
    bad = run(gw, "node", "conf", "gpu-1", "--if-match", shown["etag"])
    assert bad.returncode == 2 and "--if-match" in bad.stderr, bad.stderr
    ok(gw, "node", "conf", "gpu-1", "--pool", "default")

    ok(gw, "quota", "set", "team-b", "--max-gpus", "2")
    (q,) = json.loads(ok(gw, "quota", "list", "--json"))
    ok(gw, "quota", "set", "team-b", "--max-gpus", "3")
    for args in (["set", "team-b", "--max-gpus", "4"], ["delete", "team-b"]):
        said = one_line_error(run(gw, "quota", *args, "--if-match", q["etag"]))
        assert "412" in said and "If-Match does not hold" in said, said
    (q,) = json.loads(ok(gw, "quota", "list", "--json"))
    assert q["max_gpus"] == 3
    ok(gw, "quota", "set", "team-b", "--max-gpus", "4", "--if-match", q["etag"])
    (q,) = json.loads(ok(gw, "quota", "list", "--json"))
    assert q["max_gpus"] == 4
    assert ok(gw, "quota", "delete", "team-b", "--if-match", q["etag"]) == (
        "quota team-b deleted\n")
    assert json.loads(ok(gw, "quota", "list", "--json")) == []
