"""`llmgw stop` (README, "Using it"): the gateway writes its pid to
DATA_DIR/llmgw.pid and holds a lock on it while it runs; stop reads it, sends
SIGTERM and waits for the gateway to exit; a second gateway on the same data
dir is refused while the first runs. A real all-in-one `llmgw serve` here."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.support.procs import ROOT, Cluster


def llmgw(*args: str, env: dict[str, str], timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "app.cli", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


def test_stop_ends_the_gateway_and_says_so(solo: Cluster) -> None:
    gw = solo.gateway("aio", shutdown_notice_seconds="0.5")
    data = Path(gw.env["LLMGW_DATA_DIR"])
    assert gw.popen is not None
    assert (data / "llmgw.pid").read_text().strip() == str(gw.popen.pid)

    # A second gateway on the same data dir is refused, naming the first.
    second = llmgw("serve", "--port", "0", env=gw.env, timeout=30)
    assert second.returncode == 2, second.stdout + second.stderr
    assert f"pid {gw.popen.pid}" in second.stderr and "llmgw stop" in second.stderr, second.stderr
    assert gw.popen.poll() is None

    started = time.monotonic()
    done = llmgw("stop", "--data-dir", str(data), "--timeout", "30", env=solo.base_env())
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"stopped the gateway (pid {gw.popen.pid})" in done.stdout, done.stdout
    # It stopped as on any SIGTERM ("Stopping"); uvicorn then ends the process
    # by the signal it caught, as its parent expects.
    assert gw.wait(5) in (0, -signal.SIGTERM)
    assert "stopping: open requests have" in gw.output()
    assert time.monotonic() - started < 30
    assert not (data / "llmgw.pid").exists()

    again = llmgw("stop", env=solo.base_env() | {"LLMGW_DATA_DIR": str(data)})
    assert again.returncode == 1, again.stdout + again.stderr
    assert "no gateway is running" in again.stderr, again.stderr


def test_a_pid_file_left_by_a_killed_gateway_stops_nothing(solo: Cluster) -> None:
    gw = solo.gateway("killed")
    data = Path(gw.env["LLMGW_DATA_DIR"])
    gw.kill_alone()
    # The file names a pid that may belong to another process by now: it is
    # not signalled, since no gateway holds the file's lock.
    (data / "llmgw.pid").write_text(f"{os.getpid()}\n")
    done = llmgw("stop", "--data-dir", str(data), env=solo.base_env())
    assert done.returncode == 1 and "no gateway is running" in done.stderr, done.stderr
    restarted = solo.gateway("killed")  # and a new gateway starts over it
    assert restarted.popen is not None
    assert (data / "llmgw.pid").read_text().strip() == str(restarted.popen.pid)
