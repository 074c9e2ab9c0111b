"""Choosing a replica: priorities, weights, engine load, prompt affinity.
Pure functions, plus the poller that reads engines' /metrics, in-process."""

from __future__ import annotations

import collections
import itertools
import random
from collections.abc import AsyncIterator, Callable

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from app.router.choice import (
    SATURATED_HOLD,
    Candidate,
    EngineLoad,
    affinity_key,
    choose,
    ring_order,
    ring_shares,
)
from app.router.engine_load import EngineLoadPoller
from app.router.published import Endpoint
from app.router.table import RouteTable
from app.router.upstream import UpstreamClient
from app.wire.loads import Counts, parse_vllm_metrics

NOW = 100.0


def idle(at: float = NOW) -> EngineLoad:
    return EngineLoad(0, 0, 0.1, at)


def seeded(seed: int = 7) -> random.Random:
    return random.Random(seed)


def picks(cands: list[Candidate], loads: dict[str, EngineLoad | None], n: int = 2000,
          inflight: dict[str, int] | None = None) -> collections.Counter[str]:
    rnd = seeded()
    out: collections.Counter[str] = collections.Counter()
    for _ in range(n):
        c = choose(cands, inflight or {}, loads, rand=rnd.random)
        assert c is not None
        out[c.replica_id] += 1
    return out


def test_a_lower_priority_is_used_only_when_every_higher_one_is_saturated() -> None:
    cands = [Candidate("big-1", priority=10), Candidate("big-2", priority=10),
             Candidate("spare", priority=1)]
    assert set(picks(cands, {"big-1": idle(), "big-2": idle(), "spare": idle()})) == {
        "big-1", "big-2"}
    full = EngineLoad(30, 12, 0.99, NOW)
    only_one = picks(cands, {"big-1": full, "big-2": idle(), "spare": idle()})
    assert set(only_one) == {"big-2"}  # its tier still has room
    spill = picks(cands, {"big-1": full, "big-2": full, "spare": idle()})
    assert set(spill) == {"spare"}
    everyone = choose(cands, {}, {"big-1": full, "big-2": full, "spare": full},
                      rand=seeded().random)
    assert everyone is not None and everyone.why == "fallback"


def test_weights_share_a_priority_in_proportion() -> None:
    cands = [Candidate("a", weight=3.0), Candidate("b", weight=1.0)]
    # Equal loads everywhere: only the draws decide, by weight.
    counts = picks(cands, {}, n=4000)
    assert 0.70 < counts["a"] / 4000 < 0.80, counts


def test_the_less_loaded_of_two_wins_and_unknown_load_is_not_idle() -> None:
    cands = [Candidate("busy"), Candidate("calm"), Candidate("quiet")]
    loads: dict[str, EngineLoad | None] = {
        "busy": EngineLoad(20, 5, 0.5, NOW), "calm": EngineLoad(1, 0, 0.1, NOW),
        "quiet": None}  # its metrics went stale
    counts = picks(cands, loads)
    # "busy" can win only against... nothing: it is the most loaded known;
    # "quiet" is charged like "busy", so "calm" wins every draw it is in.
    assert counts["busy"] == 0 or counts["busy"] < counts["calm"]
    assert counts["calm"] > counts["quiet"] and counts["calm"] > 1000, counts
    # Without any known load, in-flight requests on this gateway decide.
    counts = picks(cands, {}, inflight={"busy": 9, "calm": 0, "quiet": 9})
    assert counts["calm"] > 1000


def test_a_conversation_sticks_to_one_replica_until_it_is_saturated() -> None:
    cands = [Candidate(f"r{i}") for i in range(4)]
    loads = {c.replica_id: idle() for c in cands}
    first = [{"role": "system", "content": "You are terse."},
             {"role": "user", "content": "Plan a trip to Lisbon."}]
    later = [*first, {"role": "assistant", "content": "Sure."},
             {"role": "user", "content": "And Porto?"}]
    key = affinity_key({"messages": first}, None)
    assert key is not None and key == affinity_key({"messages": later}, None)
    home = ring_order([c.replica_id for c in cands], key)[0]
    for _ in range(20):
        c = choose(cands, {}, loads, affinity=key, rand=seeded().random)
        assert c is not None and (c.replica_id, c.why) == (home, "affinity")
    # Its replica saturated (8 waiting): the next on the ring takes it.
    heavy = {**loads, home: EngineLoad(40, 8, 0.5, NOW)}
    c = choose(cands, {}, heavy, affinity=key, rand=seeded().random)
    assert c is not None and c.replica_id != home and c.why == "affinity-next"
    assert c.replica_id == ring_order([x.replica_id for x in cands], key)[1]
    # Another conversation (or session id) lands elsewhere, roughly evenly.
    homes = collections.Counter(
        ring_order([x.replica_id for x in cands], affinity_key({}, f"s{i}") or "")[0]
        for i in range(400))
    assert len(homes) == 4 and min(homes.values()) > 50, homes
    shares = ring_shares([x.replica_id for x in cands])
    assert abs(sum(shares.values()) - 1.0) < 1e-9 and min(shares.values()) > 0.1


def test_a_table_uses_fresh_engine_loads_only() -> None:
    clock = itertools.count(NOW).__next__
    table = RouteTable(clock=lambda: float(clock()))
    a, b = Endpoint("a", "http://a", "ka"), Endpoint("b", "http://b", "kb")
    table.set_endpoints({"m": [a, b]})
    table.rand = seeded().random
    table.set_loads({"a": EngineLoad(0, 0, 0.1, NOW), "b": EngineLoad(50, 20, 0.9, NOW)})
    assert {table.choose("m", set()) for _ in range(3)} == {a}  # fresh: b is busy
    table.stale_after = 0.5  # the clock moves a second per read: both stale now
    assert {table.choose("m", set()) for _ in range(40)} == {a, b}
    rows = {r["replica"]: r for r in table.explain("m")}
    assert rows["a"]["why"] == "candidate" and rows["a"]["engine"] is None



def test_a_full_engine_whose_scrape_comes_late_stays_full_for_a_while() -> None:
    """A scrape times out exactly when its engine is busiest (seen in CI:
    two CPU engines on two cores). Had the late figure's replica become
    unknown, hence not saturated, a conversation would have gone back into
    its queue, behind a full batch (a 504). A saturated figure stays in
    force for SATURATED_HOLD staleness bounds; a figure with room does not."""
    now = [NOW]
    table = RouteTable(clock=lambda: now[0])
    a, b = Endpoint("a", "http://a", "ka"), Endpoint("b", "http://b", "kb")
    table.set_endpoints({"m": [a, b]})
    table.rand = seeded().random
    key = next(k for k in (f"s:{i}" for i in range(100)) if ring_order(["a", "b"], k)[0] == "a")
    table.set_loads({"a": EngineLoad(4, 10, 0.5, NOW), "b": EngineLoad(0, 0, 0.1, NOW)})
    assert table.choose("m", set(), affinity=key) == b  # fresh and full: moved
    now[0] = NOW + table.stale_after + 0.1  # both figures stale: a's still full
    assert {table.choose("m", set(), affinity=key) for _ in range(10)} == {b}
    assert {r["replica"]: r["why"] for r in table.explain("m")}["a"] == "saturated"
    now[0] = NOW + SATURATED_HOLD * table.stale_after + 0.1  # long unheard of: unknown
    assert table.choose("m", set(), affinity=key) == a
    # A figure with room is not held: stale, it is unknown (charged the worst).
    table.set_loads({"a": EngineLoad(4, 7, 0.5, NOW), "b": EngineLoad(0, 0, 0.1, NOW)})
    now[0] = NOW + table.stale_after + 0.1
    assert {r["replica"]: r["engine"] for r in table.explain("m")} == {"a": None, "b": None}

METRICS = """# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_running{engine="1",model_name="m"} 2.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 4.0
vllm:num_requests_waiting{engine="1",model_name="m"} 0.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.5
vllm:prompt_tokens_total{model_name="m"} 1234.0
"""


def test_vllm_metrics_are_summed_over_engines() -> None:
    assert parse_vllm_metrics(METRICS) == Counts(5.0, 4.0, 0.5)
    old = METRICS.replace("kv_cache_usage_perc", "gpu_cache_usage_perc")
    assert parse_vllm_metrics(old) == Counts(5.0, 4.0, 0.5)
    assert parse_vllm_metrics("# nothing\nprocess_cpu_seconds_total 3\n") is None


@pytest.fixture
async def engines() -> AsyncIterator[tuple[TestServer, TestServer]]:
    async def metrics(request: web.Request) -> web.Response:
        return web.Response(text=METRICS, content_type="text/plain")

    async def missing(request: web.Request) -> web.Response:
        return web.Response(status=404)

    vllm, llama = web.Application(), web.Application()
    vllm.router.add_get("/metrics", metrics)
    llama.router.add_get("/metrics", missing)
    servers = TestServer(vllm, host="127.0.0.1"), TestServer(llama, host="127.0.0.1")
    for s in servers:
        await s.start_server()
    try:
        yield servers
    finally:
        for s in servers:
            await s.close()


async def test_the_poller_reads_each_engines_load_into_the_table(
    engines: tuple[TestServer, TestServer],
) -> None:
    vllm, llama = engines
    table = RouteTable()
    table.set_endpoints({"m": [Endpoint("v", str(vllm.make_url("")).rstrip("/"), "k1"),
                               Endpoint("l", str(llama.make_url("")).rstrip("/"), "k2"),
                               Endpoint("gone", "http://127.0.0.1:9", "k3")]})
    client = UpstreamClient(0.25)
    try:
        loads = await EngineLoadPoller(table, lambda: client, clock=lambda: 42.0).poll()
    finally:
        await client.close()
    # The one with vLLM's gauges has a load; no /metrics or no answer: unknown.
    assert loads == {"v": EngineLoad(5.0, 4.0, 0.5, 42.0)}


# --- sticky until saturated (docs/design/routing.md, "Choosing a replica") ------

FOUR = [Candidate(f"r{i}") for i in range(4)]
# One fleet's engine figures, as every gateway scrapes them: none saturated.
FIGURES: dict[str, EngineLoad | None] = {
    "r0": EngineLoad(3, 0, 0.30, NOW), "r1": EngineLoad(1, 0, 0.10, NOW),
    "r2": EngineLoad(0, 0, 0.05, NOW), "r3": None}  # r3's last scrape went stale
# Three gateways' own in-flight counts and draws: what differs between them.
VIEWS = [({"r0": 6, "r1": 1}, seeded(1).random), ({}, seeded(2).random),
         ({"r2": 9, "r3": 4}, seeded(3).random)]


def homes_from(views: list[tuple[dict[str, int], Callable[[], float]]],
               loads: dict[str, EngineLoad | None], key: str,
               cands: list[Candidate] = FOUR) -> set[tuple[str, str]]:
    out = set()
    for inflight, rand in views:
        c = choose(cands, inflight, loads, affinity=key, rand=rand)
        assert c is not None
        out.add((c.replica_id, c.why))
    return out


def test_every_gateway_sends_a_conversation_to_the_same_replica() -> None:
    # Same engine figures, different in-flight counts and draws: one answer.
    for i in range(200):
        picked = homes_from(VIEWS, FIGURES, f"s:conversation-{i}")
        assert len(picked) == 1, (i, picked)


def test_a_conversation_stays_on_a_busy_replica_until_it_is_saturated() -> None:
    key = next(f"s:c{i}" for i in itertools.count()
               if ring_order([c.replica_id for c in FOUR], f"s:c{i}")[0] == "r0")
    # r0 runs 40 requests and queues 3 while the rest idle: far past any mean
    # load, but a request it admits finds the conversation's prefix cached.
    busy = {**FIGURES, "r0": EngineLoad(40, 3, 0.90, NOW)}
    assert homes_from(VIEWS, busy, key) == {("r0", "affinity")}
    # At 8 waiting (or its KV cache 98% full) it is saturated: every gateway
    # takes the next replica on the ring that is not, the same one.
    order = ring_order([c.replica_id for c in FOUR], key)
    for full in (EngineLoad(40, 8, 0.90, NOW), EngineLoad(10, 0, 0.98, NOW)):
        assert homes_from(VIEWS, {**FIGURES, "r0": full}, key) == {(order[1], "affinity-next")}
    # And past that one too when it is saturated as well.
    both = {**FIGURES, "r0": EngineLoad(40, 8, 0.9, NOW), order[1]: EngineLoad(9, 9, 0.5, NOW)}
    assert homes_from(VIEWS, both, key) == {(order[2], "affinity-next")}
    # Every replica saturated: moving gains nothing, the conversation stays.
    full_all = dict.fromkeys(FIGURES, EngineLoad(40, 9, 0.99, NOW))
    assert homes_from(VIEWS, full_all, key) == {("r0", "fallback")}


def test_a_llamacpp_replica_is_saturated_by_the_requests_in_flight_on_it() -> None:
    # llama-cpp-python serves one request at a time and has no /metrics: its
    # queue is the requests every gateway has in flight on it.
    cands = [Candidate(f"l{i}", serial=True) for i in range(3)]
    key = "s:cpu-chat"
    order = ring_order([c.replica_id for c in cands], key)
    views = [({order[0]: 1}, seeded(1).random), ({}, seeded(2).random)]
    two = {order[0]: 2}  # one running, one waiting, over every gateway
    for inflight, rand in views:
        c = choose(cands, inflight, {}, affinity=key, queued=two, rand=rand)
        assert c is not None and (c.replica_id, c.why) == (order[0], "affinity")
    for inflight, rand in views:
        c = choose(cands, inflight, {}, affinity=key, queued={order[0]: 3}, rand=rand)
        assert c is not None and (c.replica_id, c.why) == (order[1], "affinity-next")
