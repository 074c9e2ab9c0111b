"""The agent's parts that touch the outside: GPU discovery and engine command lines."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from app.agent.engines import EngineSpec, command, environment
from app.agent.gpus import discover, parse_nvidia_smi
from tests.support.procs import FAKE_BIN

SMI = """0, NVIDIA H200, 143771, GPU-1b2c
1, NVIDIA H200, [N/A], GPU-3d4e
"""


def test_parse_nvidia_smi() -> None:
    gpus = parse_nvidia_smi(SMI + "garbage line\n")
    assert [(g.index, g.name, g.memory_mib, g.uuid) for g in gpus] == [
        (0, "NVIDIA H200", 143771, "GPU-1b2c"), (1, "NVIDIA H200", 0, "GPU-3d4e")]


def _tool(dir_: Path, body: str) -> None:
    exe = dir_ / "nvidia-smi"
    exe.write_text(f"#!/bin/sh\n{body}\n")
    exe.chmod(0o755)


def test_discover_runs_nvidia_smi_and_survives_its_failure(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    query = "*--query-gpu=index,name,memory.total,uuid*--format=csv,noheader,nounits*"
    _tool(tmp_path, f"""case "$*" in {query}) printf '{SMI}';; *) exit 9;; esac""")
    assert [g.index for g in discover()] == [0, 1]
    _tool(tmp_path, "echo 'NVIDIA-SMI has failed' >&2; exit 9")
    assert discover() == []  # a broken driver makes a CPU node, not a crash
    assert discover("no-such-nvidia-smi") == []


def test_vllm_command_line_is_accepted_by_vllms_parser() -> None:
    spec = EngineSpec(replica_id="m-1", model="org/m", weights="acme/weights",
                      engine="vllm", gpus=(2, 3), key="llmgw-" + "k" * 40)
    cmd = command(spec, "127.0.0.1", 8123, str(FAKE_BIN / "vllm"))
    assert cmd[1:3] == ["serve", "acme/weights"]
    assert cmd[cmd.index("--tensor-parallel-size") + 1] == "2"
    assert cmd[cmd.index("--api-key") + 1] == spec.key
    env = environment(spec)
    assert env["CUDA_VISIBLE_DEVICES"] == "2,3"
    # The stand-in parses vLLM's real flags and rejects unknown ones: check
    # the line without serving (vLLM's `--help` would print, not serve).
    probe = subprocess.run(
        [*cmd, "--bogus-flag"], capture_output=True, text=True, timeout=30,
        env=env | {"FAKE_VLLM_PYTHON": sys.executable},
    )
    assert probe.returncode == 2 and "--bogus-flag" in probe.stderr
    assert "unrecognized arguments: --bogus-flag" in probe.stderr  # ours all parsed


def test_engine_environment_keeps_our_secrets_out(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LLMGW_SECRET", "s" * 20)
    monkeypatch.setenv("LLMGW_AGENT_TOKEN", "t" * 20)
    spec = EngineSpec(replica_id="c-1", model="m", weights="/w.gguf", engine="llamacpp",
                      gpus=(), key="k")
    env = environment(spec)
    assert "LLMGW_SECRET" not in env and "LLMGW_AGENT_TOKEN" not in env
    assert env["CUDA_VISIBLE_DEVICES"] == ""
    cmd = command(spec, "127.0.0.1", 9, "unused")
    assert cmd[:3] == [sys.executable, "-m", "llama_cpp.server"]
    assert cmd[cmd.index("--model_alias") + 1] == "m"


def test_an_engine_is_adopted_only_if_its_pid_still_names_the_same_process(
    tmp_path: Path,
) -> None:
    from app.agent.engines import EngineProcess, start_ticks

    proc = subprocess.Popen(["sleep", "30"])
    try:
        ticks = start_ticks(proc.pid)
        assert ticks is not None
        record = {"replica_id": "r", "model": "m", "weights": "w", "engine": "vllm",
                  "gpus": [0], "host": "127.0.0.1", "port": 1, "log": str(tmp_path / "l"),
                  "pid": proc.pid, "ticks": ticks}
        adopted = EngineProcess.adopt(record)
        assert adopted is not None and adopted.pid == proc.pid
        assert adopted.exit_code() is None and adopted.spec.key == ""
        assert adopted.record() == record
        # Same pid, another start time: a stranger that reused the pid.
        assert EngineProcess.adopt(record | {"ticks": ticks + 1}) is None
        proc.kill()
        proc.wait()
        assert start_ticks(proc.pid) is None
        assert adopted.exit_code() == -1
    finally:
        proc.kill()
