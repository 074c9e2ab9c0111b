"""The node's engine loads, read once here for every gateway
(docs/design/routing.md, "Choosing a replica").

About once a second the agent reads each of its ready vLLM engines'
`/metrics` (with the engine's key) and keeps the latest figures with the
time it read them; the node API serves them (`GET /node/v1/loads`) with
their age. Each gateway asks the agent, once a second, instead of every
engine: scrapes grow with the engines, not with engines x gateways, and
every gateway decides on the same figures.

An engine that does not answer keeps its last figures, ageing: a gateway
treats figures older than its staleness bound (3 s) as unknown. A replica
that is no longer ready here is dropped at once. A llama.cpp engine has no
/metrics and is not asked: its load is the gateways' in-flight count.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from typing import NamedTuple, Protocol

import aiohttp

from app.wire.loads import MAX_METRICS, Counts, parse_vllm_metrics, read_capped

logger = logging.getLogger(__name__)

# Reads in flight at once: a node runs a handful of engines, 8 GPUs at one
# each at most is common; more only opens more sockets at once.
_AT_ONCE = 16


class LoadTarget(NamedTuple):
    replica_id: str
    url: str
    key: str


class ReadyEngines(Protocol):
    """The agent's ready vLLM engines (app/agent/agent.py implements it)."""

    def ready_engines(self) -> Sequence[LoadTarget]: ...


class LoadGatherer:
    """`step()` is one round (tests drive it); `run()` repeats it every
    `interval`. `figures()` is what the node API serves."""

    def __init__(
        self,
        engines: ReadyEngines,
        *,
        interval: float = 1.0,
        timeout: float = 0.5,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._engines = engines
        self._interval = interval
        self._timeout = aiohttp.ClientTimeout(total=timeout)
        self._clock = clock
        # replica -> (counts, clock time they were read)
        self._latest: dict[str, tuple[Counts, float]] = {}
        self._session: aiohttp.ClientSession | None = None
        # Replicas whose last read failed (logged once a streak).
        self._failing: set[str] = set()

    async def step(self) -> dict[str, Counts | None]:
        """Reads every ready engine once; returns what each answered (None:
        no answer, or no vLLM gauges)."""
        if self._session is None:
            self._session = aiohttp.ClientSession()
        session = self._session
        targets = list(self._engines.ready_engines())
        gate = asyncio.Semaphore(_AT_ONCE)

        async def read(t: LoadTarget) -> Counts | None:
            async with gate:
                return await self._read(session, t)

        got = await asyncio.gather(*(read(t) for t in targets))
        now = self._clock()
        ready = {t.replica_id for t in targets}
        latest = {rid: fig for rid, fig in self._latest.items() if rid in ready}
        for t, counts in zip(targets, got, strict=True):
            if counts is not None:
                latest[t.replica_id] = (counts, now)
            self._note(t.replica_id, counts is not None)
        self._failing &= ready
        self._latest = latest
        return {t.replica_id: c for t, c in zip(targets, got, strict=True)}

    def _note(self, rid: str, answered: bool) -> None:
        """Logs a streak of unanswered reads at its start and end: a late read
        is most likely an engine too busy to answer within the timeout."""
        if not answered and rid not in self._failing:
            self._failing.add(rid)
            logger.info("engine of %s: /metrics not read within %.1f s; its last figures "
                        "age", rid, self._timeout.total or 0.0)
        elif answered and rid in self._failing:
            self._failing.discard(rid)
            logger.info("engine of %s: /metrics read again", rid)

    async def _read(self, session: aiohttp.ClientSession, t: LoadTarget) -> Counts | None:
        try:
            async with session.get(t.url + "/metrics", timeout=self._timeout,
                                   headers={"Authorization": f"Bearer {t.key}"}) as resp:
                if resp.status != 200:
                    return None
                raw = await read_capped(resp.content, MAX_METRICS)
        except (aiohttp.ClientError, TimeoutError):
            return None
        if len(raw) > MAX_METRICS:
            logger.warning("engine of %s: /metrics over %d bytes; not read", t.replica_id,
                           MAX_METRICS)
            return None
        return parse_vllm_metrics(raw.decode("utf-8", "replace"))

    def figures(self) -> dict[str, tuple[Counts, float]]:
        """Replica -> (counts, age in seconds), of engines ready at the last step."""
        now = self._clock()
        return {rid: (c, now - at) for rid, (c, at) in self._latest.items()}

    async def run(self) -> None:
        try:
            while True:
                try:
                    await self.step()
                except Exception:
                    logger.exception("engine load gathering crashed")
                await asyncio.sleep(self._interval)
        finally:
            await self.close()

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
