"""The agent's node-operation parts, wired in one place: its hardware as last
discovered, its own API (nodeapi.py), its log file and its engines' log
rotation (logfiles.py). See docs/design/node-operations.md.

Its engines' load figures (loads.py) are gathered from `start()` to
`stop()` while the API is served: gateways read them there.

The agent calls four one-step methods: `start()`, `refresh()` (from the
heartbeat), `rotate()` (from the engine check) and `stop()`; and its vLLM
build (builds.py) through `choose()` (from the assignments poll) and
`builds.step()` (from a loop of its own: an install takes minutes).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from app.agent import logfiles
from app.agent.builds import Builds, BuildsConfig
from app.agent.gpuhealth import GpuHealth
from app.agent.gpus import Hardware, host_only, refreshed
from app.agent.loads import LoadGatherer, ReadyEngines
from app.agent.nodeapi import NodeApi, NodeApiConfig, NodeView
from app.agent.weights import default_cache_dir
from app.wire.nodes import MAX_TEXT, GpuInfo, fit

logger = logging.getLogger(__name__)


@dataclass
class NodeOpsConfig:
    # Driver, CUDA, CPUs, memory and how GPUs were found; None: the host's
    # CPUs and memory around the agent's `gpus`.
    hardware: Hardware | None = None
    # Run again every `rediscover_interval` s, in a thread, for free memory
    # and utilisation; each change costs one inventory write to the store.
    rediscover: Callable[[], Hardware] | None = None
    rediscover_interval: float = 60.0
    # The API on the advertised address: 0 any free port (reported in the
    # inventory), None not served.
    api_port: int | None = 0
    cache_dir: Path = field(default_factory=default_cache_dir)
    # The agent's own log in work_dir/agent.log (the API's source "agent").
    log_to_file: bool = True
    # Agent and engine logs rotate past this size, `log_keep` copies kept.
    # Larger keeps more history on disk; each copy is up to this size.
    log_max_bytes: int = 64 * 2**20
    log_keep: int = 3
    # The vLLM build: installer and GPU check commands (builds.py).
    builds: BuildsConfig = field(default_factory=BuildsConfig)
    # Each GPU's health through NVML (gpuhealth.py); None: not watched
    # (GPUs declared or found by nvidia-smi). Each step checks every GPU's
    # ECC counts, then waits up to `health_interval` s for XID events: a
    # longer wait finds a grown ECC count or a lost GPU later; a shorter
    # one costs a few NVML calls per GPU more often. A step that has not
    # returned in `health_stall` s marks the GPU it was reading unhealthy.
    gpu_health: GpuHealth | None = None
    health_interval: float = 5.0
    health_stall: float = 30.0


class NodeOps:
    def __init__(
        self, cfg: NodeOpsConfig, *, node: str, token: str, work_dir: Path,
        gpus: list[GpuInfo], view: NodeView, clock: Callable[[], float],
        engines: ReadyEngines | None = None,
    ) -> None:
        self.cfg = cfg
        self._clock = clock
        self.hardware = cfg.hardware or host_only(gpus)
        self._rediscovered = clock()
        self.loads = LoadGatherer(engines) if engines is not None else None
        self._gathering: asyncio.Task[None] | None = None
        self._watching: asyncio.Task[None] | None = None
        self.api = NodeApi(NodeApiConfig(node=node, token=token, work_dir=work_dir,
                                         cache_dir=cfg.cache_dir, log_keep=cfg.log_keep), view,
                           self.loads)
        self._log_handler: logging.Handler | None = None
        self.builds = Builds(cfg.builds, work_dir)
        # Set when the gateways name another build: the build loop wakes.
        self.build_chosen = asyncio.Event()

    async def start(self, host: str) -> None:
        if self.cfg.gpu_health is not None:
            self._watching = asyncio.create_task(self._watch_health(self.cfg.gpu_health),
                                                 name="gpu-health")
        if self.cfg.log_to_file:
            self._log_handler = logfiles.file_handler(
                self.api.cfg.agent_log, self.cfg.log_max_bytes, self.cfg.log_keep)
            logging.getLogger("app").addHandler(self._log_handler)
        if self.cfg.api_port is not None:
            try:
                await self.api.start(host, self.cfg.api_port)
            except OSError as exc:  # engines matter more than logs: run on without it
                logger.error("node API not served: cannot listen on %s:%d: %s",
                             host, self.cfg.api_port, exc)
                return
            if self.loads is not None:
                self._gathering = asyncio.create_task(self.loads.run(), name="engine-loads")

    async def health_step(self, health: GpuHealth) -> bool:
        """One health step in a worker thread; a step stuck past
        `health_stall` marks the GPU it reads (and is then waited out: a
        hung NVML call cannot be cancelled). Returns whether a GPU's
        health changed."""
        job = asyncio.ensure_future(asyncio.to_thread(
            health.step, round(self.cfg.health_interval * 1000)))
        done, _ = await asyncio.wait({job}, timeout=self.cfg.health_stall)
        if done:
            return job.result()
        health.stalled(self.cfg.health_stall)
        await job
        return True

    async def _watch_health(self, health: GpuHealth) -> None:
        while True:
            try:
                await self.health_step(health)
            except Exception:
                logger.exception("GPU health step crashed")
                await asyncio.sleep(self.cfg.health_interval)

    def node_fields(self) -> dict[str, Any]:
        """The hardware's inventory fields, each GPU's health on it."""
        fields = self.hardware.node_fields()
        faults = self.cfg.gpu_health.reasons() if self.cfg.gpu_health is not None else {}
        fields["gpus"] = [
            g.model_copy(update={"health": "unhealthy",
                                 "health_reason": fit(faults[g.index], MAX_TEXT)})
            if g.index in faults else g for g in fields["gpus"]]
        return fields

    async def refresh(self) -> bool:
        """Discovers the hardware again if it is time, in a worker thread
        (gpus.refreshed decides what to keep). Returns whether it ran."""
        due = self._clock() - self._rediscovered >= self.cfg.rediscover_interval
        if self.cfg.rediscover is None or not due:
            return False
        self._rediscovered = self._clock()
        found = await asyncio.to_thread(self.cfg.rediscover)
        before = self.hardware
        self.hardware = refreshed(before, found)
        if self.cfg.gpu_health is not None:
            # A GPU fallen off the bus drops out of discovery: it stays in
            # the inventory, unhealthy, so that its replica is moved.
            sick, seen = self.cfg.gpu_health.reasons(), {g.index for g in self.hardware.gpus}
            kept = [g for g in before.gpus if g.index in sick and g.index not in seen]
            if kept:
                self.hardware = replace(self.hardware, gpus=sorted(
                    [*self.hardware.gpus, *kept], key=lambda g: g.index))
        return True

    def choose(self, build: str, version: str) -> None:
        """The build and vLLM version the gateways name for this node (the
        assignments answer)."""
        if (build, version) != (self.builds.choice, self.builds.version):
            logger.info("engine build for this node: %s, vLLM %s (was %s, %s)", build, version,
                        self.builds.choice, self.builds.version)
            self.builds.choice, self.builds.version = build, version
            self.build_chosen.set()

    def build_fields(self) -> dict[str, Any]:
        return {"vllm_build": self.builds.usable, "vllm_version": self.builds.usable_version,
                "vllm_build_check": self.builds.status()}

    async def rotate(self, logs: Iterable[Path]) -> list[Path]:
        """Rotates the engine logs grown past log_max_bytes."""
        return await logfiles.rotate_oversized(logs, self.cfg.log_max_bytes, self.cfg.log_keep)

    async def stop(self) -> None:
        if self._watching is not None:
            self._watching.cancel()
            await asyncio.gather(self._watching, return_exceptions=True)
            self._watching = None
        if self._gathering is not None:
            self._gathering.cancel()
            await asyncio.gather(self._gathering, return_exceptions=True)
            self._gathering = None
        await self.api.stop()
        if self._log_handler is not None:
            logging.getLogger("app").removeHandler(self._log_handler)
            self._log_handler.close()
            self._log_handler = None
