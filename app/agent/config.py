"""What one agent is told at start: its node, gateways, GPUs, engines and
the timings of its loops (the `llmgw agent` command line builds it)."""

from __future__ import annotations

import ssl
from dataclasses import dataclass, field
from pathlib import Path

from app.agent.nodeops import NodeOpsConfig
from app.wire.names import Engine
from app.wire.nodes import GpuInfo


@dataclass
class AgentConfig:
    gateways: list[str]
    node: str
    token: str
    gpus: list[GpuInfo]
    engines: list[Engine]
    work_dir: Path
    vllm_bin: str = "vllm"
    # Install and GPU-check the vLLM build the operator chooses for this node
    # (builds.py). Off: `vllm_bin` is the operator's own build, used as it is.
    install_builds: bool = False
    advertise_host: str = ""
    # Engines outlive the agent unless this is set: a restarted agent (an
    # upgrade, a crash) adopts them instead of reloading every model.
    stop_engines_on_exit: bool = False
    heartbeat_interval: float = 5.0
    observe_interval: float = 1.0
    poll_wait: float = 25.0
    # Per probe; a slow answer counts as a failed probe.
    probe_timeout: float = 2.0
    # Seconds an engine may stay `starting` (never ready since its start, or
    # since its adoption) before it is stopped and counted as a death
    # (health.start_overdue). Generous: a large model's weights download and
    # load for many minutes (tens of GB at a few hundred MB/s, then CUDA
    # graphs); a shorter one kills slow but healthy loads again and again.
    # Set by `llmgw agent --start-timeout` / LLMGW_ENGINE_START_TIMEOUT.
    start_timeout: float = 1800.0
    # How https gateways are verified (app/tls.py); None: the system's CAs.
    gateway_tls: ssl.SSLContext | None = None
    # Hardware refresh, the agent's API, log files (nodeops.py).
    ops: NodeOpsConfig = field(default_factory=NodeOpsConfig)
