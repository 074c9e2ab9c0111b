"""The node agent: reports its node, runs the engines the leader assigns it.

Five one-step methods, each driven by a thin loop in `run()` and directly
by tests (docs/architecture.md, DESIGN invariant 7):
- `heartbeat()`: refresh the node's inventory (its lease keeps the node
  alive in the store);
- `poll(wait)`: long-poll this node's assignments, answered as soon as they
  change; then `converge()` starts and stops engines to match;
- `observe()`: check each engine (process alive? answering?) and `report()`
  the phases that changed.

The gateway client and the clock are parameters: tests drive an agent with
an in-memory gateway and a clock they move, against real engine processes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any, Literal

import aiohttp

from app import __version__
from app.agent import applied, health
from app.agent.config import AgentConfig
from app.agent.engines import EngineProcess, EngineSpec, load_records, save_records
from app.agent.gateway_client import (
    GatewayAPI,
    GatewayClient,
    GatewayRefused,
    GatewayUnreachable,
    advertise_address,
)
from app.agent.loads import LoadTarget
from app.agent.nodeops import NodeOps
from app.agent.running import Running
from app.ports import free_port
from app.wire.names import Engine, Phase
from app.wire.nodes import DEFAULT_VLLM_VERSION, MAX_DETAIL, NodeInfo, ReplicaStatus, fit

logger = logging.getLogger(__name__)

Polled = Literal["changed", "unchanged", "stale"]


class Agent:
    def __init__(
        self, cfg: AgentConfig, clock: Callable[[], float] = time.monotonic,
        client: GatewayAPI | None = None,
    ) -> None:
        self.cfg = cfg
        self._clock = clock
        self.host = cfg.advertise_host or advertise_address(cfg.gateways[0])
        self.client: GatewayAPI = client or GatewayClient(
            cfg.gateways, cfg.node, cfg.token, tls=cfg.gateway_tls)
        self.desired: dict[str, EngineSpec] = {}
        self.fingerprint = ""
        # The store id and revision of the last assignments applied, kept
        # across runs: an older answer (a gateway whose watch lags) must
        # never undo a newer one, even the first answer after a restart.
        self.applied = applied.Kept(cfg.work_dir / "assignments.json")
        self.running: dict[str, Running] = {}
        self._reported: dict[str, tuple[Phase, str, str]] = {}
        self._last_full_report = float("-inf")
        self._converge_lock = asyncio.Lock()
        self.heartbeat_every = cfg.heartbeat_interval
        self._health: aiohttp.ClientSession | None = None
        # Until the first assignment arrives, what this node should run is
        # unknown: converging then would stop every adopted engine.
        self.synced = False
        self._state_path = cfg.work_dir / "engines.json"
        ops = cfg.ops
        if not cfg.install_builds:
            # `vllm_bin` as the operator's own build, if it is there: an
            # all-in-one on a CPU machine has none ("vllm", not on PATH),
            # which must not read as a usable build.
            ops = replace(ops, builds=replace(
                ops.builds, operator_bin=ops.builds.operator_bin
                or (cfg.vllm_bin if shutil.which(cfg.vllm_bin) else "")))
        self.ops = NodeOps(ops, node=cfg.node, token=cfg.token, work_dir=cfg.work_dir,
                           gpus=cfg.gpus, view=self, clock=clock, engines=self)

    async def start(self) -> None:
        await self.client.start()
        self._health = aiohttp.ClientSession()
        self.adopt()
        await self.ops.start(self.host)

    # --- engines left by an earlier run ---------------------------------------------

    def adopt(self) -> list[str]:
        """Takes over the engines an earlier run of this agent left running."""
        adopted = []
        for rec in load_records(self._state_path):
            proc = EngineProcess.adopt(rec)
            if proc is None:
                logger.info("engine of %s is gone; not adopted", rec.get("replica_id"))
                continue
            self.running[proc.spec.replica_id] = Running(proc, started_at=self._clock())
            adopted.append(proc.spec.replica_id)
            logger.info("adopted engine of %s (pid %s, %s)",
                        proc.spec.replica_id, proc.pid, proc.url)
        return adopted

    def _save(self) -> None:
        """Records the running engines (no keys) for a later run to adopt."""
        save_records(self._state_path, [e.proc for e in self.running.values()])

    def inventory(self) -> NodeInfo:
        return NodeInfo(
            name=self.cfg.node, engines=self.engines(), address=self.host,
            version=__version__, api_url=self.ops.api.url, **self.ops.node_fields(),
            **self.ops.build_fields(),
        )

    def engines(self) -> list[Engine]:
        """What this node can run: those found at start, and vLLM once a
        build installed here passed its check (a CPU node's `cpu` build is
        chosen by the operator after the agent started)."""
        if "vllm" in self.cfg.engines or not self.ops.builds.usable:
            return list(self.cfg.engines)
        return ["vllm", *self.cfg.engines]

    def engine_specs(self) -> list[EngineSpec]:
        """Assigned or running engines (the node API's NodeView): their
        weights are not removed, their keys are masked in logs."""
        return [*self.desired.values(), *(e.proc.spec for e in self.running.values())]

    def ready_engines(self) -> list[LoadTarget]:
        """Ready vLLM engines: their loads are read for the gateways (loads.py)."""
        return [LoadTarget(rid, e.proc.url, e.proc.spec.key) for rid, e in self.running.items()
                if e.phase == "ready" and e.proc.spec.engine == "vllm"]

    # --- steps -------------------------------------------------------------------

    async def heartbeat(self) -> None:
        await self.ops.refresh()  # now and then: free memory, utilisation
        answer = await self.client.heartbeat(self.inventory().model_dump(mode="json"))
        # The node's key lives `ttl` seconds past each heartbeat: beat at
        # least three times per TTL, whatever the gateways are set to.
        ttl = float(answer.get("ttl") or 0)
        if ttl > 0:
            self.heartbeat_every = min(self.cfg.heartbeat_interval, ttl / 3)

    async def poll(self, wait: float) -> Polled:
        """Fetches the assignments and takes them unless they are older than
        the last ones taken. A gateway that cannot answer (unreachable, or a
        503: its state not loaded) raises, and nothing changes: the agent
        never converges on a list it did not get."""
        answer = await self.client.assignments(self.fingerprint, wait)
        got, older = self.applied.older_than(answer)
        if older is not None:
            logger.info("ignoring assignments at revision %d, older than the %d applied: "
                        "that gateway lags; asking the next one", got.revision, older)
            self.client.move_on()
            return "stale"
        self.applied.take(got)
        if not self.synced:
            self.ops.build_chosen.set()  # the build loop waited for the choice
        self.synced = True
        self.ops.choose(str(answer.get("engine_build") or "auto"),
                        str(answer.get("vllm_version") or DEFAULT_VLLM_VERSION))
        if answer["fingerprint"] == self.fingerprint:
            return "unchanged"
        self.fingerprint = answer["fingerprint"]
        self.desired = {
            r["id"]: EngineSpec(
                replica_id=r["id"], model=r["model"], weights=r["weights"],
                engine=r["engine"], gpus=tuple(r["gpus"]), key=r["key"],
                weights_revision=r.get("weights_revision"),
                engine_args=tuple(r.get("engine_args") or ()),
            )
            for r in answer["replicas"]
        }
        return "changed"

    async def converge(self) -> tuple[list[str], list[str]]:
        """Starts missing engines, stops unwanted ones (in parallel), restarts
        failed ones after a backoff. Returns (started, stopped) replica ids."""
        if not self.synced:
            return [], []
        async with self._converge_lock:
            stopped = [r for r, e in self.running.items()
                       if r not in self.desired or not e.proc.runs(self.desired[r])]
            leaving = [self.running.pop(rid).proc for rid in stopped]
            await asyncio.gather(*(proc.stop() for proc in leaving))
            for rid in stopped:
                self._reported.pop(rid, None)
            if stopped:
                self._save()
            started = []
            now = self._clock()
            for rid, spec in self.desired.items():
                cur = self.running.get(rid)
                if cur is not None:
                    # An adopted engine learns its key here; a new key for a
                    # running engine (a secret rotation) is checked against it.
                    if cur.proc.spec.key and cur.proc.spec.key != spec.key:
                        cur.key_unchecked = True
                    cur.proc.spec = spec
                    if cur.phase != "failed" or cur.given_up or now < cur.retry_at:
                        continue
                proc = EngineProcess(spec, self.host, free_port(self.host),
                                     self.cfg.work_dir / "logs" / f"{rid}.log")
                entry = cur or Running(proc)
                self.running[rid] = entry
                try:
                    await proc.start(self._vllm_bin(spec))
                except OSError as exc:
                    self._died(entry, f"could not start {spec.engine}: {exc}")
                    continue
                if cur is not None:  # a restart: the deaths so far still count
                    entry.detail = "restarted after: " + (entry.detail.splitlines() or [""])[0]
                entry.proc, entry.phase, entry.was_ready, entry.probe_failures = (
                    proc, "starting", False, 0)
                entry.started_at = now
                started.append(rid)
                # Recorded before the next engine starts: an agent killed
                # between two starts leaves no engine it would not adopt.
                self._save()
            return started, stopped

    def _vllm_bin(self, spec: EngineSpec) -> str:
        """The vllm executable: the node's verified build (builds.py)."""
        if spec.engine != "vllm":
            return self.cfg.vllm_bin
        found = self.ops.builds.vllm_bin()
        if found is None:
            raise OSError(f"no usable vLLM build on this node ({self.ops.builds.status()})")
        return found

    def _died(self, entry: Running, reason: str) -> None:
        """Marks the replica failed: restarted after a backoff, or, dying
        again and again, left failed (health.CRASH_LOOP_*)."""
        now = self._clock()
        entry.deaths = [*health.recent(entry.deaths, now), now]
        entry.phase, entry.given_up = "failed", health.crash_looping(entry.deaths)
        delay = None if entry.given_up else health.backoff(len(entry.deaths))
        entry.retry_at = now + (delay or 0.0)
        entry.detail = health.death_detail(reason, len(entry.deaths), delay,
                                           entry.proc.log_tail())

    async def observe(self) -> None:
        """Updates each engine's phase from its process and its API."""
        await asyncio.gather(*(self._check(rid, e) for rid, e in list(self.running.items())))

    async def _check(self, rid: str, entry: Running) -> None:
        assert self._health is not None
        if entry.phase == "failed":
            return
        proc = entry.proc
        reason = proc.exit_reason()
        if reason is not None:
            proc.clear_group()
            self._died(entry, f"engine {reason}")
            log = logger.error if entry.given_up else logger.warning
            log("engine of %s %s%s", rid, reason,
                "; it keeps dying: not restarted" if entry.given_up else "")
            return
        timeout = self.cfg.probe_timeout
        if not entry.was_ready:
            ready = await health.serves_model(self._health, proc.url, proc.spec.key,
                                              proc.spec.model, timeout)
            entry.key_unchecked = False
            if ready == "ready":
                logger.info("replica %s is ready at %s", rid, proc.url)
                entry.phase, entry.detail, entry.was_ready = "ready", "", True
                entry.probe_failures, entry.started_at = 0, None
            elif ready == "key refused" and entry.detail != health.KEY_REFUSED:
                logger.warning("replica %s: its engine refuses its key", rid)
                entry.detail = health.KEY_REFUSED
            elif health.start_overdue(entry.started_at, self._clock(), self.cfg.start_timeout):
                # Failed first (the backoff set): neither a concurrent check
                # nor converge acts on it while it stops. Then the group goes.
                limit = self.cfg.start_timeout
                self._died(entry, f"not ready within {limit:.0f} s of its start; stopped")
                logger.warning("replica %s not ready within %.0f s of its start; stopping "
                               "it%s", rid, limit, "; not restarted" if entry.given_up else "")
                await proc.stop()
                self._save()
            return
        if entry.key_unchecked:
            checked = await health.serves_model(self._health, proc.url, proc.spec.key,
                                                proc.spec.model, timeout)
            entry.key_unchecked = checked == "no"  # no verdict: asked again next time
            if checked == "key refused":
                logger.warning("replica %s: its engine refuses its new key; out of routing", rid)
                entry.phase, entry.was_ready, entry.detail = (
                    "starting", False, health.KEY_REFUSED)
                return
        if await health.answers(self._health, proc.url, proc.spec.engine, timeout):
            entry.probe_failures = 0
            return
        entry.probe_failures += 1
        if entry.probe_failures >= health.LIVENESS_FAILURES:
            logger.warning("replica %s: %d liveness probes failed in a row; out of routing "
                           "until it lists its model again", rid, entry.probe_failures)
            entry.phase, entry.was_ready = "starting", False
            entry.detail = f"{entry.probe_failures} liveness probes failed in a row"

    def statuses(self) -> list[ReplicaStatus]:
        now = time.time()
        return [
            ReplicaStatus(id=rid, node=self.cfg.node, phase=e.phase, url=e.proc.url,
                          detail=fit(e.detail, MAX_DETAIL), updated=now,
                          given_up=e.phase == "failed" and e.given_up)
            for rid, e in sorted(self.running.items())
        ]

    async def report(self, full_every: float = 15.0) -> bool:
        """Sends the phases that changed (all of them now and then)."""
        statuses = self.statuses()
        current = {s.id: (s.phase, s.url, s.detail) for s in statuses}
        full = self._clock() - self._last_full_report >= full_every
        if current == self._reported and not full:
            return False
        await self.client.report([s.model_dump() for s in statuses])
        self._reported = current
        if full:
            self._last_full_report = self._clock()
        return True

    # --- loops ---------------------------------------------------------------------

    async def _every(
        self, every: Callable[[], float], step: Callable[[], Any], what: str
    ) -> None:
        failing = False
        while True:
            try:
                await step()
                if failing:
                    logger.info("%s works again", what)
                failing = False
            except (GatewayUnreachable, GatewayRefused, PermissionError) as exc:
                # Once per streak: an hour's outage (or bad CA) is one line.
                (logger.debug if failing else logger.warning)("%s failed: %s", what, exc)
                failing = True
                await asyncio.sleep(max(every(), 1.0))  # no busy loop on a dead gateway
            except Exception:
                logger.exception("%s crashed", what)
                await asyncio.sleep(max(every(), 1.0))
            await asyncio.sleep(every())

    async def _poll_step(self) -> None:
        polled = await self.poll(self.cfg.poll_wait)
        if polled == "stale":
            # A lagging gateway answers at once; do not spin on it.
            await asyncio.sleep(1.0)
        elif polled == "changed":
            await self.converge()
            await self.observe()
            await self.report()

    async def _observe_step(self) -> None:
        if not self.synced:
            return  # adopted engines have no key yet to be checked with
        await self.converge()  # restarts failed engines once their backoff ends
        await self.observe()
        await self.report()
        await self.ops.rotate(e.proc.log_path for e in self.running.values())

    async def build_step(self) -> None:
        """Brings the node to its chosen vLLM build, then reports it at once
        (placement waits on it); then waits for another choice."""
        if not self.synced:
            return  # the operator's choice is not known yet: install nothing
        self.ops.build_chosen.clear()
        if await self.ops.builds.step(self.ops.hardware.cuda_version):
            await self.heartbeat()

    async def _build_loop(self) -> None:
        while True:
            try:
                await self.build_step()
            except (GatewayUnreachable, GatewayRefused) as exc:
                logger.warning("reporting the engine build failed: %s", exc)
            except Exception:
                logger.exception("engine build step crashed")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.ops.build_chosen.wait(), 60.0)

    async def run(self) -> None:
        await asyncio.gather(
            self._build_loop(),
            self._every(lambda: self.heartbeat_every, self.heartbeat, "heartbeat"),
            self._every(lambda: 0.0, self._poll_step, "assignment poll"),
            self._every(lambda: self.cfg.observe_interval, self._observe_step, "engine check"),
        )

    async def shutdown(self, stop_engines: bool | None = None) -> None:
        """Stops the agent; its engines too if asked (default: the config's)."""
        if stop_engines is None:
            stop_engines = self.cfg.stop_engines_on_exit
        async with self._converge_lock:
            if stop_engines:
                await asyncio.gather(*(e.proc.stop() for e in self.running.values()))
                self.running.clear()
            else:
                logger.info("leaving %d engines running for the next run to adopt",
                            len(self.running))
            self._save()
        await self.client.close()
        if self._health is not None:
            await self._health.close()
        await self.ops.stop()
