"""Engines' own load, read off the request path (docs/architecture.md,
"Choosing a replica").

About once a second this gateway asks each node's agent for its engines'
figures (`GET /node/v1/loads`, app/agent/loads.py): the agent reads its
ready vLLM engines' `/metrics` once for every gateway, so engines are
scraped once a second whatever the number of gateways, and every gateway
decides on the same figures. vLLM's `vllm:num_requests_running`,
`vllm:num_requests_waiting` and `vllm:kv_cache_usage_perc` cover every
gateway's requests, which this gateway's in-flight count cannot see.

A figure is dated by when the agent read it (its `age_s` before this
gateway received it), so the table's staleness bound covers the agent's lag
too. A node that does not answer keeps its last figures until they go
stale: unknown then, never idle (choice.py). A node whose agent has no
loads route (404: an older agent), or that reports no usable API URL, has
its engines' `/metrics` read one by one from here, as before agents served
loads: a rolling upgrade loses no figure. An agent's answer is read up to
a size cap and refused whole if it is not the expected shape; figures for
replicas not on that node are ignored. An engine without vLLM's gauges
(llama-cpp-python's server has no /metrics) has no load. A request never
waits on a poll.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol

import aiohttp

from app.router.choice import EngineLoad
from app.router.entries import Endpoint
from app.router.table import RouteTable
from app.wire.loads import (
    LOADS_PATH,
    MAX_ANSWER,
    MAX_METRICS,
    BadAnswer,
    Counts,
    parse_vllm_metrics,
    read_capped,
    read_loads_answer,
)

logger = logging.getLogger(__name__)

# Reads in flight at once per gateway. 64 at ~1 ms each covers thousands
# of nodes (or engines of older agents) within the 1 s interval; more only
# opens more sockets at once.
_AT_ONCE = 64
# How long an agent found without the loads route is read around (its
# engines one by one) before it is asked again: an upgraded agent is used
# within this long (at once if its API URL changed).
LEGACY_RECHECK = 60.0


@dataclass(frozen=True, slots=True)
class NodeAgent:
    """Where a replica's node serves its loads. `api_url` empty: none
    reported, or one this gateway must not send the node token to."""

    node: str
    api_url: str
    tokens: tuple[str, ...] = field(repr=False)  # the node tokens to present, in order


class NodeDirectory(Protocol):
    """Each routable replica's node agent, by replica id. The wiring builds
    it from the mirror (app/gateway/node_agents.py): the router never imports the
    control plane."""

    def agents(self) -> Mapping[str, NodeAgent]: ...


def engine_load(counts: Counts, at: float) -> EngineLoad:
    return EngineLoad(counts.running, counts.waiting, counts.kv, at)


class _Round:
    """What one poll found: figures, and the replicas whose source did not answer."""

    def __init__(self) -> None:
        self.found: dict[str, EngineLoad] = {}
        self.unanswered: set[str] = set()


class EngineLoadPoller:
    """Reads each routable engine's load into the route table. `poll()` is
    one round (tests drive it); `run()` repeats it every `interval`."""

    def __init__(
        self,
        table: RouteTable,
        session: Callable[[], aiohttp.ClientSession | None],
        *,
        directory: NodeDirectory | None = None,
        interval: float = 1.0,
        timeout: float = 0.5,
        connect_timeout: float = 0.25,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._table = table
        self._session = session
        self.directory = directory
        self._interval = interval
        self._timeout = aiohttp.ClientTimeout(total=timeout, sock_connect=connect_timeout)
        self._clock = clock
        self._legacy: dict[tuple[str, str], float] = {}  # (node, api_url) -> recheck at
        self._failing: set[str] = set()  # nodes whose last ask failed (logged once)
        self._last: dict[str, EngineLoad] = {}

    async def poll(self) -> dict[str, EngineLoad]:
        session = self._session()
        if session is None:
            return {}
        eps = [ep for ep in self._table.all_endpoints() if not ep.replica_id.startswith(
            "external:")]  # a provider's load is not ours to read
        agents = self.directory.agents() if self.directory is not None else {}
        now = self._clock()
        self._legacy = {k: t for k, t in self._legacy.items() if t > now}
        by_node: dict[NodeAgent, list[Endpoint]] = {}
        direct: list[Endpoint] = []
        for ep in eps:
            agent = agents.get(ep.replica_id)
            if (agent is not None and agent.api_url
                    and (agent.node, agent.api_url) not in self._legacy):
                by_node.setdefault(agent, []).append(ep)
            else:
                direct.append(ep)
        # At most `_AT_ONCE` reads in flight: a fleet of thousands must not
        # open thousands of connections at once, every second.
        gate = asyncio.Semaphore(_AT_ONCE)
        found = _Round()
        await asyncio.gather(
            *(self._read_node(session, gate, agent, node_eps, found)
              for agent, node_eps in by_node.items()),
            *(self._read_engine(session, gate, ep, found) for ep in direct))
        kept = self._last
        loads = found.found | {rid: kept[rid] for rid in found.unanswered if rid in kept}
        self._last = loads
        self._table.set_loads(loads)
        return loads

    async def _read_node(self, session: aiohttp.ClientSession, gate: asyncio.Semaphore,
                         agent: NodeAgent, eps: Sequence[Endpoint], out: _Round) -> None:
        async with gate:
            answer = await self._ask_agent(session, agent)
        if isinstance(answer, str):  # "legacy"
            self._legacy[(agent.node, agent.api_url)] = self._clock() + LEGACY_RECHECK
            logger.info("node %s: its agent serves no loads (older than this gateway); "
                        "reading its engines' /metrics from here", agent.node)
            await asyncio.gather(*(self._read_engine(session, gate, ep, out) for ep in eps))
            return
        if answer is None:
            out.unanswered.update(ep.replica_id for ep in eps)
            return
        now = self._clock()
        for ep in eps:  # only this node's replicas: a node speaks for its own
            fig = answer.get(ep.replica_id)
            if fig is not None:
                out.found[ep.replica_id] = engine_load(fig[0], now - fig[1])

    async def _ask_agent(self, session: aiohttp.ClientSession, agent: NodeAgent,
                         ) -> dict[str, tuple[Counts, float]] | Literal["legacy"] | None:
        """The agent's figures; "legacy" when it has no loads route; None
        when it did not answer usably (logged once per streak)."""
        why = ""
        try:
            for i, token in enumerate(agent.tokens):
                async with session.get(agent.api_url + LOADS_PATH, timeout=self._timeout,
                                       headers={"Authorization": f"Bearer {token}"}) as resp:
                    status = resp.status
                    body = await read_capped(resp.content, MAX_ANSWER) if status == 200 else b""
                # During a rotation an agent may hold the previous secret's token.
                if status != 401 or i == len(agent.tokens) - 1:
                    break
            if status == 404:
                return "legacy"
            if status != 200:
                why = f"answered {status}"
            else:
                figures = read_loads_answer(body)
                if agent.node in self._failing:
                    self._failing.discard(agent.node)
                    logger.info("node %s: its agent serves loads again", agent.node)
                return figures
        except BadAnswer as exc:
            why = f"a bad answer ({exc})"
        except (aiohttp.ClientError, TimeoutError) as exc:
            why = f"no answer ({exc or type(exc).__name__})"
        if agent.node not in self._failing:
            self._failing.add(agent.node)
            logger.warning("node %s: engine loads not read from its agent at %s: %s; "
                           "its figures go unknown once stale", agent.node, agent.api_url, why)
        return None

    async def _read_engine(self, session: aiohttp.ClientSession, gate: asyncio.Semaphore,
                           ep: Endpoint, out: _Round) -> None:
        try:
            async with gate, session.get(
                    ep.url + "/metrics", timeout=self._timeout,
                    headers={"Authorization": f"Bearer {ep.key}"}) as resp:
                if resp.status != 200:
                    return  # no /metrics (llama.cpp): no load
                raw = await read_capped(resp.content, MAX_METRICS)
        except (aiohttp.ClientError, TimeoutError):
            out.unanswered.add(ep.replica_id)
            return
        counts = parse_vllm_metrics(raw.decode("utf-8", "replace")) if len(
            raw) <= MAX_METRICS else None
        if counts is not None:
            out.found[ep.replica_id] = engine_load(counts, self._clock())

    async def run(self) -> None:
        while True:
            started = self._clock()
            try:
                await self.poll()
            except Exception:
                logger.exception("engine load poll crashed")
            # On a steady cadence: a slow round does not stretch the figures' age.
            await asyncio.sleep(max(0.0, self._interval - (self._clock() - started)))
