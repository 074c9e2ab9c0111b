"""The node agent: reports its node, runs the engines the leader assigns it.

Three one-step methods, each driven by a thin loop in `run()` and directly
by tests:
- `heartbeat()`: refresh the node's inventory (its lease keeps the node
  alive in the store);
- `poll(wait)`: long-poll this node's assignments, answered as soon as they
  change; then `converge()` starts and stops engines to match;
- `observe()`: check each engine (process alive? answering with its key?)
  and `report()` the phases that changed.

The agent talks to any gateway; with several it moves to the next one when
one fails, so a gateway's death costs an agent one failed request.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import aiohttp

from app import __version__
from app.agent.engines import EngineProcess, EngineSpec, free_port
from app.control.state import Engine, GpuInfo, NodeInfo, Phase, ReplicaStatus

logger = logging.getLogger(__name__)


class GatewayUnreachable(Exception):
    pass


def advertise_address(gateway_url: str) -> str:
    """The local address of this host's route to the gateway.

    A UDP connect sends nothing; it only asks the kernel which source address
    it would use. On loopback that is 127.0.0.1, as in every test here.
    """
    parts = urlsplit(gateway_url)
    host = parts.hostname or "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            sock.connect((host, parts.port or 80))
            return str(sock.getsockname()[0])
        except OSError:
            return "127.0.0.1"


class GatewayClient:
    """HTTP to the gateways' /agent/v1 API, moving on when one fails."""

    def __init__(self, urls: Sequence[str], node: str, token: str) -> None:
        if not urls:
            raise ValueError("at least one gateway URL is needed")
        self._urls = [u.rstrip("/") for u in urls]
        self._current = 0
        self._node = node
        self._token = token
        self._session: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        self._session = aiohttp.ClientSession(
            headers={"Authorization": f"Bearer {self._token}"}
        )

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    async def call(
        self, method: str, path: str, *, body: Any = None,
        params: dict[str, str] | None = None, timeout: float = 10.0,
    ) -> Any:
        assert self._session is not None
        last: Exception | None = None
        for _ in range(len(self._urls)):
            url = f"{self._urls[self._current]}/agent/v1/nodes/{self._node}{path}"
            try:
                async with self._session.request(
                    method, url, json=body, params=params,
                    timeout=aiohttp.ClientTimeout(total=timeout),
                ) as resp:
                    if resp.status in (401, 403):
                        raise PermissionError(
                            f"gateway refused this agent's token for node {self._node}"
                        )
                    if resp.status >= 500:
                        raise GatewayUnreachable(f"{url} answered {resp.status}")
                    resp.raise_for_status()
                    return await resp.json()
            except (aiohttp.ClientError, TimeoutError, GatewayUnreachable) as exc:
                last = exc
                self._current = (self._current + 1) % len(self._urls)
        raise GatewayUnreachable(f"no gateway answered: {last}")


@dataclass
class _Running:
    proc: EngineProcess
    phase: Phase = "starting"
    detail: str = ""
    failures: int = 0
    retry_at: float = 0.0


@dataclass
class AgentConfig:
    gateways: list[str]
    node: str
    token: str
    gpus: list[GpuInfo]
    engines: list[Engine]
    work_dir: Path
    vllm_bin: str = "vllm"
    advertise_host: str = ""
    # Engines outlive the agent unless this is set: a restarted agent (an
    # upgrade, a crash) adopts them instead of reloading every model.
    stop_engines_on_exit: bool = False
    heartbeat_interval: float = 5.0
    observe_interval: float = 1.0
    poll_wait: float = 25.0


class Agent:
    def __init__(self, cfg: AgentConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self.cfg = cfg
        self._clock = clock
        self.host = cfg.advertise_host or advertise_address(cfg.gateways[0])
        self.client = GatewayClient(cfg.gateways, cfg.node, cfg.token)
        self.desired: dict[str, EngineSpec] = {}
        self.fingerprint = ""
        self.running: dict[str, _Running] = {}
        self._reported: dict[str, tuple[Phase, str, str]] = {}
        self._last_full_report = float("-inf")
        self._converge_lock = asyncio.Lock()
        self.heartbeat_every = cfg.heartbeat_interval
        self._health: aiohttp.ClientSession | None = None
        # Until the first assignment arrives, what this node should run is
        # unknown: converging then would stop every adopted engine.
        self.synced = False
        self._state_path = cfg.work_dir / "engines.json"

    async def start(self) -> None:
        await self.client.start()
        self._health = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2.0))
        self.adopt()

    # --- engines left by an earlier run ---------------------------------------------

    def adopt(self) -> list[str]:
        """Takes over the engines an earlier run of this agent left running."""
        try:
            records = json.loads(self._state_path.read_text())
        except FileNotFoundError:
            return []
        except (OSError, ValueError) as exc:
            logger.warning("ignoring unreadable %s: %s", self._state_path, exc)
            return []
        adopted = []
        for rec in records:
            proc = EngineProcess.adopt(rec)
            if proc is None:
                logger.info("engine of %s is gone; not adopted", rec.get("replica_id"))
                continue
            self.running[proc.spec.replica_id] = _Running(proc)
            adopted.append(proc.spec.replica_id)
            logger.info("adopted engine of %s (pid %s, %s)",
                        proc.spec.replica_id, proc.pid, proc.url)
        return adopted

    def _save(self) -> None:
        """Records the running engines (no keys) for a later run to adopt."""
        records = [e.proc.record() for e in self.running.values()
                   if e.proc.exit_code() is None]
        self._state_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self._state_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(records))
        tmp.replace(self._state_path)

    def inventory(self) -> NodeInfo:
        return NodeInfo(
            name=self.cfg.node, gpus=self.cfg.gpus, engines=self.cfg.engines,
            address=self.host, version=__version__,
        )

    # --- steps -------------------------------------------------------------------

    async def heartbeat(self) -> None:
        answer = await self.client.call("PUT", "", body=self.inventory().model_dump(mode="json"))
        # The node's key lives `ttl` seconds past each heartbeat: beat at
        # least three times per TTL, whatever the gateways are set to.
        ttl = float(answer.get("ttl") or 0)
        if ttl > 0:
            self.heartbeat_every = min(self.cfg.heartbeat_interval, ttl / 3)

    async def poll(self, wait: float) -> bool:
        """Fetches the assignments; True when they changed."""
        answer = await self.client.call(
            "GET", "/assignments", params={"since": self.fingerprint, "wait": str(wait)},
            timeout=wait + 10.0,
        )
        self.synced = True
        if answer["fingerprint"] == self.fingerprint:
            return False
        self.fingerprint = answer["fingerprint"]
        self.desired = {
            r["id"]: EngineSpec(
                replica_id=r["id"], model=r["model"], weights=r["weights"],
                engine=r["engine"], gpus=tuple(r["gpus"]), key=r["key"],
            )
            for r in answer["replicas"]
        }
        return True

    async def converge(self) -> tuple[list[str], list[str]]:
        """Starts missing engines, stops unwanted ones, restarts failed ones
        after a backoff. Returns (started, stopped) replica ids."""
        if not self.synced:
            return [], []
        async with self._converge_lock:
            started, stopped = [], []
            for rid in [r for r, e in self.running.items()
                        if r not in self.desired or not e.proc.runs(self.desired[r])]:
                await self.running.pop(rid).proc.stop()
                self._reported.pop(rid, None)
                stopped.append(rid)
            now = self._clock()
            for rid, spec in self.desired.items():
                cur = self.running.get(rid)
                if cur is not None:
                    cur.proc.spec = spec  # an adopted engine learns its key here
                if cur is not None and (cur.phase != "failed" or now < cur.retry_at):
                    continue
                proc = EngineProcess(spec, self.host, free_port(self.host),
                                     self.cfg.work_dir / "logs" / f"{rid}.log")
                try:
                    await proc.start(self.cfg.vllm_bin)
                except OSError as exc:
                    entry = cur or _Running(proc)
                    self._fail(entry, f"could not start {spec.engine}: {exc}")
                    self.running[rid] = entry
                    continue
                failures = cur.failures if cur else 0
                self.running[rid] = _Running(proc, failures=failures)
                started.append(rid)
            if started or stopped:
                self._save()
            return started, stopped

    def _fail(self, entry: _Running, detail: str) -> None:
        entry.phase = "failed"
        entry.detail = detail
        entry.failures += 1
        entry.retry_at = self._clock() + min(60.0, 2.0 * 2 ** entry.failures)

    async def observe(self) -> None:
        """Updates each engine's phase from its process and its API."""
        await asyncio.gather(*(self._check(rid, e) for rid, e in list(self.running.items())))

    async def _check(self, rid: str, entry: _Running) -> None:
        assert self._health is not None
        if entry.phase == "failed":
            return
        code = entry.proc.exit_code()
        if code is not None:
            self._fail(entry, f"engine exited with code {code}: {entry.proc.log_tail()}")
            logger.warning("engine of %s exited with code %d", rid, code)
            return
        try:
            async with self._health.get(
                entry.proc.url + "/v1/models",
                headers={"Authorization": f"Bearer {entry.proc.spec.key}"},
            ) as resp:
                ok = resp.status == 200
        except (aiohttp.ClientError, TimeoutError):
            ok = False
        if ok and entry.phase != "ready":
            logger.info("replica %s is ready at %s", rid, entry.proc.url)
        entry.phase = "ready" if ok else "starting"
        entry.detail = "" if ok else entry.detail

    def statuses(self) -> list[ReplicaStatus]:
        now = time.time()
        return [
            ReplicaStatus(id=rid, node=self.cfg.node, phase=e.phase, url=e.proc.url,
                          detail=e.detail, updated=now)
            for rid, e in sorted(self.running.items())
        ]

    async def report(self, full_every: float = 15.0) -> bool:
        """Sends the phases that changed (all of them now and then)."""
        current = {s.id: (s.phase, s.url, s.detail) for s in self.statuses()}
        full = self._clock() - self._last_full_report >= full_every
        if current == self._reported and not full:
            return False
        await self.client.call(
            "PUT", "/status", body={"replicas": [s.model_dump() for s in self.statuses()]}
        )
        self._reported = current
        if full:
            self._last_full_report = self._clock()
        return True

    # --- loops ---------------------------------------------------------------------

    async def _every(
        self, every: Callable[[], float], step: Callable[[], Any], what: str
    ) -> None:
        while True:
            try:
                await step()
            except (GatewayUnreachable, PermissionError) as exc:
                logger.warning("%s failed: %s", what, exc)
                await asyncio.sleep(max(every(), 1.0))  # no busy loop on a dead gateway
            except Exception:
                logger.exception("%s crashed", what)
                await asyncio.sleep(max(every(), 1.0))
            await asyncio.sleep(every())

    async def _poll_step(self) -> None:
        if await self.poll(self.cfg.poll_wait):
            await self.converge()
            await self.observe()
            await self.report()

    async def _observe_step(self) -> None:
        if not self.synced:
            return  # adopted engines have no key yet to be checked with
        await self.converge()  # restarts failed engines once their backoff ends
        await self.observe()
        await self.report()

    async def run(self) -> None:
        await asyncio.gather(
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
