"""`llmgw agent` and `llmgw ctl` run none of the gateway's code
(docs/architecture.md, "Processes"): their entry through app/cli.py loads
no module of the control plane, the store, the router or the HTTP API.
lint-imports checks the packages' imports; this checks what the command
itself loads, app/cli.py included."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.procs import ROOT

GATEWAY_ONLY = ("app.control", "app.store", "app.router", "app.api", "app.gateway")

# Runs `llmgw ARGS...` in-process, then prints the gateway's modules it loaded.
PROBE = """
import json, sys
{first}
from app.cli import main
try:
    main(sys.argv[1:])
except SystemExit:
    pass
bad = sorted(m for m in sys.modules if m.startswith({prefixes!r}))
print("LOADED=" + json.dumps(bad))
"""


def loaded(*args: str, first: str = "") -> list[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLMGW_")}
    code = PROBE.format(first=first,
                        prefixes=tuple(p + "." for p in GATEWAY_ONLY) + GATEWAY_ONLY)
    done = subprocess.run([sys.executable, "-c", code, *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=60)
    line = [x for x in done.stdout.splitlines() if x.startswith("LOADED=")]
    assert line, f"the probe did not finish:\n{done.stdout}\n{done.stderr}"
    return list(json.loads(line[-1].removeprefix("LOADED=")))


def test_agent_loads_none_of_the_gateway() -> None:
    # Without LLMGW_AGENT_TOKEN the command stops (status 2) right after
    # importing every agent module it runs with.
    assert loaded("agent", "--gateway", "http://127.0.0.1:9", "--node", "n1") == []
    assert loaded("agent", "--help") == []


def test_ctl_loads_none_of_the_gateway() -> None:
    assert loaded("ctl", "--help") == []


def test_probe_sees_the_gateway_where_it_is_loaded() -> None:
    # The check can fail: a module of the gateway loaded is named.
    got = loaded("ctl", "--help", first="import app.store.base")
    assert "app.store" in got and "app.store.base" in got


def test_stop_default_data_dir_is_the_gateways(monkeypatch: pytest.MonkeyPatch) -> None:
    # `llmgw stop` names the gateway's default data dir without loading it.
    from app.cli import parser
    from app.gateway.settings import Settings

    monkeypatch.delenv("LLMGW_DATA_DIR", raising=False)
    args = parser().parse_args(["stop"])
    assert Path(args.data_dir) == Settings.model_fields["data_dir"].get_default(
        call_default_factory=True)
