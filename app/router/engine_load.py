"""Engines' own load, polled off the request path (docs/architecture.md,
"Choosing a replica").

About once a second each routable engine's `/metrics` is read: vLLM's
`vllm:num_requests_running`, `vllm:num_requests_waiting` and
`vllm:kv_cache_usage_perc` (`vllm:gpu_cache_usage_perc` before 0.9). The
counts cover every gateway's requests, which this gateway's in-flight
count cannot see. An engine without those gauges (llama-cpp-python's server
has no /metrics) or one that does not answer in time has no load: choice.py
then counts it as unknown, never as idle. A request never waits on a poll.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import aiohttp

from app.router.choice import EngineLoad
from app.router.table import RouteTable

logger = logging.getLogger(__name__)

# Scrapes in flight at once per gateway. 64 at ~1 ms each covers thousands
# of engines within the 1 s interval; more only opens more sockets at once.
_AT_ONCE = 64
_RUNNING = ("vllm:num_requests_running",)
_WAITING = ("vllm:num_requests_waiting",)
_KV = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")


def parse_vllm_metrics(text: str, at: float) -> EngineLoad | None:
    """The load in a Prometheus text page; None without vLLM's gauges.
    Several label sets of one gauge (one per served model name) are summed;
    the KV cache use is their largest."""
    sums: dict[str, float] = {}
    for line in text.splitlines():
        if not line.startswith("vllm:"):
            continue
        # `name{labels} value [timestamp]` or `name value [timestamp]`
        head, brace, tail = line.rpartition("}")
        name, fields = (head.split("{", 1)[0], tail.split()) if brace else (
            line.split()[0], line.split()[1:])
        try:
            value = float(fields[0])
        except (ValueError, IndexError):
            continue
        if name in _KV:
            sums["kv"] = max(sums.get("kv", 0.0), value)
        elif name in _RUNNING or name in _WAITING:
            sums[name] = sums.get(name, 0.0) + value
    if _RUNNING[0] not in sums or _WAITING[0] not in sums:
        return None
    return EngineLoad(sums[_RUNNING[0]], sums[_WAITING[0]], sums.get("kv", 0.0), at)


class EngineLoadPoller:
    """Reads each routable engine's load into the route table. `poll()` is
    one round (tests drive it); `run()` repeats it every `interval`."""

    def __init__(
        self,
        table: RouteTable,
        session: Callable[[], aiohttp.ClientSession | None],
        *,
        interval: float = 1.0,
        timeout: float = 0.5,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._table = table
        self._session = session
        self._interval = interval
        self._timeout = aiohttp.ClientTimeout(total=timeout)
        self._clock = clock

    async def poll(self) -> dict[str, EngineLoad]:
        session = self._session()
        if session is None:
            return {}
        eps = [ep for ep in self._table.all_endpoints() if not ep.replica_id.startswith(
            "external:")]  # a provider's load is not ours to read
        # At most `_AT_ONCE` scrapes in flight: a fleet of thousands of
        # engines must not open thousands of connections at once, every second.
        gate = asyncio.Semaphore(_AT_ONCE)

        async def read(url: str, key: str) -> EngineLoad | None:
            async with gate:
                return await self._read(session, url, key)

        results = await asyncio.gather(*(read(ep.url, ep.key) for ep in eps))
        loads = {ep.replica_id: load for ep, load in zip(eps, results, strict=True)
                 if load is not None}
        self._table.set_loads(loads)
        return loads

    async def _read(self, session: aiohttp.ClientSession, url: str,
                    key: str) -> EngineLoad | None:
        try:
            async with session.get(url + "/metrics", timeout=self._timeout,
                                   headers={"Authorization": f"Bearer {key}"}) as resp:
                if resp.status != 200:
                    return None
                text = await resp.text()
        except (aiohttp.ClientError, TimeoutError, UnicodeDecodeError):
            return None
        return parse_vllm_metrics(text, self._clock())

    async def run(self) -> None:
        while True:
            try:
                await self.poll()
            except Exception:
                logger.exception("engine load poll crashed")
            await asyncio.sleep(self._interval)
