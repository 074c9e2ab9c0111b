"""Engine processes: the command line for each engine, and one running engine.

vLLM is started with its real command line (`vllm serve MODEL --port P
--served-model-name NAME --middleware ...`), llama.cpp through
llama-cpp-python's OpenAI server (`python -m llama_cpp.server`, through
llamacpp_server.py, which keeps the liveness probe out of its log). Each engine
demands its replica's key, so a request that did not come through a gateway
(or a key taken from another node) is refused by the engine itself: vLLM's
own key guards `/v1` only, so llmgw's middleware (engine_site/) guards its
other paths; llama-cpp-python guards every route but its API docs.

The key reaches the engine through its environment (`VLLM_API_KEY`, read by
vLLM; `API_KEY`, read by llama-cpp-python's settings), never its command
line: any local user can read /proc/PID/cmdline, only the engine's own user
(and root) its /proc/PID/environ. Engine logs are 0600 in a 0700 folder.

Each engine runs in a session (and process group) of its own: vLLM with
tensor parallelism has worker processes, and a stop signals the whole group
so that no worker outlives its engine holding GPU memory. The agent's own
signals (a Ctrl-C in its terminal, systemd stopping it with
KillMode=process) then reach the agent alone, and engines outlive it.

vLLM's processes talk over ZeroMQ on Unix sockets it makes in the system's
temporary folder and leaves there when it is killed: months of engine
crashes and restarts would fill /tmp with them. Each vLLM engine gets a
folder of its own for them (`VLLM_RPC_BASE_PATH`, `EngineProcess.rpc`),
removed once the engine is gone, however it went. Made by `mkdtemp`: a name
another local user cannot guess and take first in the shared /tmp.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import json
import logging
import os
import shutil
import signal
import sys
import tempfile
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from app.agent.health import describe_exit
from app.wire.names import Engine
from app.wire.nodes import GpuInfo

logger = logging.getLogger(__name__)

_STOP_GRACE = 10.0  # seconds between SIGTERM and SIGKILL

# llama.cpp's context (prompt + answer, in tokens). llama-cpp-python's default,
# 2048, cuts long answers short; a larger one costs KV-cache memory (for an 8B
# model about 1 GiB at 8192). 8192 is SmolLM2's and Llama 3's trained length.
LLAMACPP_N_CTX = 8192

# llama-cpp-python's server as the agent starts it (llamacpp_server.py).
LLAMACPP_SERVER = "app.agent.llamacpp_server"

# vLLM's --middleware: a stdlib-only module in ENGINE_SITE, put on the engine's
# PYTHONPATH (the engine's own venv does not have llmgw).
ENGINE_SITE = Path(__file__).resolve().parent / "engine_site"
GUARD_MIDDLEWARE = "llmgw_engine_guard.EngineKeyMiddleware"


@dataclass(frozen=True)
class EngineSpec:
    """Everything needed to start one replica's engine."""

    replica_id: str
    model: str  # the name the engine serves (the catalog name)
    weights: str
    engine: Engine
    gpus: tuple[int, ...]
    key: str
    weights_revision: str | None = None  # a hub branch, tag or commit (vLLM's --revision)
    # The profile's extra engine flags, validated by the catalog (never a
    # flag we set ourselves: key, host, port, served name).
    engine_args: tuple[str, ...] = ()


def vllm_start(vllm_bin: str, weights: str) -> list[str]:
    """How vLLM starts: `vllm serve WEIGHTS`, or, given a Python interpreter
    (the CPU build's: builds.entry; or an operator's LLMGW_VLLM_BIN), its
    OpenAI server's module, which takes the same flags with `--model`."""
    if Path(vllm_bin).name.startswith("python"):
        return [vllm_bin, "-m", "vllm.entrypoints.openai.api_server", "--model", weights]
    return [vllm_bin, "serve", weights]


def command(spec: EngineSpec, host: str, port: int, vllm_bin: str) -> list[str]:
    if spec.engine == "vllm":
        cmd = [
            *vllm_start(vllm_bin, spec.weights),
            "--host", host, "--port", str(port),
            "--served-model-name", spec.model,
            # The key on every path, not /v1 alone (docs/design/security.md, "The engine's port");
            # importable through ENGINE_SITE.
            "--middleware", GUARD_MIDDLEWARE,
        ]
        if spec.weights_revision:
            cmd += ["--revision", spec.weights_revision]
        if len(spec.gpus) > 1:
            cmd += ["--tensor-parallel-size", str(len(spec.gpus))]
        return cmd + list(spec.engine_args)
    threads = max(1, (os.cpu_count() or 2) // 2)
    return [
        # llama_cpp.server, its access log without the liveness probe's lines.
        sys.executable, "-m", LLAMACPP_SERVER,
        "--model", spec.weights, "--model_alias", spec.model,
        "--host", host, "--port", str(port),
        "--n_threads", str(threads), "--n_ctx", str(LLAMACPP_N_CTX),
        # By default the server ends a running stream as soon as another
        # request waits for the model (a second client, or a probe): every
        # stream but the last would be cut short. Off, requests take turns.
        "--interrupt_requests", "False",
        *spec.engine_args,
    ]


def environment(spec: EngineSpec, rpc: Path | None = None) -> dict[str, str]:
    env = dict(os.environ)
    # Our own secrets are not the engine's business.
    for name in ("LLMGW_SECRET", "LLMGW_AGENT_TOKEN", "LLMGW_ADMIN_TOKEN"):
        env.pop(name, None)
    if spec.engine == "vllm":
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in spec.gpus)
        env["VLLM_API_KEY"] = spec.key
        if rpc is not None:
            env["VLLM_RPC_BASE_PATH"] = str(rpc)
        if "--enable-lora" in spec.engine_args:
            # The leader loads adapters at run time (/v1/load_lora_adapter),
            # which vLLM serves only with this set (docs/design/lora-adapters.md).
            env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"
        # The guard middleware's folder, first: it holds nothing but that module.
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(ENGINE_SITE), env.get("PYTHONPATH", "")) if p)
    else:
        env["CUDA_VISIBLE_DEVICES"] = ""
        # llama-cpp-python reads its settings from the environment too, and
        # its uvicorn takes HOST and PORT from there over its command line.
        for name in ("HOST", "PORT", "CONFIG_FILE"):
            env.pop(name, None)
        env["API_KEY"] = spec.key
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
        # Whether the group of a dead engine was cleared: after that its pgid
        # is never signalled again, as the number may be reused.
        self._cleared = False
        # A vLLM engine's folder of ZeroMQ sockets (VLLM_RPC_BASE_PATH).
        self.rpc: Path | None = None

    @classmethod
    def adopt(cls, record: dict[str, Any]) -> EngineProcess | None:
        """The engine `record` describes, if that very process still runs
        (else its sockets' folder is removed).

        Its key is not recorded (keys are derived, never stored): it is set
        from the next assignment, before the engine is checked or reported.
        """
        pid, ticks = int(record["pid"]), int(record["ticks"])
        if start_ticks(pid) != ticks:
            # Gone (killed with the agent, as in a node's crash): what it
            # left of its sockets goes too.
            if record.get("rpc"):
                shutil.rmtree(record["rpc"], ignore_errors=True)
            return None
        spec = EngineSpec(replica_id=record["replica_id"], model=record["model"],
                          weights=record["weights"], engine=record["engine"],
                          gpus=tuple(record["gpus"]), key="",
                          weights_revision=record.get("weights_revision"),
                          engine_args=tuple(record.get("engine_args") or ()))
        proc = cls(spec, record["host"], int(record["port"]), Path(record["log"]))
        proc._pid, proc._ticks = pid, ticks
        proc.rpc = Path(record["rpc"]) if record.get("rpc") else None
        return proc

    def record(self) -> dict[str, Any]:
        """What a later run of the agent needs to adopt this engine (no key)."""
        return {"replica_id": self.spec.replica_id, "model": self.spec.model,
                "weights": self.spec.weights, "weights_revision": self.spec.weights_revision,
                "engine_args": list(self.spec.engine_args),
                "engine": self.spec.engine,
                "gpus": list(self.spec.gpus), "host": self.host, "port": self.port,
                "log": str(self.log_path), "pid": self.pid, "ticks": self._ticks,
                "rpc": str(self.rpc) if self.rpc is not None else None}

    def runs(self, spec: EngineSpec) -> bool:
        """Whether this engine serves `spec` (keys aside)."""
        def shape(s: EngineSpec) -> tuple[object, ...]:
            return (s.model, s.weights, s.weights_revision, s.engine, s.gpus, s.engine_args)

        return shape(self.spec) == shape(spec)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else self._pid

    async def start(self, vllm_bin: str) -> None:
        cmd = command(self.spec, self.host, self.port, vllm_bin)
        self._remove_rpc_dir()  # an earlier start's
        if self.spec.engine == "vllm":
            # A name no other user can guess and take first; 23 bytes, well
            # within a socket path's 107 with vLLM's uuid after it.
            self.rpc = Path(tempfile.mkdtemp(prefix="llmgw-rpc-"))
        fd = open_log(self.log_path)
        try:
            self._proc = await asyncio.create_subprocess_exec(
                *cmd, stdin=asyncio.subprocess.DEVNULL, stdout=fd, stderr=fd,
                env=environment(self.spec, self.rpc), start_new_session=True,
            )
        finally:
            os.close(fd)
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

    def exit_reason(self) -> str | None:
        """None while it runs, else how it ended ("killed by SIGILL")."""
        code = self.exit_code()
        if code is None:
            return None
        if self._proc is None:
            return "exited (not this agent's child: its exit status is unknown)"
        return describe_exit(code)

    def log_tail(self, lines: int = 5) -> str:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(0, os.SEEK_END)
                f.seek(max(0, f.tell() - 8192))
                tail = deque(f.read().decode(errors="replace").splitlines(), maxlen=lines)
        except OSError:
            return ""
        text = "\n".join(tail)
        # An engine may echo its settings, the key among them: never pass it on.
        return text.replace(self.spec.key, "***") if self.spec.key else text

    def clear_group(self) -> None:
        """SIGKILLs what is left of a dead engine's process group: workers
        outlive a leader killed by a signal, and hold its GPUs' memory; and
        removes its sockets' folder.

        Done once, as soon as the death is seen: a group's number is not
        reused while a member lives, but once the group is empty it may be.
        """
        if self.exit_code() is None:
            return
        self._remove_rpc_dir()
        if self._proc is None or self._cleared:
            return
        self._cleared = True
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self._proc.pid, signal.SIGKILL)

    def _remove_rpc_dir(self) -> None:
        if self.rpc is not None:
            shutil.rmtree(self.rpc, ignore_errors=True)
            self.rpc = None

    async def stop(self) -> None:
        """SIGTERM to the engine's group, SIGKILL to it after the grace period
        (or as soon as the engine is gone: what is left is a straggler)."""
        if self._proc is None:
            await self._stop_adopted()
            return
        proc = self._proc
        if proc.returncode is not None:
            self.clear_group()
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGTERM)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(proc.wait(), _STOP_GRACE)
        self._cleared = True
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        await proc.wait()
        self._remove_rpc_dir()
        logger.info("stopped engine for %s (%s)", self.spec.replica_id,
                    describe_exit(proc.returncode or 0))

    def _adopted_group(self) -> int | None:
        """The adopted engine's group, if it leads one of its own.

        Engines started by an older agent shared the agent's group: signalling
        that group would kill the agent. Checked while the engine is known to
        be the very process recorded (pid and start time), so a reused pid
        never gets a group kill.
        """
        assert self._pid is not None
        try:
            pgid = os.getpgid(self._pid)
        except ProcessLookupError:
            return None
        return pgid if pgid == self._pid and self.exit_code() is None else None

    async def _stop_adopted(self) -> None:
        """Not our child: signal it (its group if it leads one) and watch
        /proc until it is gone."""
        if self._pid is None or self.exit_code() is not None:
            return
        pid = self._pid
        group = self._adopted_group()
        loop = asyncio.get_running_loop()
        for sig, grace in ((signal.SIGTERM, _STOP_GRACE), (signal.SIGKILL, 5.0)):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                if group is not None:
                    os.killpg(group, sig)
                else:
                    os.kill(pid, sig)
            deadline = loop.time() + grace
            while loop.time() < deadline:
                if self.exit_code() is not None:
                    if group is not None:  # stragglers, seen alive 0.1 s ago
                        with contextlib.suppress(ProcessLookupError, PermissionError):
                            os.killpg(group, signal.SIGKILL)
                    self._remove_rpc_dir()
                    logger.info("stopped adopted engine for %s", self.spec.replica_id)
                    return
                await asyncio.sleep(0.1)
        logger.error("adopted engine of %s (pid %d) would not stop",
                     self.spec.replica_id, pid)


def load_records(path: Path) -> list[dict[str, Any]]:
    """The engines an earlier run recorded (EngineProcess.record), if readable."""
    try:
        records = json.loads(path.read_text())
    except FileNotFoundError:
        return []
    except (OSError, ValueError) as exc:
        logger.warning("ignoring unreadable %s: %s", path, exc)
        return []
    return list(records)


def sweep_gone(root: Path, within: float) -> None:
    """For every agent's record under `root` (its engines.json): removes
    what an engine killed with its agent left (its sockets' folder), as
    that agent's next start would, waiting up to `within` seconds for the
    engines to be gone. For the harnesses that kill whole fleets (the test
    suite's, bench/chaos_rig.py's)."""
    records = [r for f in root.rglob("engines.json") for r in load_records(f)]
    deadline = time.monotonic() + within
    while records and time.monotonic() < deadline:
        records = [r for r in records if EngineProcess.adopt(r) is not None]
        if records:
            time.sleep(0.05)


def save_records(path: Path, procs: Iterable[EngineProcess]) -> None:
    """Records the engines still running (no keys), atomically."""
    write_json(path, [p.record() for p in procs if p.exit_code() is None])


def write_json(path: Path, value: Any) -> None:
    """`value` as JSON in `path`, whole or not at all: a crash mid-write
    leaves the old file (a temporary file renamed over it)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(value))
    tmp.replace(path)


def open_log(path: Path) -> int:
    """The engine's log, opened for appending: 0600 in a 0700 folder (an
    engine may log prompts). Modes are set even on ones an older version
    made wider."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(path.parent, 0o700)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.fchmod(fd, 0o600)
    return fd


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
