"""Engines' own load, read off the request path (docs/design/routing.md, "Choosing a replica").

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
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Literal, Protocol

from app.router.choice import EngineLoad
from app.router.published import Endpoint
from app.router.request_line import UpstreamError
from app.router.table import RouteTable
from app.router.upstream import UpstreamClient
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
# The most nodes (or engines of older agents) a gateway process asks a
# second: at ~130-150 us of CPU an ask (bench/load_poll.py; ~220-360 through
# aiohttp), about 0.3 of a core at this bound.
RATE = 2000.0
# A round's asks go out in slices this long apart, not in one burst.
SLICE = 0.1
# Figures older than this many rounds are unknown (choice.fresh).
STALE_ROUNDS = 3.0
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


class LoadShare(Protocol):
    """Under `llmgw serve --workers N` the poll is split among a gateway's
    workers (app/gateway/worker_loads.py): each asks the nodes that are
    `mine()`, publishes its figures once a round and reads the others' as
    they come (each slice)."""

    def mine(self, node: str) -> bool: ...

    async def publish(self, own: Mapping[str, EngineLoad]) -> None: ...

    async def others(self) -> Mapping[str, EngineLoad] | None:
        """The other workers' figures; None when none changed since the last call."""


def engine_load(counts: Counts, at: float) -> EngineLoad:
    return EngineLoad(counts.running, counts.waiting, counts.kv, at)


class _Round:
    """What one poll found: figures, and the replicas whose source did not answer."""

    def __init__(self) -> None:
        self.found: dict[str, EngineLoad] = {}
        self.unanswered: set[str] = set()


class EngineLoadPoller:
    """Reads each routable engine's load into the route table. `poll()` is
    one round (tests drive it); `run()` repeats it, a round every `interval`
    while the fleet is small.

    The reads go through the router's own HTTP client (upstream.py), not
    aiohttp's: measured with bench/load_poll.py, an ask cost about 300 us of
    CPU through aiohttp, so 2,000 nodes took 65% of a core and a round
    longer than the interval. `client` gives the client to use (None: not
    started); its connect timeout is the poll's own.

    A gateway asks at most `rate` nodes (or engines of older agents) a
    second: a larger fleet is asked less often, never faster than that
    (10,000 nodes at the default: every 5 s), so the poll's share of the
    event loop is bounded whatever the fleet. A round's asks are spread
    over it in slices (`run()`), not sent at once; each slice's figures are
    routed on as they come. Figures stay fresh for `STALE_ROUNDS` rounds
    (the table's `stale_after`), so a slow round never makes them unknown.
    docs/design/routing.md, "Choosing a replica"."""

    def __init__(
        self,
        table: RouteTable,
        client: Callable[[], UpstreamClient | None],
        *,
        directory: NodeDirectory | None = None,
        interval: float = 1.0,
        rate: float = RATE,
        timeout: float = 0.5,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._table = table
        self._client = client
        self.directory = directory
        self._interval = interval
        self._rate = rate
        self._timeout = timeout
        self._clock = clock
        self._legacy: dict[tuple[str, str], float] = {}  # (node, api_url) -> recheck at
        self._failing: set[str] = set()  # nodes whose last ask failed (logged once)
        self._last: dict[str, EngineLoad] = {}
        # The last round's length: `interval`, or longer for a large fleet.
        self.period = interval
        # Set by the wiring under --workers: this worker's part of the fleet,
        # and the other workers' figures as last read.
        self.share: LoadShare | None = None
        self._theirs: Mapping[str, EngineLoad] = {}

    async def poll(self, sleep: Callable[[float], Awaitable[None]] | None = None,
                   ) -> dict[str, EngineLoad]:
        """One round. With `sleep`, its asks are spread over the round in
        slices of about `SLICE` s; without, sent at once (tests)."""
        client = self._client()
        if client is None:
            return {}
        eps = [ep for ep in self._table.all_endpoints() if not ep.replica_id.startswith(
            "external:")]  # a provider's load is not ours to read
        agents = self.directory.agents() if self.directory is not None else {}
        start = self._clock()
        self._legacy = {k: t for k, t in self._legacy.items() if t > start}
        by_node: dict[NodeAgent, list[Endpoint]] = {}
        direct: list[Endpoint] = []
        share = self.share
        for ep in eps:
            agent = agents.get(ep.replica_id)
            if (agent is not None and agent.api_url
                    and (agent.node, agent.api_url) not in self._legacy):
                if share is None or share.mine(agent.node):
                    by_node.setdefault(agent, []).append(ep)
            elif share is None or share.mine(agent.node if agent else ep.replica_id):
                direct.append(ep)
        # A node gone from the fleet is forgotten (nodes come and go for months).
        self._failing.intersection_update(a.node for a in by_node)
        jobs: list[Callable[[UpstreamClient, asyncio.Semaphore, _Round], Awaitable[None]]] = [
            *(partial(self._read_node, agent=a, eps=node_eps) for a, node_eps in by_node.items()),
            *(partial(self._read_engine, ep=ep) for ep in direct)]
        self.period = max(self._interval, len(jobs) / self._rate)
        self._table.stale_after = STALE_ROUNDS * self.period
        slices = max(1, min(len(jobs), round(self.period / SLICE))) if sleep else 1
        # At most `_AT_ONCE` reads in flight: a fleet of thousands must not
        # open thousands of connections at once.
        gate = asyncio.Semaphore(_AT_ONCE)
        found = _Round()
        for i in range(slices):
            part = _Round()
            await asyncio.gather(*(job(client, gate, part)
                                   for job in jobs[i * len(jobs) // slices:
                                                   (i + 1) * len(jobs) // slices]))
            self._table.add_loads(part.found)
            if share is not None and (theirs := await share.others()) is not None:
                self._theirs = theirs
                self._table.add_loads(theirs)
            found.found.update(part.found)
            found.unanswered.update(part.unanswered)
            if sleep is not None and i + 1 < slices:
                await sleep(max(0.0, start + (i + 1) * self.period / slices - self._clock()))
        kept = self._last
        loads = found.found | {rid: kept[rid] for rid in found.unanswered if rid in kept}
        self._last = loads
        if share is not None:  # the other workers' parts, as they last wrote them
            await share.publish(loads)
            self._table.set_loads({**self._theirs, **loads})
        else:
            self._table.set_loads(loads)
        return loads

    async def _read_node(self, client: UpstreamClient, gate: asyncio.Semaphore, out: _Round,
                         *, agent: NodeAgent, eps: Sequence[Endpoint]) -> None:
        async with gate:
            answer = await self._ask_agent(client, agent)
        if isinstance(answer, str):  # "legacy"
            self._legacy[(agent.node, agent.api_url)] = self._clock() + LEGACY_RECHECK
            logger.info("node %s: its agent serves no loads (older than this gateway); "
                        "reading its engines' /metrics from here", agent.node)
            await asyncio.gather(*(self._read_engine(client, gate, out, ep=ep) for ep in eps))
            return
        if answer is None:
            out.unanswered.update(ep.replica_id for ep in eps)
            return
        now = self._clock()
        for ep in eps:  # only this node's replicas: a node speaks for its own
            fig = answer.get(ep.replica_id)
            if fig is not None:
                out.found[ep.replica_id] = engine_load(fig[0], now - fig[1])

    async def _ask_agent(self, client: UpstreamClient, agent: NodeAgent,
                         ) -> dict[str, tuple[Counts, float]] | Literal["legacy"] | None:
        """The agent's figures; "legacy" when it has no loads route; None
        when it did not answer usably (logged once per streak)."""
        why = ""
        try:
            for i, token in enumerate(agent.tokens):
                status, body = await self._get(client, agent.api_url, LOADS_PATH, token,
                                               MAX_ANSWER)
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
        except (UpstreamError, TimeoutError) as unheard:
            # Not `exc` again: mypyc gives a name one type per function.
            why = f"no answer ({unheard or type(unheard).__name__})"
        if agent.node not in self._failing:
            self._failing.add(agent.node)
            logger.warning("node %s: engine loads not read from its agent at %s: %s; "
                           "its figures go unknown once stale", agent.node, agent.api_url, why)
        return None

    async def _read_engine(self, client: UpstreamClient, gate: asyncio.Semaphore, out: _Round,
                           *, ep: Endpoint) -> None:
        try:
            async with gate:
                status, raw = await self._get(client, ep.url, "/metrics", ep.key,
                                              MAX_METRICS)
        except (UpstreamError, TimeoutError):
            out.unanswered.add(ep.replica_id)
            return
        if status != 200:
            return  # no /metrics (llama.cpp): no load
        counts = parse_vllm_metrics(raw.decode("utf-8", "replace")) if len(
            raw) <= MAX_METRICS else None
        if counts is not None:
            out.found[ep.replica_id] = engine_load(counts, self._clock())

    async def _get(self, client: UpstreamClient, base_url: str, path: str, token: str,
                   cap: int) -> tuple[int, bytes]:
        """A GET's status and body (up to `cap` + 1 bytes, read only when 200),
        within the poll's timeout."""
        async with asyncio.timeout(self._timeout):
            resp = await client.post(base_url, path, b"", [
                (b"authorization", b"Bearer " + token.encode())], method=b"GET")
            try:
                body = await read_capped(resp, cap) if resp.status == 200 else b""
            finally:
                resp.close()
        return resp.status, body

    async def run(self) -> None:
        while True:
            started = self._clock()
            try:
                await self.poll(asyncio.sleep)
            except Exception:
                logger.exception("engine load poll crashed")
            # On a steady cadence: a slow round does not stretch the figures' age.
            await asyncio.sleep(max(0.0, self.period - (self._clock() - started)))
