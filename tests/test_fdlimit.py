"""`llmgw serve` raises its soft limit on open files to the hard one
(app/gateway/fdlimit.py): at 10,000 nodes the load poll alone keeps a
connection per node agent, past the 1,024 most systems start a process
with. A real gateway, started with a soft limit of 256."""

from __future__ import annotations

import re
import resource
import subprocess
import sys
from pathlib import Path

import httpx

from tests.support.procs import ROOT, Cluster, free_port, wait_for


def limits(pid: int) -> tuple[int, int]:
    text = Path(f"/proc/{pid}/limits").read_text()
    m = re.search(r"^Max open files\s+(\d+)\s+(\d+)", text, re.M)
    assert m is not None, text
    return int(m[1]), int(m[2])


def test_serve_raises_its_open_files_soft_limit_to_the_hard_one(
        solo: Cluster, tmp_path: Path) -> None:
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    port = free_port()
    env = solo.base_env() | {"LLMGW_PORT": str(port), "LLMGW_DATA_DIR": str(tmp_path / "gw"),
                             "LLMGW_LOCAL_AGENT": "false"}
    # The soft limit set by a shell that then execs the gateway, not by a
    # preexec_fn: that runs in the forked child of this process, whose
    # other threads (gRPC's, from earlier tests' etcd clients) may hold a
    # lock at the fork, and the child then hangs before its exec (CI saw it).
    proc = subprocess.Popen(
        ["sh", "-c", 'ulimit -Sn 256 && exec "$0" -m app.cli serve', sys.executable],
        cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    try:
        wait_for(lambda: httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=1
                                   ).status_code == 200, 30, "the gateway ready")
        want = min(hard, 1 << 20) if hard != resource.RLIM_INFINITY else 1 << 20
        assert limits(proc.pid) == (want, hard) and want > 256
    finally:
        proc.terminate()
        proc.wait(30)
