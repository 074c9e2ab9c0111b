"""Load-based scaling: the engines' load from the router to the usage
snapshot, the leader's reading of it, the scaler's rule one step at a time,
and, across real processes, replicas rising under load and falling back."""

from __future__ import annotations

import threading
import time

import openai
import pytest

from app.control import state as s
from app.control.keys import SecretRing
from app.control.mirror import Mirror
from app.control.plan.scaling import Scaler, desired
from app.control.usage import UsagePublisher, replica_loads
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


# --- from the router to the snapshot, and back out for the leader ---------------------


async def test_the_snapshot_carries_fresh_engine_loads_and_a_change_is_written(
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

    # Running and waiting both count; a stale poll and a replica the
    # store no longer has are left out (unknown).
    table.set_loads({"m-a": EngineLoad(3, 2, 0.1, at=99.0),
                     "gone": EngineLoad(7, 0, 0.1, at=99.5),
                     "m-b": EngineLoad(1, 0, 0.1, at=90.0)})
    assert await pub.step()
    assert pub.written is not None and pub.written.loads == {"m-a": 5.0}
    assert not await pub.step()  # nothing changed: nothing written
    # A load alone changing is written: the leader scales on it.
    table.set_loads({"m-a": EngineLoad(0, 0, 0.0, at=100.0)})
    assert await pub.step()
    kv = await store.get(s.USAGE + "gw")
    assert kv is not None and s.Usage.model_validate_json(kv.value).loads == {"m-a": 0.0}
    # Going stale is a change too: the leader must not scale down on it.
    clock.now = 103.5
    assert await pub.step()
    assert pub.written.loads == {}


def test_a_replicas_load_is_the_largest_gateway_report_never_their_sum() -> None:
    usages = {
        "gw-1": s.Usage(gateway="gw-1", loads={"a": 6, "b": 1}),
        "gw-2": s.Usage(gateway="gw-2", loads={"a": 5}),
        # A snapshot written before scaling existed: no loads, still read.
        "gw-old": s.Usage.model_validate_json('{"gateway": "gw-old", "inflight": {"a": 2}}'),
    }
    assert replica_loads(usages) == {"a": 6, "b": 1}


def test_a_llamacpp_replicas_load_is_the_gateways_in_flight_summed() -> None:
    # llama-cpp-python's server has no /metrics: each gateway counts its own.
    usages = {"gw-1": s.Usage(gateway="gw-1", inflight={"cpu": 2}),
              "gw-2": s.Usage(gateway="gw-2", inflight={"cpu": 1, "gpu": 4})}
    assert replica_loads(usages, ["cpu", "idle"]) == {"cpu": 3.0, "idle": 0.0}
    assert replica_loads({}, ["cpu"]) == {}  # no snapshot at all: unknown


# --- the scaler, one step at a time -----------------------------------------------------


def spec(name: str = "m", lo: int = 1, hi: int = 4, target: int | None = 4) -> s.StoredModel:
    return s.StoredModel(name=name, model=f"org/{name}", replicas=s.ReplicaRange(min=lo, max=hi),
                         load_target=target)


def reps(*ids: str, model: str = "m") -> dict[str, s.Replica]:
    return {rid: s.Replica(id=rid, model=model, node="n1", weights=f"org/{model}")
            for rid in ids}


def test_desired_is_the_load_over_the_target_within_the_range() -> None:
    assert desired(0, 4, 1, 3) == 1
    assert desired(4, 4, 1, 3) == 1
    assert desired(4.5, 4, 1, 3) == 2
    assert desired(100, 4, 1, 3) == 3


def test_a_model_without_a_load_target_scales_at_the_default() -> None:
    scaler = Scaler(window=10, default_target=8)
    models = {"m": spec(target=None)}
    assert scaler.step(models, reps("a"), {"a": 17}, {"m": 1}, 0.0) == {"m": 3}


def test_the_scaler_holds_what_runs_on_a_new_lead_and_leaves_unscalable_models_out() -> None:
    scaler = Scaler(window=10, default_target=8)
    models = {"m": spec(), "fixed": spec("fixed", 2, 2), "idle": spec("idle", 0, 3),
              "ext": s.StoredModel(name="ext", external=s.External(url="https://x", model="x"))}
    running = reps("a", "b", "c") | reps("f1", "f2", model="fixed")
    floors = {"m": 1, "fixed": 2, "idle": 0, "ext": 0}
    # A new lead finds three replicas: it keeps them for a window, load or none.
    assert scaler.step(models, running, {"a": 0, "b": 0, "c": 0}, floors, 0.0) == {"m": 3}
    assert scaler.step(models, running, {"a": 0, "b": 0, "c": 0}, floors, 9.9) == {"m": 3}
    assert scaler.step(models, running, {"a": 0, "b": 0, "c": 0}, floors, 10.0) == {"m": 2}
    # After reset() (a handover) it starts over from what runs.
    scaler.reset()
    assert scaler.step(models, running, {}, floors, 11.0) == {"m": 3}
    # A spec whose max drops below what is held is clamped at once.
    assert scaler.step({"m": spec(hi=2)}, running, {}, floors, 12.0) == {"m": 2}


def test_a_step_down_removes_one_of_what_runs_even_when_more_was_wanted() -> None:
    scaler = Scaler(window=10, default_target=4)
    models, floors = {"m": spec()}, {"m": 1}
    # 13 requests at 4 a replica: 4 wanted, but only 2 could be placed.
    assert scaler.step(models, reps("a", "b"), {"a": 7, "b": 6}, floors, 0.0) == {"m": 4}
    idle = {"a": 0.0, "b": 0.0}
    assert scaler.step(models, reps("a", "b"), idle, floors, 1.0) == {"m": 4}
    # A window later, one of the two that run goes, not a phantom one.
    assert scaler.step(models, reps("a", "b"), idle, floors, 11.0) == {"m": 1}
    # Never below what the load wants.
    assert scaler.step(models, reps("a", "b"), {"a": 7, "b": 6}, floors, 12.0) == {"m": 4}
    assert scaler.step(models, reps("a", "b"), {"a": 5, "b": 1}, floors, 13.0) == {"m": 4}
    assert scaler.step(models, reps("a", "b"), {"a": 5, "b": 1}, floors, 23.0) == {"m": 2}


# --- across processes -------------------------------------------------------------------


WINDOW = 3.0


def test_load_raises_replicas_toward_max_and_they_fall_back_after_the_window(
    cluster: Cluster, monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Long answers (one word every 0.1 s) keep requests running in the
    # engine, which its /metrics reports.
    monkeypatch.setenv("FAKE_VLLM_TOKEN_DELAY", "0.1")
    gw = cluster.gateway("gw-a", usage_interval="0.5", reconcile_interval="0.5",
                         scale_down_window=str(WINDOW))
    cluster.agent("node-1", [gw], "--gpus", "3")
    wait_for(lambda: gw.admin().get("/admin/nodes").json(), 15, "node-1 registered")
    key = make_key(gw)
    put_model(gw, "chat", {"model": "acme/chat", "gpus": 1, "load_target": 2,
                           "replicas": {"min": 1, "max": 3}})
    wait_ready(gw, 60)

    def serving() -> list[str]:
        return sorted(r["id"] for r in replicas(gw) if r["phase"] != "stopping")

    assert len(serving()) == 1
    stop = threading.Event()
    started, failures = threading.Semaphore(0), list[str]()

    def stream() -> None:
        client = openai.OpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0)
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

    # Six streams at two per replica: three replicas, the max.
    threads = [threading.Thread(target=stream) for _ in range(6)]
    for t in threads:
        t.start()
    try:
        for _ in threads:
            assert started.acquire(timeout=30), failures
        began = time.monotonic()
        wait_for(lambda: len(serving()) == 3, 30, "three replicas under load")
        print(f"3 replicas {time.monotonic() - began:.1f} s after the load began")
        wait_for(lambda: all(r["phase"] == "ready" for r in replicas(gw)), 30,
                 "the new replicas ready")
        # Any gateway's status tells what the load asks for, not the floor.
        with gw.admin() as admin:
            assert wait_for(lambda: admin.get("/admin/models/chat").json()["status"][
                "wanted"] == 3, 10, "status wanted 3")
    finally:
        stop.set()
        for t in threads:
            t.join(30)
    stopped = time.monotonic()
    assert failures == [], failures[:3]

    # The load is gone: nothing goes before the window, then one at a time.
    wait_for(lambda: len(serving()) == 2, 30, "one replica drained")
    first = time.monotonic() - stopped
    wait_for(lambda: len(serving()) == 1, 30, "back to min")
    second = time.monotonic() - stopped
    print(f"down to 2 replicas {first:.1f} s after the load stopped, to 1 after {second:.1f} s")
    assert first >= WINDOW and second - first >= WINDOW - 0.5, (first, second)
    wait_for(lambda: len(replicas(gw)) == 1, 30, "the drained replicas removed")
