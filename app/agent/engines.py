"""Engine processes: the command line for each engine, and one running engine.

vLLM is started with its real command line (`vllm serve MODEL --port P
--api-key KEY --served-model-name NAME`), llama.cpp through
llama-cpp-python's OpenAI server (`python -m llama_cpp.server`). Each engine
demands its replica's key, so a request that did not come through a gateway
(or a key taken from another node) is refused by the engine itself.

Not guaranteed: the key is on the engine's command line, as vLLM's
`--api-key` takes it, so a local user who can read /proc on the node can see
it. It opens that one replica only.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import logging
import os
import shutil
import signal
import socket
import sys
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from app.control.state import Engine, GpuInfo

logger = logging.getLogger(__name__)

_STOP_GRACE = 10.0  # seconds between SIGTERM and SIGKILL


@dataclass(frozen=True)
class EngineSpec:
    """Everything needed to start one replica's engine."""

    replica_id: str
    model: str  # the name the engine serves (the catalog name)
    weights: str
    engine: Engine
    gpus: tuple[int, ...]
    key: str


def free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def command(spec: EngineSpec, host: str, port: int, vllm_bin: str) -> list[str]:
    if spec.engine == "vllm":
        cmd = [
            vllm_bin, "serve", spec.weights,
            "--host", host, "--port", str(port),
            "--api-key", spec.key,
            "--served-model-name", spec.model,
        ]
        if len(spec.gpus) > 1:
            cmd += ["--tensor-parallel-size", str(len(spec.gpus))]
        return cmd
    threads = max(1, (os.cpu_count() or 2) // 2)
    return [
        sys.executable, "-m", "llama_cpp.server",
        "--model", spec.weights, "--model_alias", spec.model,
        "--host", host, "--port", str(port),
        "--api_key", spec.key, "--n_threads", str(threads),
    ]


def environment(spec: EngineSpec) -> dict[str, str]:
    env = dict(os.environ)
    # Our own secrets are not the engine's business.
    for name in ("LLMGW_SECRET", "LLMGW_AGENT_TOKEN", "LLMGW_ADMIN_TOKEN"):
        env.pop(name, None)
    if spec.engine == "vllm":
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in spec.gpus)
    else:
        env["CUDA_VISIBLE_DEVICES"] = ""
    return env


def start_ticks(pid: int) -> int | None:
    """When process `pid` started (field 22 of /proc/PID/stat), None if it is gone.

    Pids are reused: a pid and its start time together name one process, so
    an agent never adopts, or kills, a stranger that got an old engine's pid.
    """
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()  # after "pid (comm)", which may hold spaces
    if fields[0] in ("Z", "X"):
        return None  # exited, not yet reaped
    return int(fields[19])


class EngineProcess:
    """One engine process and its log file: one this agent started, or one
    a previous run of the agent started and this one adopted."""

    def __init__(self, spec: EngineSpec, host: str, port: int, log_path: Path) -> None:
        self.spec = spec
        self.host = host
        self.port = port
        self.log_path = log_path
        self._proc: asyncio.subprocess.Process | None = None
        self._pid: int | None = None  # set for an adopted engine (not our child)
        self._ticks: int | None = None

    @classmethod
    def adopt(cls, record: dict[str, Any]) -> EngineProcess | None:
        """The engine `record` describes, if that very process still runs.

        Its key is not recorded (keys are derived, never stored): it is set
        from the next assignment, before the engine is checked or reported.
        """
        pid, ticks = int(record["pid"]), int(record["ticks"])
        if start_ticks(pid) != ticks:
            return None
        spec = EngineSpec(replica_id=record["replica_id"], model=record["model"],
                          weights=record["weights"], engine=record["engine"],
                          gpus=tuple(record["gpus"]), key="")
        proc = cls(spec, record["host"], int(record["port"]), Path(record["log"]))
        proc._pid, proc._ticks = pid, ticks
        return proc

    def record(self) -> dict[str, Any]:
        """What a later run of the agent needs to adopt this engine (no key)."""
        return {"replica_id": self.spec.replica_id, "model": self.spec.model,
                "weights": self.spec.weights, "engine": self.spec.engine,
                "gpus": list(self.spec.gpus), "host": self.host, "port": self.port,
                "log": str(self.log_path), "pid": self.pid, "ticks": self._ticks}

    def runs(self, spec: EngineSpec) -> bool:
        """Whether this engine serves `spec` (keys aside)."""
        return (self.spec.model, self.spec.weights, self.spec.engine, self.spec.gpus) == (
            spec.model, spec.weights, spec.engine, spec.gpus)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else self._pid

    async def start(self, vllm_bin: str) -> None:
        cmd = command(self.spec, self.host, self.port, vllm_bin)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        # A local file opened once per engine start: not worth a thread.
        with open(self.log_path, "ab") as log:  # noqa: ASYNC230
            self._proc = await asyncio.create_subprocess_exec(
                *cmd, stdin=asyncio.subprocess.DEVNULL, stdout=log, stderr=log,
                env=environment(self.spec),
            )
        self._ticks = start_ticks(self._proc.pid)
        logger.info("started %s engine for %s (pid %d, port %d)",
                    self.spec.engine, self.spec.replica_id, self._proc.pid, self.port)

    def exit_code(self) -> int | None:
        """None while it runs. An adopted engine's real code is unknown: -1."""
        if self._proc is not None:
            return self._proc.returncode
        if self._pid is not None and start_ticks(self._pid) == self._ticks:
            return None
        return -1

    def log_tail(self, lines: int = 5) -> str:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(0, os.SEEK_END)
                f.seek(max(0, f.tell() - 8192))
                tail = deque(f.read().decode(errors="replace").splitlines(), maxlen=lines)
        except OSError:
            return ""
        # The key is on the command line and could be echoed; never pass it on.
        return "\n".join(tail).replace(self.spec.key, "***")

    async def stop(self) -> None:
        if self._proc is None:
            await self._stop_adopted()
            return
        proc = self._proc
        if proc.returncode is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(proc.wait(), _STOP_GRACE)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()
        logger.info("stopped engine for %s", self.spec.replica_id)

    async def _stop_adopted(self) -> None:
        """Not our child: signal it and watch /proc until it is gone."""
        if self._pid is None or self.exit_code() is not None:
            return
        loop = asyncio.get_running_loop()
        for sig, grace in ((signal.SIGTERM, _STOP_GRACE), (signal.SIGKILL, 5.0)):
            with contextlib.suppress(ProcessLookupError):
                os.kill(self._pid, sig)
            deadline = loop.time() + grace
            while loop.time() < deadline:
                if self.exit_code() is not None:
                    logger.info("stopped adopted engine for %s", self.spec.replica_id)
                    return
                await asyncio.sleep(0.1)
        logger.error("adopted engine of %s (pid %d) would not stop",
                     self.spec.replica_id, self._pid)


def resolve_vllm(configured: str) -> str:
    return configured or shutil.which("vllm") or "vllm"


def available_engines(gpus: list[GpuInfo], vllm_bin: str) -> list[Engine]:
    """Engines this node can run. An operator's own vLLM (`LLMGW_VLLM_BIN`)
    counts without a GPU check; one found on PATH needs GPUs."""
    engines: list[Engine] = []
    if vllm_bin or (gpus and shutil.which("vllm")):
        engines.append("vllm")
    if importlib.util.find_spec("llama_cpp") is not None:
        engines.append("llamacpp")
    return engines
