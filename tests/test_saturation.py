"""Saturation: an engine whose queue does not drain, or whose KV cache is
full, brings more replicas whatever the load target
(docs/design/control-plane.md, "Saturation"). The rule in-process on an
injected clock, the
snapshot that carries it, and across real processes the second replica of
an engine that runs one request at a time."""

from __future__ import annotations

import threading
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from app.control import state as s
from app.control.keys import SecretRing
from app.control.mirror import Mirror
from app.control.plan.scaling import Scaler, wanted_now
from app.control.usage import Queue, UsagePublisher, replica_loads, replica_queues
from app.gateway.publish import Publisher
from app.gateway.router_usage import LastUse, RouterUsage
from app.router.choice import EngineLoad
from app.router.table import RouteTable
from app.store.embedded import EmbeddedStore
from tests.support.procs import Cluster, make_key, put_model, replicas, wait_for, wait_ready


class Clock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def spec(hi: int = 8, target: int | None = None, engine: s.Engine = "vllm") -> s.StoredModel:
    return s.StoredModel(name="m", model="org/m", replicas=s.ReplicaRange(min=1, max=hi),
                         load_target=target, profiles=[s.Profile(engine=engine)])


def reps(*ids: str, engine: s.Engine = "vllm") -> dict[str, s.Replica]:
    return {rid: s.Replica(id=rid, model="m", node="n1", weights="org/m", engine=engine)
            for rid in ids}


FLOOR = {"m": 1}


def scaler(window: float = 300.0) -> Scaler:
    return Scaler(window=window, default_target=16, saturated_after=5.0)


# --- the rule, one step at a time on the leader's clock --------------------------------


def test_a_queue_that_does_not_drain_for_the_delay_raises_replicas_sized_from_it() -> None:
    sc, models, running = scaler(), {"m": spec()}, reps("a")
    # One request running, five waiting: 6 is far below the target of 16.
    load, queue = {"a": 6.0}, {"a": Queue(waiting=5, kv=0.1)}
    assert sc.step(models, running, load, FLOOR, 100.0, queue) == {"m": 1}
    assert sc.step(models, running, load, FLOOR, 104.9, queue) == {"m": 1}
    # Five seconds of a queue: enough replicas for all six requests at the
    # one each engine was seen running, in one step (not one at a time).
    assert sc.step(models, running, load, FLOOR, 105.0, queue) == {"m": 6}
    # Within replicas.max.
    sc = scaler()
    assert sc.step({"m": spec(hi=3)}, running, load, FLOOR, 0.0, queue) == {"m": 1}
    assert sc.step({"m": spec(hi=3)}, running, load, FLOOR, 5.0, queue) == {"m": 3}


def test_a_queue_that_drains_in_between_starts_the_delay_again() -> None:
    sc, models, running = scaler(), {"m": spec()}, reps("a")
    load = {"a": 6.0}
    assert sc.step(models, running, load, FLOOR, 0.0, {"a": Queue(5, 0.1)}) == {"m": 1}
    assert sc.step(models, running, {"a": 1.0}, FLOOR, 3.0, {"a": Queue(0, 0.1)}) == {"m": 1}
    assert sc.step(models, running, load, FLOOR, 4.0, {"a": Queue(5, 0.1)}) == {"m": 1}
    assert sc.step(models, running, load, FLOOR, 8.9, {"a": Queue(5, 0.1)}) == {"m": 1}
    # A poll missed (the queue unknown) neither ends it nor rises on it.
    assert sc.step(models, running, {}, FLOOR, 9.0, {}) == {"m": 1}
    assert sc.step(models, running, load, FLOOR, 9.0, {"a": Queue(5, 0.1)}) == {"m": 6}


def test_the_step_is_sized_at_the_rate_the_engines_run_not_one_per_request() -> None:
    # A vLLM engine running 256 at once with 10 waiting, below a target of
    # 300: one more replica takes the queue, not one for each request.
    sc, models, running = scaler(), {"m": spec(target=300)}, reps("a")
    load, queue = {"a": 266.0}, {"a": Queue(10, 0.5)}
    assert sc.step(models, running, load, FLOOR, 0.0, queue) == {"m": 1}
    assert sc.step(models, running, load, FLOOR, 5.0, queue) == {"m": 2}
    # Two engines running 4 each with 12 waiting between them: 20 requests
    # at 4 a replica is 5 replicas, three more in one step.
    sc, two = scaler(), reps("a", "b")
    load, queue = {"a": 10.0, "b": 10.0}, {"a": Queue(6, 0.3), "b": Queue(6, 0.3)}
    sc.step(models, two, load, FLOOR, 0.0, queue)
    assert sc.step(models, two, load, FLOOR, 5.0, queue) == {"m": 5}


def test_a_kv_cache_at_its_limit_raises_replicas() -> None:
    sc, models, running = scaler(), {"m": spec()}, reps("a")
    # Nothing waits, but the cache is full: the engine admits no more.
    load, queue = {"a": 3.0}, {"a": Queue(0, 0.98)}
    assert sc.step(models, running, load, FLOOR, 0.0, queue) == {"m": 1}
    assert sc.step(models, running, load, FLOOR, 5.0, queue) == {"m": 2}
    # Just below the limit is not saturation.
    sc = scaler()
    below = {"a": Queue(0, 0.97)}
    sc.step(models, running, load, FLOOR, 0.0, below)
    assert sc.step(models, running, load, FLOOR, 9.0, below) == {"m": 1}


def test_unknown_loads_never_hold_a_rise_back_and_the_rise_does_not_run_away() -> None:
    sc, models = scaler(), {"m": spec()}
    load, queue = {"a": 6.0}, {"a": Queue(5, 0.1)}
    # b is loading: its load is unknown. a's queue still raises the count.
    sc.step(models, reps("a", "b"), load, FLOOR, 0.0, queue)
    assert sc.step(models, reps("a", "b"), load, FLOOR, 5.0, queue) == {"m": 6}
    # The new replicas load for minutes while the queue stays: the count is
    # what the load needs, not one more per pass.
    six = reps("a", "b", "c", "d", "e", "f")
    for t in (6.0, 20.0, 60.0):
        assert sc.step(models, six, load, FLOOR, t, queue) == {"m": 6}


def test_a_saturated_replica_is_never_a_reason_to_go_down() -> None:
    sc, models, three = scaler(window=10.0), {"m": spec()}, reps("a", "b", "c")
    # Three run (a new lead keeps them); the load is far below 16 a replica,
    # but a has a request waiting: the window does not run.
    load = {"a": 2.0, "b": 0.0, "c": 0.0}
    queue = {"a": Queue(1, 0.1), "b": Queue(0, 0.0), "c": Queue(0, 0.0)}
    for t in (0.0, 5.0, 10.0, 30.0):
        assert sc.step(models, three, load, FLOOR, t, queue) == {"m": 3}
    # The queue drains: the window starts now, and down is as before.
    idle = {"a": Queue(0, 0.1), "b": Queue(0, 0.0), "c": Queue(0, 0.0)}
    assert sc.step(models, three, {"a": 1.0, "b": 0, "c": 0}, FLOOR, 31.0, idle) == {"m": 3}
    assert sc.step(models, three, {"a": 1.0, "b": 0, "c": 0}, FLOOR, 40.9, idle) == {"m": 3}
    assert sc.step(models, three, {"a": 1.0, "b": 0, "c": 0}, FLOOR, 41.0, idle) == {"m": 2}


def test_the_leader_wakes_when_a_queue_has_waited_the_delay() -> None:
    sc, models, running = scaler(), {"m": spec()}, reps("a")
    assert sc.next_due(0.0) is None
    sc.step(models, running, {"a": 6.0}, FLOOR, 100.0, {"a": Queue(5, 0.1)})
    assert sc.next_due(101.5) == 3.5
    sc.step(models, running, {"a": 6.0}, FLOOR, 105.0, {"a": Queue(5, 0.1)})
    assert sc.next_due(105.0) is None  # acted on: nothing more to wake for


def test_a_llamacpp_replica_scales_at_one_request_without_a_load_target() -> None:
    # llama-cpp-python's server runs one request at a time: a second one waits.
    sc = Scaler(window=300.0, default_target=16)
    models, cpu = {"m": spec(engine="llamacpp")}, reps("a", engine="llamacpp")
    assert sc.step(models, cpu, {"a": 3.0}, FLOOR, 0.0) == {"m": 3}
    # A spec's own target still wins.
    assert Scaler(window=300.0, default_target=16).step(
        {"m": spec(target=2, engine="llamacpp")}, cpu, {"a": 3.0}, FLOOR, 0.0) == {"m": 2}
    # And every gateway's status says so.
    usages = {"gw": s.Usage(gateway="gw", inflight={"a": 3}, last_used={"m": 1.0})}
    assert wanted_now(models["m"], list(cpu.values()), usages, 2.0, 60.0, 16) == 3


# --- the snapshot: waiting and KV apart, old snapshots still read ----------------------


def test_queues_are_read_from_every_snapshot_and_old_ones_still_count() -> None:
    usages = {
        "gw-1": s.Usage(gateway="gw-1", loads={"a": 6, "b": 1}, waiting={"a": 5, "b": 0},
                        kv_cache={"a": 0.2, "b": 0.1}),
        "gw-2": s.Usage(gateway="gw-2", loads={"a": 5}, waiting={"a": 4}, kv_cache={"a": 0.99}),
        # Written before saturation: its loads count, it says nothing of queues.
        "gw-old": s.Usage.model_validate_json('{"gateway": "gw-old", "loads": {"c": 3}}'),
    }
    assert replica_loads(usages) == {"a": 6, "b": 1, "c": 3}
    assert replica_queues(usages) == {"a": Queue(5, 0.99), "b": Queue(0, 0.1)}
    # An old snapshot alone: loads, no queue, so no saturation from it.
    sc, models, running = scaler(), {"m": spec()}, reps("c")
    old = {"gw-old": usages["gw-old"]}
    sc.step(models, running, replica_loads(old), FLOOR, 0.0, replica_queues(old))
    assert sc.step(models, running, replica_loads(old), FLOOR, 9.0,
                   replica_queues(old)) == {"m": 1}


async def test_the_snapshot_carries_waiting_and_kv_apart_and_a_change_is_written(
    parts: tuple[EmbeddedStore, Mirror],
) -> None:
    store, mirror = parts
    rep = s.Replica(id="m-a", model="m", node="n1", weights="org/m")
    assert await mirror.wait_for(await store.put(s.REPLICAS + "m-a",
                                                 rep.model_dump_json().encode()), 2)
    clock = Clock(100.0)
    table = RouteTable(clock=clock)
    source = RouterUsage(table, LastUse(), Publisher(mirror, table, SecretRing("s" * 32)))
    lease = await store.grant(10)
    pub = UsagePublisher(store, mirror, source, "gw", lambda: lease, refresh=30,
                         wall=Clock(1000.0))
    table.set_loads({"m-a": EngineLoad(1, 0, 0.25, at=100.0)})
    assert await pub.step()
    assert not pub.newly_saturated()
    # A queue forming is news worth a write before the usual interval.
    table.set_loads({"m-a": EngineLoad(1, 5, 0.25, at=100.0)})
    assert pub.newly_saturated()
    assert await pub.step()
    assert not pub.newly_saturated()  # written: the leader has heard
    kv = await store.get(s.USAGE + "gw")
    assert kv is not None
    got = s.Usage.model_validate_json(kv.value)
    # `loads` keeps its meaning (running + waiting) for leaders older than this.
    assert (got.loads, got.waiting, got.kv_cache) == ({"m-a": 6}, {"m-a": 5}, {"m-a": 0.25})
    # Requests moving from waiting to running change no load, and are written.
    table.set_loads({"m-a": EngineLoad(2, 4, 0.25, at=100.0)})
    assert await pub.step() and pub.written is not None and pub.written.waiting == {"m-a": 4}
    # The cache filling alone is written only when it reaches the limit:
    # a generating engine's cache changes every poll.
    table.set_loads({"m-a": EngineLoad(2, 4, 0.5, at=100.0)})
    assert not await pub.step()
    table.set_loads({"m-a": EngineLoad(2, 0, 0.985, at=100.0)})
    assert pub.newly_saturated()  # full, although nothing waits
    assert await pub.step() and pub.written.kv_cache == {"m-a": 0.985}
    assert not pub.newly_saturated()


# --- across processes -------------------------------------------------------------------


def engine_waiting(url: str) -> float:
    r = httpx.get(url + "/metrics", timeout=5)
    r.raise_for_status()
    return sum(x.value for fam in text_string_to_metric_families(r.text)
               for x in fam.samples if x.name == "llmgw_engine_waiting")


def test_a_saturated_engine_gets_a_second_replica_within_ten_seconds(
    cluster: Cluster, monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Long answers (one word every 0.1 s, a minute each) on an engine that
    # runs one request at a time: the others wait in its queue.
    monkeypatch.setenv("FAKE_VLLM_TOKEN_DELAY", "0.1")
    gw = cluster.gateway("gw-a")  # the default intervals, target and delay
    cluster.agent("node-1", [gw], "--gpus", "2")
    wait_for(lambda: gw.admin().get("/admin/nodes").json(), 15, "node-1 registered")
    key = make_key(gw)
    put_model(gw, "chat", {"model": "acme/chat", "replicas": {"min": 1, "max": 2},
                           "profiles": [{"gpus": 1, "engine_args": ["--max-num-seqs=1"]}]})
    wait_ready(gw, 60)
    stop = threading.Event()
    started, failures = threading.Semaphore(0), list[str]()

    def stream(client: openai.OpenAI) -> None:
        try:
            with client.chat.completions.create(
                    model="chat", stream=True,
                    messages=[{"role": "user", "content": " ".join(["w"] * 600)}]) as chunks:
                for i, _ in enumerate(chunks):
                    if i == 1:
                        started.release()
                    if stop.is_set():
                        break  # closing the stream aborts the request in the engine
        except openai.OpenAIError as exc:
            failures.append(repr(exc))

    # Clients made first: the clock below starts before the requests, not
    # before this test's own set-up.
    threads = [threading.Thread(target=stream, args=(openai.OpenAI(
        base_url=gw.url + "/v1", api_key=key, max_retries=0),)) for _ in range(6)]
    try:
        # One runs; from when the other five are sent, the engine is saturated.
        threads[0].start()
        assert started.acquire(timeout=30), failures
        saturated = time.monotonic()
        for t in threads[1:]:
            t.start()
        wait_for(lambda: engine_waiting(gw.url) == 5, 5, "five requests waiting")
        wait_for(lambda: len(replicas(gw)) == 2, 15, "a second replica")
        took = time.monotonic() - saturated
        print(f"second replica placed {took:.1f} s after the engine saturated")
        assert took <= 10.0, took
    finally:
        stop.set()
        for t in threads:
            t.join(30)
    assert failures == [], failures[:3]
