"""`llmgw ctl catalog apply --wait`: progress until every model of the file
has its wanted replicas ready, or, at --timeout, exit 1 naming the models
not ready and why (GET /admin/models' status: not placed, failed). A real
all-in-one gateway, its agent with one GPU, engines the vLLM stand-in."""

from __future__ import annotations

from pathlib import Path

from app.ctl.waiting import Standing, standing
from tests.support.procs import FAKE_BIN, Cluster
from tests.test_ctl import admin_get, one_line_error, run_on


def test_apply_waits_until_ready_then_times_out_naming_what_cannot_be_placed(
        solo: Cluster, tmp_path: Path) -> None:
    gw = solo.gateway("gw-wait", local_node="gpu-1", local_gpus="1",
                      vllm_bin=str(FAKE_BIN / "vllm"))
    first = tmp_path / "first.yaml"
    first.write_text("models:\n  a: {model: acme/a, gpus: 1}\n")
    done = run_on(gw, "catalog", "apply", str(first), "--wait", "--timeout", "90")
    assert done.returncode == 0, (done.stdout, done.stderr)
    assert "model a created" in done.stdout, done.stdout
    assert "a: ready (1/1)" in done.stdout, done.stdout
    status = admin_get(gw, "/admin/models/a")["status"]
    assert status["ready"] == status["wanted"] == 1, status  # it waited for the replica

    # b wants the only GPU, which a holds: it cannot be placed, and says why.
    both = tmp_path / "both.yaml"
    both.write_text("models:\n  a: {model: acme/a, gpus: 1}\n  b: {model: acme/b, gpus: 1}\n")
    done = run_on(gw, "catalog", "apply", str(both), "--wait", "--timeout", "4")
    line = one_line_error(done)
    unplaced = admin_get(gw, "/admin/models/b")["status"]["unplaced"]
    assert unplaced and "gpu-1" in unplaced, unplaced
    assert line.startswith("llmgw ctl: not ready after 4 s: b (0/1): not placed: "), line
    assert unplaced in line and " a " not in line, line
    assert "model a unchanged" in done.stdout and "model b created" in done.stdout, done.stdout


def test_standing_reads_the_status_against_the_spec_applied() -> None:
    spec = {"model": "acme/a", "gpus": 1}

    def item(**status: object) -> dict[str, object]:
        # The list carries each model's etag for If-Match: not part of its spec.
        return {"name": "a", "created": 1.0, "etag": '"7"', **spec,
                "status": {"wanted": 2, "ready": 0, "replicas": 0, "failed": [],
                           "unplaced": None} | status}

    assert standing(None, spec).why == "not in the gateway's catalog yet"
    old = item(ready=2) | {"gpus": 2}  # the mirror still shows the spec before the put
    assert not standing(old, spec).ready
    assert standing(item(ready=2), spec) == Standing(True, 2, 2, "")
    assert standing(item(replicas=2, ready=1), spec).why == "2 placed, 1 starting"
    failed = standing(item(replicas=1, failed=[{"id": "r1", "node": "n", "detail": "SIGILL"}],
                           unplaced="n: no free GPU"), spec)
    assert failed.line("a") == "a (0/2): not placed: n: no free GPU; failed: r1 on n: SIGILL"
