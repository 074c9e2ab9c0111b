"""The agent's parts that touch the outside: engine command lines and environments.

GPU discovery is tested in test_gpus.py."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from app.agent.engines import EngineSpec, command, environment
from tests.support.procs import FAKE_BIN


def recorded_vllm_flags() -> tuple[str, set[str]]:
    """The `vllm serve` flags recorded from a named vLLM version, which the
    fake's parser is generated from (tests/fakes/vllm_serve_flags.json)."""
    data = json.loads((FAKE_BIN.parent / "vllm_serve_flags.json").read_text())
    return data["vllm_version"], {n for f in data["flags"] for n in f["names"]}


def unrecorded_flags(cmd: list[str]) -> list[str]:
    """Options of `cmd` that the recorded vLLM does not have."""
    _, known = recorded_vllm_flags()
    return [a.split("=", 1)[0] for a in cmd
            if a.startswith("-") and a.split("=", 1)[0] not in known]


def test_vllm_command_line_uses_only_recorded_vllm_flags_and_no_key() -> None:
    version, known = recorded_vllm_flags()
    assert version == "0.12.0" and "--served-model-name" in known
    # The check bites: a flag vLLM 0.12 removed is refused.
    assert unrecorded_flags(["vllm", "serve", "w", "--disable-log-requests"]) == [
        "--disable-log-requests"]

    spec = EngineSpec(replica_id="m-1", model="org/m", weights="acme/weights",
                      engine="vllm", gpus=(2, 3), key="llmgw-" + "k" * 40,
                      weights_revision="v1.0",
                      engine_args=("--max-model-len=8192", "--enforce-eager"))
    cmd = command(spec, "127.0.0.1", 8123, str(FAKE_BIN / "vllm"))
    assert cmd[1:3] == ["serve", "acme/weights"]
    assert unrecorded_flags(cmd) == []
    assert cmd[cmd.index("--revision") + 1] == "v1.0"
    assert cmd[-2:] == ["--max-model-len=8192", "--enforce-eager"]  # the profile's, last
    assert cmd[cmd.index("--tensor-parallel-size") + 1] == "2"
    assert not any(spec.key in arg for arg in cmd)  # /proc/PID/cmdline is world-readable
    env = environment(spec)
    assert env["CUDA_VISIBLE_DEVICES"] == "2,3"
    assert env["VLLM_API_KEY"] == spec.key
    # The values parse too: the fake's parser, generated from the same record,
    # checks the line without serving (its error lists only the bogus flag).
    probe = subprocess.run(
        [*cmd, "--bogus-flag"], capture_output=True, text=True, timeout=30,
        env=env | {"FAKE_VLLM_PYTHON": sys.executable},
    )
    assert probe.returncode == 2
    assert "unrecognized arguments: --bogus-flag" in probe.stderr.splitlines()[-1]


def test_llamacpp_gets_its_key_from_the_environment_and_no_interrupts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("LLMGW_SECRET", "s" * 20)
    monkeypatch.setenv("LLMGW_AGENT_TOKEN", "t" * 20)
    monkeypatch.setenv("PORT", "1")  # llama-cpp-python's uvicorn would take it
    spec = EngineSpec(replica_id="c-1", model="m", weights="/w.gguf", engine="llamacpp",
                      gpus=(), key="llmgw-" + "c" * 40)
    env = environment(spec)
    assert "LLMGW_SECRET" not in env and "LLMGW_AGENT_TOKEN" not in env
    assert "PORT" not in env
    assert env["CUDA_VISIBLE_DEVICES"] == "" and env["API_KEY"] == spec.key
    cmd = command(spec, "127.0.0.1", 9, "unused")
    assert cmd[:3] == [sys.executable, "-m", "app.agent.llamacpp_server"]  # llama_cpp.server
    assert cmd[cmd.index("--model_alias") + 1] == "m"
    assert cmd[cmd.index("--interrupt_requests") + 1] == "False"
    assert not any(spec.key in arg for arg in cmd)


def test_an_engine_is_adopted_only_if_its_pid_still_names_the_same_process(
    tmp_path: Path,
) -> None:
    from app.agent.engines import EngineProcess, start_ticks

    proc = subprocess.Popen(["sleep", "30"])
    try:
        ticks = start_ticks(proc.pid)
        assert ticks is not None
        record = {"replica_id": "r", "model": "m", "weights": "w", "weights_revision": None,
                  "engine_args": [], "engine": "vllm",
                  "gpus": [0], "host": "127.0.0.1", "port": 1, "log": str(tmp_path / "l"),
                  "pid": proc.pid, "ticks": ticks, "rpc": None}
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


def test_an_adopted_engine_is_stopped_with_its_group_only_if_it_leads_one(
    tmp_path: Path,
) -> None:
    from app.agent.engines import EngineProcess, start_ticks

    def adopted(proc: subprocess.Popen[bytes]) -> EngineProcess:
        ticks = start_ticks(proc.pid)
        assert ticks is not None
        record = {"replica_id": "r", "model": "m", "weights": "w", "engine": "vllm",
                  "gpus": [0], "host": "127.0.0.1", "port": 1, "log": str(tmp_path / "l"),
                  "pid": proc.pid, "ticks": ticks}
        engine = EngineProcess.adopt(record)
        assert engine is not None
        return engine

    # An engine in a session of its own, with a worker: both stop.
    leader = subprocess.Popen(["sh", "-c", "sleep 60 & echo $!; wait"],
                              stdout=subprocess.PIPE, start_new_session=True)
    # One started by an older agent, in our own process group: a group kill
    # would kill this test; only the engine may go.
    alone = subprocess.Popen(["sleep", "60"])
    try:
        assert leader.stdout is not None
        worker = int(leader.stdout.readline())
        asyncio.run(adopted(leader).stop())
        assert leader.wait(5) is not None
        # SIGKILL went to the group; its delivery takes a moment under load.
        deadline = time.monotonic() + 5
        while start_ticks(worker) is not None and time.monotonic() < deadline:
            time.sleep(0.02)
        assert start_ticks(worker) is None, "the adopted engine's worker outlived its stop"
        asyncio.run(adopted(alone).stop())
        assert alone.wait(5) == -signal.SIGTERM
    finally:
        for p in (leader, alone):
            p.kill()
            p.wait()


def test_advertising_loopback_to_a_remote_gateway_is_said_loudly(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from app.agent.gateway_client import advertise_address

    assert advertise_address("http://127.0.0.1:8080") == "127.0.0.1"
    assert not [r for r in caplog.records if r.levelname == "ERROR"]  # loopback to loopback
    # No route to tell (an unresolvable gateway): 127.0.0.1, and an error says so.
    assert advertise_address("http://no-such-host.invalid:8080") == "127.0.0.1"
    assert any("--advertise-host" in r.getMessage() for r in caplog.records
               if r.levelname == "ERROR")


async def test_a_vllm_engines_sockets_live_in_a_folder_removed_when_it_is_gone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """vLLM binds its ZeroMQ sockets in the temporary folder and leaves them
    when killed: an engine gets a folder of its own (VLLM_RPC_BASE_PATH),
    removed once it has died, or been stopped. The fake binds one socket
    there as vLLM does (the real engine: tests/test_vllm_real.py)."""
    from app.agent.engines import EngineProcess
    from app.ports import free_port

    logs = tmp_path / "logs"
    logs.mkdir(mode=0o700)
    monkeypatch.setenv("FAKE_VLLM_PYTHON", sys.executable)  # the fake needs this venv's aiohttp

    async def started(rid: str) -> tuple[EngineProcess, Path]:
        spec = EngineSpec(replica_id=rid, model="m", weights="acme/m", engine="vllm",
                          gpus=(0,), key="k-" + rid)
        engine = EngineProcess(spec, "127.0.0.1", free_port("127.0.0.1"), logs / f"{rid}.log")
        await engine.start(str(FAKE_BIN / "vllm"))
        rpc = engine.rpc
        assert rpc is not None and len(str(rpc)) + 37 < 108  # a socket's path limit
        for _ in range(200):
            if rpc.is_dir() and any(p.is_socket() for p in rpc.iterdir()):
                break
            await asyncio.sleep(0.05)
        assert [p.is_socket() for p in rpc.iterdir()] == [True], list(rpc.iterdir())
        return engine, rpc

    async def kill(engine: EngineProcess) -> None:
        assert engine.pid is not None
        os.killpg(engine.pid, signal.SIGKILL)
        for _ in range(100):
            if engine.exit_code() is not None:
                return
            await asyncio.sleep(0.05)

    killed, rpc = await started("r1")
    await kill(killed)
    assert rpc.is_dir()  # left by the kill, as vLLM leaves its sockets
    killed.clear_group()  # the agent's step when it sees the death
    assert not rpc.exists()

    stopped, rpc = await started("r2")
    await stopped.stop()
    assert not rpc.exists()

    # Killed with its agent: the next agent's start finds its record, the
    # engine gone, and removes its folder; a live engine keeps its own.
    lost, lost_rpc = await started("r4")
    live, live_rpc = await started("r5")
    try:
        records = [lost.record(), live.record()]
        await kill(lost)
        assert EngineProcess.adopt(records[0]) is None and not lost_rpc.exists()
        assert EngineProcess.adopt(records[1]) is not None and live_rpc.is_dir()
    finally:
        await live.stop()
    # Not a name derived from anything: another local user cannot take it first.
    assert lost_rpc.name != live_rpc.name and lost_rpc.name.startswith("llmgw-rpc-")
