"""scripts/quickstart.sh as a newcomer runs it, for real: on a port of its
own (LLMGW_PORT) and a data directory of its own, twice, then `llmgw ctl`
with that directory as the README says. The all-in-one gateway, its agent,
llama.cpp on SmolLM2 (tests/test_llamacpp.py has the engine's details)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.llamacpp_real import smollm2_path
from tests.support.procs import ROOT, free_port


class Quickstart:
    def __init__(self, tmp: Path) -> None:
        self.data = tmp / "llmgw-data"
        self.port = free_port()
        # The newcomer's environment: none of llmgw's settings but these.
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("LLMGW_")}
        self.env |= {"LLMGW_PORT": str(self.port), "LLMGW_DATA_DIR": str(self.data)}

    def run(self) -> str:
        done = subprocess.run(["bash", "scripts/quickstart.sh"], cwd=ROOT, env=self.env,
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stdout + done.stderr
        assert "answer: " in done.stdout, done.stdout
        return done.stdout

    def ctl(self, *args: str) -> str:
        """`llmgw ctl ARGS` given the data directory alone, as the README says."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("LLMGW_")}
        done = subprocess.run([sys.executable, "-m", "app.cli", "ctl", *args], cwd=ROOT,
                              env=env | {"LLMGW_DATA_DIR": str(self.data), "COLUMNS": "300"},
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stdout + done.stderr
        return done.stdout

    def stop(self) -> None:
        subprocess.run([sys.executable, "-m", "app.cli", "stop", "--data-dir", str(self.data)],
                       cwd=ROOT, env=self.env, capture_output=True, timeout=120)


@pytest.fixture
def quickstart(tmp_path: Path) -> Iterator[Quickstart]:
    smollm2_path()  # the engine and weights installed (skipped, or failed on CI, if not)
    q = Quickstart(tmp_path)
    try:
        yield q
    finally:
        q.stop()


def test_a_second_quickstart_and_ctl_find_what_the_first_left(quickstart: Quickstart) -> None:
    said = quickstart.run()
    # ctl finds this gateway on its port, not the default 8080.
    (node,) = json.loads(quickstart.ctl("nodes", "--json"))
    assert f"LLMGW_DATA_DIR={quickstart.data}" in said  # how to run ctl, said
    # A CPU node with llama.cpp and no vLLM: the table says so, no vLLM build.
    row = next(line for line in quickstart.ctl("nodes").splitlines()
               if f" {node['name']} " in line)
    assert "llama.cpp" in row and "vLLM" not in row, row

    quickstart.run()  # the key of the first run, not a second one
    keys = json.loads(quickstart.ctl("keys", "list", "--json"))
    assert [k["name"] for k in keys] == ["quickstart"], keys

    # The agent's liveness probe (every second) is not in the engine's log;
    # the requests the engine served are.
    (log,) = (quickstart.data / "agent" / "logs").glob("*.log")
    text = log.read_text()
    assert "POST /v1/chat/completions" in text, text[-2000:]
    probes = [line for line in text.splitlines() if "GET /docs" in line]
    assert probes == [], f"{len(probes)} probe lines, the last: {probes[-1:]}"
