"""`llmgw ctl` against a real gateway and agent, run as an operator runs it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from rich.table import Table

from app import __version__
from app.ctl.common import out
from app.wire.tokens import node_token
from tests.support.procs import (
    ADMIN,
    ROOT,
    SECRET,
    Cluster,
    GatewayProc,
    free_port,
    put_model,
    wait_for,
    wait_ready,
)


def ctl(*args: str, gateway: str | None = None, token: str = ADMIN, stdin: str | None = None,
        **env: str) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("LLMGW_")}
    base |= {"LLMGW_ADMIN_TOKEN": token, "COLUMNS": "200", **env}
    if gateway is not None:
        base["LLMGW_GATEWAY"] = gateway
    return subprocess.run([sys.executable, "-m", "app.cli", "ctl", *args], cwd=ROOT, env=base,
                          capture_output=True, text=True, timeout=60,
                          input=stdin if stdin is not None else "")


def run_on(gw: GatewayProc, *args: str, stdin: str | None = None
           ) -> subprocess.CompletedProcess[str]:
    """`llmgw ctl ARGS` against `gw`. The admin token is never printed,
    whatever the command and its outcome."""
    done = ctl(*args, gateway=gw.url, stdin=stdin)
    assert ADMIN not in done.stdout + done.stderr
    return done


def ok_on(gw: GatewayProc, *args: str, stdin: str | None = None) -> str:
    """What `llmgw ctl ARGS` printed, having succeeded."""
    done = run_on(gw, *args, stdin=stdin)
    assert done.returncode == 0, (done.stdout, done.stderr)
    return done.stdout


def admin_get(gw: GatewayProc, path: str) -> Any:
    with gw.admin() as admin:
        r = admin.get(path)
        assert r.status_code == 200, r.text
        return r.json()


def ok_json(*args: str, gateway: str) -> Any:
    done = ctl(*args, "--json", gateway=gateway)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def one_line_error(done: subprocess.CompletedProcess[str]) -> str:
    assert done.returncode == 1, (done.returncode, done.stdout, done.stderr)
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("llmgw ctl: "), done.stderr
    return lines[0]


def test_ctl_against_a_real_gateway(cluster: Cluster, tmp_path: Path) -> None:
    cache = tmp_path / "hub"
    (cache / "models--old--x" / "blobs").mkdir(parents=True)
    (cache / "models--old--x" / "blobs" / "b").write_bytes(b"w" * 4096)
    gw = cluster.gateway("gw-a")
    cluster.agent("node-1", [gw], "--gpus", "2", "--cache-dir", str(cache))
    put_model(gw, "m", {"model": "acme/m", "gpus": 1, "aliases": ["small"]})
    rid = wait_ready(gw)["id"]

    nodes = wait_for(lambda: [n for n in ok_json("nodes", gateway=gw.url) if n["api_url"]],
                     10, "node-1 with its API")
    (node,) = nodes
    assert (node["name"], node["version"], node["replicas"]) == ("node-1", __version__, [rid])
    assert [g["index"] for g in node["gpus"]] == [0, 1] and node["gpu_discovery"] == "declared"
    assert node["cpus"] >= 1 and node["memory_mib"] > 0

    (model,) = ok_json("models", gateway=gw.url)
    assert (model["name"], model["aliases"], model["status"]["ready"]) == ("m", ["small"], 1)
    (rep,) = ok_json("replicas", gateway=gw.url)
    assert (rep["id"], rep["node"], rep["phase"]) == (rid, "node-1", "ready")

    # --gateway instead of LLMGW_GATEWAY; a table for people.
    table = ctl("nodes", "--gateway", gw.url)
    assert table.returncode == 0, table.stderr
    assert "node-1" in table.stdout and "2x declared" in table.stdout and rid in table.stdout

    logs = ctl("logs", "node-1", "--source", rid, "--lines", "3", gateway=gw.url)
    assert logs.returncode == 0, logs.stderr
    assert len(logs.stdout.splitlines()) == 3
    assert "agent" in logs.stderr and rid in logs.stderr  # the sources
    data = ok_json("logs", "node-1", gateway=gw.url)
    assert data["source"] == "agent" and data["lines"]

    weights = ok_json("weights", "node-1", gateway=gw.url)
    assert [(e["path"], e["size"]) for e in weights["entries"]] == [("models--old--x", 4096)]
    said = one_line_error(ctl("weights", "node-1", "--delete", "../hub2", gateway=gw.url))
    assert "400" in said and "'..'" in said
    removed = ctl("weights", "node-1", "--delete", "models--old--x", gateway=gw.url)
    assert removed.returncode == 0, removed.stderr
    assert removed.stdout == "removed models--old--x\n"
    assert not (cache / "models--old--x").exists()

    # The fake vllm on PATH is the operator's own build, used without a check.
    assert node["vllm_build"] == "operator", node
    chosen = ctl("engine-build", "node-1", "none", gateway=gw.url)
    assert chosen.returncode == 0, chosen.stderr
    assert chosen.stdout == "node-1: engine build none, vLLM the gateways' default\n"
    chosen = ctl("engine-build", "node-1", "none", "--vllm-version", "0.30.1", gateway=gw.url)
    assert chosen.stdout == "node-1: engine build none, vLLM 0.30.1\n", chosen.stderr
    bad = ctl("engine-build", "node-1", "cu12", gateway=gw.url)
    assert bad.returncode == 2 and "auto, cu13, cu129, cpu, none" in bad.stderr, bad.stderr

    said = one_line_error(ctl("logs", "node-9", gateway=gw.url))
    assert "404" in said and "node-9" in said
    said = one_line_error(ctl("nodes", gateway=gw.url, token="wrong-token-0123456789"))
    assert "401" in said and "LLMGW_ADMIN_TOKEN" in said


def test_ctl_says_in_one_line_when_the_gateway_cannot_be_reached() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    said = one_line_error(ctl("replicas", gateway=url))
    assert f"cannot reach the gateway at {url}" in said


def test_node_token_is_derived_and_checks_the_name(tmp_path: Path) -> None:
    done = ctl("node-token", "gpu-01", LLMGW_SECRET=SECRET)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == node_token(SECRET, "gpu-01")
    bad = ctl("node-token", "bad name!", LLMGW_SECRET=SECRET)
    assert bad.returncode == 2 and "node name" in bad.stderr, bad.stderr
    # All-in-one: the secret from the data directory.
    (tmp_path / "secret").write_text(SECRET + "\n")
    done = ctl("node-token", "gpu-01", LLMGW_DATA_DIR=str(tmp_path))
    assert done.stdout.strip() == node_token(SECRET, "gpu-01")


def test_tables_show_engine_text_as_written(capsys: pytest.CaptureFixture[str]) -> None:
    # vLLM's log lines start "[rank0]:"; rich markup would eat it, and a
    # "[/y]" would crash the command with a MarkupError.
    table = Table("DETAIL")
    table.add_row("[rank0]: CUDA out of memory [/y]")
    out([], False, table)
    assert "[rank0]: CUDA out of memory [/y]" in capsys.readouterr().out


def test_piped_tables_keep_each_row_on_one_line(capsys: pytest.CaptureFixture[str],
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    # `llmgw ctl replicas | grep node-1`: rich would wrap at 80 columns.
    monkeypatch.delenv("COLUMNS", raising=False)
    table = Table("ID", "DETAIL")
    table.add_row("m-1", "x" * 150)
    out([], False, table)
    row = next(ln for ln in capsys.readouterr().out.splitlines() if "m-1" in ln)
    assert row.count("x") == 150
