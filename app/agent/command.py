"""`llmgw agent`: the node agent's process, from its command line to its
event loop (docs/architecture.md, "Processes")."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import shlex
import shutil
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

from app.logs import stop as stop_logging

if TYPE_CHECKING:
    # Imported when the command runs (app/cli.py imports this module for
    # every command): `llmgw ctl` loads none of the agent.
    from app.agent.config import AgentConfig
    from app.agent.upgrade import Source, UpgradeConfig


def run(args: argparse.Namespace) -> None:
    """`llmgw agent`'s arguments (app/cli.py parses them) to a running
    agent, re-executed on new code after a self-upgrade."""
    from app.agent.upgrade import UpgradeConfig

    cfg, source = agent_config(args)
    for gone in ("LLMGW_AGENT_INSTALLER", "LLMGW_AGENT_INSTALLER_ARGS"):
        if os.environ.get(gone):  # warned, not refused: an upgraded agent must start
            logging.getLogger(__name__).warning(
                "%s is no longer read: upgrades come from LLMGW_AGENT_UPGRADE_SOURCE", gone)
    installed = asyncio.run(serve(cfg, UpgradeConfig(source=source,
                                                     timeout=args.upgrade_timeout)))
    if installed:
        reexec(installed)


def refuse(message: str) -> NoReturn:
    print(f"llmgw agent: {message}", file=sys.stderr)
    raise SystemExit(2)


def agent_config(args: argparse.Namespace) -> tuple[AgentConfig, Source | None]:
    """The agent's configuration and its upgrade source, from its command
    line and environment; exits (status 2) on one it cannot run with."""
    from app.agent.builds import builds_config
    from app.agent.config import AgentConfig
    from app.agent.engines import available_engines, resolve_vllm
    from app.agent.gpuhealth import GpuHealth, load_pynvml
    from app.agent.gpus import declared_hardware, probe
    from app.agent.nodeops import NodeOpsConfig
    from app.agent.upgrade import parse_source
    from app.agent.weights import default_cache_dir
    from app.tls import client_context

    token = os.environ.get("LLMGW_AGENT_TOKEN", "")
    if not token:
        refuse("set LLMGW_AGENT_TOKEN (from `llmgw ctl node-token NODE`)")
    try:
        # The gateways are verified against this PEM bundle (default: the
        # system's CAs); there is no way to turn verification off.
        gateway_tls = client_context(os.environ.get("LLMGW_CA_FILE") or None)
    except ValueError as exc:
        refuse(str(exc))
    try:
        # Before anything runs: a bad installer or check template is named
        # now, not found by the build loop once a minute.
        builds = builds_config()
        source = parse_source(args.upgrade_source)
    except ValueError as exc:
        refuse(str(exc))
    vllm_env = os.environ.get("LLMGW_VLLM_BIN", "")
    # Before the event loop runs: discovery blocks (NVML, nvidia-smi).
    hw = declared_hardware(args.gpus) if args.gpus is not None else probe()
    gpus = hw.gpus
    work_dir = Path(args.work_dir or Path.home() / ".local/share/llmgw-agent" / args.node)
    # Health is watched where NVML found the GPUs (docs/design/gpu-health.md);
    # kept across restarts in the work directory.
    health = (GpuHealth(load_pynvml, work_dir / "gpu_health.json")
              if hw.source == "nvml" else None)
    return AgentConfig(
        gateways=[u for u in args.gateway.split(",") if u], node=args.node, token=token,
        # With no vLLM of the operator's, a GPU node installs its build itself.
        gpus=gpus, engines=available_engines(gpus, vllm_env or ("managed" if gpus else "")),
        work_dir=work_dir,
        vllm_bin=resolve_vllm(vllm_env), advertise_host=args.advertise_host or "",
        # LLMGW_VLLM_BIN, or a vllm on PATH, is the operator's own build:
        # used as it is, never installed over
        # (docs/design/node-operations.md, "Engine build per node").
        install_builds=not (vllm_env or shutil.which("vllm")),
        stop_engines_on_exit=args.stop_engines_on_exit, gateway_tls=gateway_tls,
        start_timeout=args.start_timeout,
        ops=NodeOpsConfig(
            hardware=hw, rediscover=probe if args.gpus is None else None,
            api_port=args.api_port, builds=builds, gpu_health=health,
            cache_dir=Path(args.cache_dir).expanduser() if args.cache_dir
            else default_cache_dir()),
    ), source


async def serve(cfg: AgentConfig, upgrade_cfg: UpgradeConfig) -> list[str]:
    """Runs the agent until a signal or a self-upgrade stops it; the version
    installed, if one was (then the caller re-executes)."""
    from app.agent.agent import Agent
    from app.agent.upgrade import Upgrader

    installed: list[str] = []
    a = Agent(cfg)
    loop = asyncio.get_running_loop()
    task = asyncio.current_task()
    assert task is not None

    def restart(version: str) -> None:
        installed.append(version)
        task.cancel()  # a clean stop: engines left running, records saved

    a.ops.api.upgrader = Upgrader(upgrade_cfg, restart)
    # Before start(): a stop during adoption must still be a clean one.
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, task.cancel)
    try:
        await a.start()
        logging.getLogger(__name__).info(
            "agent for node %s: %d GPUs (%s), engines %s, API at %s", cfg.node, len(cfg.gpus),
            a.ops.hardware.source, cfg.engines, a.ops.api.url or "(not served)")
        await a.run()
    except asyncio.CancelledError:
        pass
    finally:
        await a.shutdown()
    return installed


def reexec(installed: list[str]) -> NoReturn:
    """The same command line on the newly installed code; the new run
    adopts the engines left running (app/agent/upgrade.py)."""
    from app.agent.upgrade import reexec_argv

    argv = reexec_argv(sys.argv)
    logging.getLogger(__name__).info("re-executing on llmgw %s: %s", installed[0],
                                     shlex.join(argv))
    stop_logging()  # the queued lines written before the process is replaced
    logging.shutdown()
    os.execv(argv[0], argv)
