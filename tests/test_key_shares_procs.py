"""A key's limits are the key's, not a share of them: three gateway
processes on one etcd, each of one process or of two workers (`--workers
2`), the vLLM stand-in (in-process, as an external model's provider) and the
official `openai` client (docs/design/client-keys.md and docs/design/workers.md). A
client all on one gateway is never refused below its key's limits and gets
them whole; round robin over three admits at most L + N - 1, N the gateways
(not their workers); a client that moves, or whose gateway is SIGKILLed,
gets its limit on the next gateway within the stated time. The claims'
logic is tested in-process in tests/test_key_shares.py."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.fakes.fake_vllm import FakeVLLM
from tests.support.procs import ADMIN, Cluster, GatewayProc
from tests.test_keys import stand_in

MESSAGES: Any = [{"role": "user", "content": "hi"}]
TTL = 4  # the gateways' lease: a dead gateway's claims go this long after it


@dataclass
class Rig:
    gws: list[GatewayProc]
    fake: FakeVLLM
    # "rpm": 12 a minute; "conc": 4 at once; "one": 1 at once; "sticky{i}":
    # 4 at once and 30 a minute.
    keys: dict[str, str] = field(default_factory=dict)
    live: int = 0  # streams admitted and not yet ended, over all gateways
    peak: int = 0
    tasks: list[asyncio.Task[None]] = field(default_factory=list)
    refusals: list[tuple[float, str]] = field(default_factory=list)

    clients: dict[tuple[int, str, bool], openai.AsyncOpenAI] = field(default_factory=dict)

    def client(self, gw: int, key: str, keep_alive: bool = True) -> openai.AsyncOpenAI:
        """Pooled connections, as a client's are; or a new connection for
        each request (any worker of the gateway)."""
        if (gw, key, keep_alive) not in self.clients:
            self.clients[gw, key, keep_alive] = openai.AsyncOpenAI(
                api_key=self.keys[key], base_url=self.gws[gw].url + "/v1", max_retries=0,
                timeout=60, http_client=httpx.AsyncClient(limits=httpx.Limits(
                    max_connections=100,
                    max_keepalive_connections=None if keep_alive else 0)))
        return self.clients[gw, key, keep_alive]

    async def once(self, gw: int, key: str = "rpm") -> bool:
        """One plain request; False when refused for the key's limits."""
        try:
            await self.client(gw, key).chat.completions.create(model="m", messages=MESSAGES)
        except openai.RateLimitError as exc:
            self.refusals.append((time.monotonic(), str(exc)))
            return False
        return True

    async def hold(self, gw: int, key: str = "conc", keep_alive: bool = True) -> bool:
        """Opens a stream (held open by the stand-in's token delay) and reads
        it to its end in the background; False when refused."""
        try:
            stream = await self.client(gw, key, keep_alive).chat.completions.create(
                model="m", messages=MESSAGES, stream=True)
        except openai.RateLimitError as exc:
            self.refusals.append((time.monotonic(), str(exc)))
            return False
        self.live += 1
        self.peak = max(self.peak, self.live)

        async def drain() -> None:
            try:
                async for _ in stream:
                    pass
            except (openai.APIError, httpx.HTTPError):
                pass  # its gateway was killed
            finally:
                self.live -= 1

        self.tasks.append(asyncio.create_task(drain()))
        return True

    async def hold_until(self, gw: int, want: int, within: float) -> tuple[int, float]:
        """`want` clients each open a stream on `gw` (answered once its first
        word comes), retrying a refusal every 50 ms, for up to `within`
        seconds: (how many got one, seconds until the last did)."""
        start = time.monotonic()

        async def one() -> float | None:
            while time.monotonic() - start < within:
                if await self.hold(gw):
                    return time.monotonic() - start
                await asyncio.sleep(0.05)
            return None

        times = [x for x in await asyncio.gather(*(one() for _ in range(want))) if x is not None]
        return len(times), max(times, default=0.0)


@contextlib.asynccontextmanager
async def three(cluster: Cluster, tmp: Path, workers: int = 1,
                sticky: int = 0) -> AsyncIterator[Rig]:
    """Three gateways serving "m" (an external model at the stand-in) and
    client keys, 12 requests a minute, 4 at once, 1 at once and `sticky`
    more of 4 at once and 30 a minute, seen by all three (by each of their
    `workers`: docs/design/workers.md)."""
    cluster.ttl = TTL
    async with stand_in(tmp) as (fake, spec):
        gws = [cluster.gateway(f"gw{i}", provider_key_dir=str(tmp / "keys"), etcd_timeout="2",
                               workers=str(workers), ready_within=20 * workers)
               for i in range(3)]
        rig = Rig(gws, fake)
        admin = {"Authorization": f"Bearer {ADMIN}"}
        async with httpx.AsyncClient(headers=admin, timeout=10) as http:
            r = await http.put(gws[0].url + "/admin/models/m", json=spec)
            assert r.status_code == 201, r.text
            r = await http.post(gws[0].url + "/admin/keys", json={"name": "free"})
            free = r.json()["key"]
            ids = []
            for name, limits in (("rpm", {"requests_per_minute": 12}),
                                 ("conc", {"concurrent_requests": 4}),
                                 ("one", {"concurrent_requests": 1}),
                                 *((f"sticky{i}", {"concurrent_requests": 4,
                                                   "requests_per_minute": 30})
                                   for i in range(sticky))):
                r = await http.post(gws[0].url + "/admin/keys",
                                    json={"name": name, "limits": limits})
                assert r.status_code == 201, r.text
                rig.keys[name] = r.json()["key"]
                ids.append(r.json()["id"])

            async def serves(g: GatewayProc, c: httpx.AsyncClient) -> bool:
                r = await c.post(g.url + "/v1/chat/completions",
                                 headers={"Authorization": f"Bearer {free}"},
                                 json={"model": "m", "messages": MESSAGES})
                seen = [(await c.get(g.url + f"/admin/keys/{i}")).status_code for i in ids]
                return r.status_code == 200 and seen == [200] * len(ids)

            deadline = time.monotonic() + 30 * workers
            for g in gws:
                # Each time a new connection: any of its workers.
                for _ in range(1 if workers == 1 else 8 * workers):
                    async with httpx.AsyncClient(headers=admin, timeout=10) as fresh:
                        while not await serves(g, fresh):
                            assert time.monotonic() < deadline, f"{g.name} does not serve m"
                            await asyncio.sleep(0.1)
        try:
            yield rig
        finally:
            rig.fake.token_delay = 0.0
            for t in rig.tasks:
                t.cancel()
            await asyncio.gather(*rig.tasks, return_exceptions=True)
            for c in rig.clients.values():
                await c.close()


@pytest.mark.parametrize("workers", [1, 2])
async def test_a_sticky_client_is_never_refused_below_its_keys_limits(
    cluster: Cluster, tmp_path: Path, workers: int
) -> None:
    """The issue's client, all on gw0 (a sticky balancer, pooled
    connections: with two workers its burst's connections reach both): on
    each of 8 new keys of 4 at once and 30 a minute, 3 requests one after
    another, then 4 streams at once. Each round fits the key's limits, so
    no request may be refused: one refused on gw0's claim below the key's
    limit waits for the claim's raise (docs/design/client-keys.md).
    Seen to fail without the wait (one process and two workers alike): the
    key's second request refused, at 1 of 30 a minute, and 3 of the 7 in
    the first round admitted in all."""
    rounds = 8
    async with three(cluster, tmp_path, workers, sticky=rounds) as rig:
        for i in range(rounds):
            key = f"sticky{i}"
            rig.fake.token_delay = 0.0
            ok = [await rig.once(0, key) for _ in range(3)]
            rig.fake.token_delay = 0.3  # each stream ~1.2 s: the four are open together
            ok += await asyncio.gather(*(rig.hold(0, key) for _ in range(4)))
            assert rig.peak <= 4
            assert ok == [True] * 7, (i, ok, rig.refusals)
            rig.fake.token_delay = 0.0
            await asyncio.gather(*rig.tasks)
        assert rig.refusals == []


@pytest.mark.parametrize("workers", [1, 2])
async def test_a_client_all_on_one_gateway_gets_its_whole_limits_within_3_s(
    cluster: Cluster, tmp_path: Path, workers: int
) -> None:
    async with three(cluster, tmp_path, workers) as rig:
        # Concurrency: four streams held open, all on gw0 (a sticky balancer).
        rig.fake.token_delay = 2.0  # each stream lasts ~8 s: longer than the test's 3 s
        got, _ = await rig.hold_until(0, 4, within=3.0)
        assert got == 4, (f"{got} of 4 concurrent requests in 3 s (ceil(4/3) = 2 was the "
                          f"old part)", rig.refusals)
        rig.fake.token_delay = 0.0
        # Requests per minute: asked every 50 ms on gw0 for 3 s.
        start, ok = time.monotonic(), 0
        while time.monotonic() - start < 3.0:
            ok += await rig.once(0)
            await asyncio.sleep(0.05)
        assert ok >= 0.9 * 12, f"{ok} of 12 requests per minute in 3 s (4 was the old part)"
        assert ok <= 12 + 3 - 1


@pytest.mark.parametrize("workers", [1, 2])
async def test_round_robin_over_three_admits_at_most_the_limit_plus_n_minus_1(
    cluster: Cluster, tmp_path: Path, workers: int
) -> None:
    n = 3  # the gateways, whatever their workers (docs/design/workers.md)
    async with three(cluster, tmp_path, workers) as rig:
        ok = 0
        for i in range(45):  # 3 s of a balancer's round robin, at 15 requests a second
            ok += await rig.once(i % 3)
            await asyncio.sleep(1 / 15)
        assert 12 <= ok <= 12 + n - 1
        rig.fake.token_delay = 2.0  # streams outlive the loop below
        tries = []
        for i in range(60):  # 3 s of streams asked for round robin, none ending
            tries.append(asyncio.create_task(rig.hold(i % 3)))
            await asyncio.sleep(0.05)
        assert 4 <= sum(await asyncio.gather(*tries)) == rig.peak <= 4 + n - 1


async def test_the_workers_of_three_gateways_admit_at_most_l_plus_n_minus_1(
    cluster: Cluster, tmp_path: Path
) -> None:
    """The issue's count: a key of 1 at once, streams asked round robin over
    three gateways of two workers each, each on a new connection (either
    worker). At most L + N - 1 = 3 at once, N the gateways. Seen to fail
    with a floor on every worker: 6 at once (the issue saw 4)."""
    async with three(cluster, tmp_path, workers=2) as rig:
        rig.fake.token_delay = 2.0  # streams outlive the loop below
        tries = []
        for i in range(60):  # 3 s of streams, none ending
            tries.append(asyncio.create_task(rig.hold(i % 3, "one", keep_alive=False)))
            await asyncio.sleep(0.05)
        admitted = sum(await asyncio.gather(*tries))
        assert 1 <= admitted == rig.peak <= 1 + 3 - 1, (admitted, rig.peak)


@pytest.mark.parametrize("workers", [1, 2])
async def test_a_client_that_moves_gets_its_limit_on_the_new_gateway(
    cluster: Cluster, tmp_path: Path, workers: int
) -> None:
    async with three(cluster, tmp_path, workers) as rig:
        rig.fake.token_delay = 0.5  # each stream ~2 s
        got, _ = await rig.hold_until(0, 4, within=3.0)
        assert got == 4
        # The balancer moves the client to gw1 mid-stream: gw1 gets the whole
        # limit once gw0's streams end (~2 s): gw0 lowers its claim to what
        # it holds for the requests waiting on gw1 (documented: within 8 s
        # of the move).
        got, took = await rig.hold_until(1, 4, within=10.0)
        assert got == 4 and took <= 8.0, (got, took)
        assert rig.peak <= 4 + 3 - 1


@pytest.mark.parametrize("workers", [1, 2])
async def test_a_killed_gateways_part_returns_to_the_others_after_its_lease(
    cluster: Cluster, tmp_path: Path, workers: int
) -> None:
    async with three(cluster, tmp_path, workers) as rig:
        rig.fake.token_delay = 5.0  # ~20 s streams
        got, _ = await rig.hold_until(0, 4, within=3.0)
        assert got == 4
        rig.gws[0].signal(signal.SIGKILL)  # with its workers (PR_SET_PDEATHSIG)
        killed = time.monotonic()
        rig.fake.token_delay = 1.0  # the next streams answer sooner, still held ~4 s
        # Its streams die with it; its record goes with its lease (TTL) and
        # its part is held a TTL more (a gateway cut off from etcd, not dead,
        # has that long to write it again): then the client, now on gw1, gets
        # the whole limit: within 2 x TTL + 3 s (plus the stand-in's first
        # word, 1 s).
        got, _ = await rig.hold_until(1, 4, within=2 * TTL + 6.0)
        took = time.monotonic() - killed
        assert got == 4 and took <= 2 * TTL + 3.0 + 1.0, (got, took)
