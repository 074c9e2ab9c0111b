"""LoRA adapters in process: the catalog rules, the subset rule (grow under
load, shrink when idle, time injected), the base's engine flags, and the
router's view (endpoints of the subset only, the adapter's name upstream,
`parent` in /v1/models). docs/design/lora-adapters.md."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from pydantic import ValidationError

from app.control import state as s
from app.control.adapters import AdapterLoop, BaseReplica, decide, size_for
from app.control.keys import SecretRing
from app.control.leader import Elector
from app.control.mirror import Mirror
from app.control.plan.phases import _matches, _spec_runs
from app.control.usage import UsagePublisher
from app.gateway.publish import Publisher
from app.router.table import RouteTable
from app.store.embedded import EmbeddedStore
from app.wire.adapters import engine_flags, max_loras
from app.wire.catalog import check_catalog, check_spec
from app.wire.spec import ModelSpec, Profile
from tests.test_reconciler import Clock, put
from tests.test_usage import Source

SECRET = "adapters-test-secret-0123456789"
ROOTS = ["/models"]


def spec(**fields: object) -> ModelSpec:
    return ModelSpec.model_validate(fields)


BASE = spec(model="org/base")
SQL = spec(adapter={"base": "base", "weights": "/models/sql-lora", "max_replicas": 3,
                    "load_target": 2})


# --- the catalog's rules -------------------------------------------------------


def test_an_adapter_names_a_vllm_model_of_the_catalog() -> None:
    assert check_catalog({"base": BASE, "sql": SQL}, ROOTS) == []
    errors = {(".".join(map(str, e.loc)), e.msg) for e in check_catalog({"sql": SQL}, ROOTS)}
    assert errors == {("models.sql.adapter.base", "base model 'base' is not in the catalog")}
    cpu = spec(model="/models/base.gguf", engine="llamacpp")
    [err] = check_catalog({"base": cpu, "sql": SQL}, ROOTS)
    assert "adapters are loaded by vLLM only" in err.msg
    ext = spec(external={"url": "https://llm.example.com", "model": "x"})
    [err] = check_catalog({"base": ext, "sql": SQL}, ROOTS)
    assert "external" in err.msg
    [err] = check_catalog({"base": BASE, "a": SQL, "sql": spec(adapter={
        "base": "a", "weights": "org/lora"})}, ROOTS)
    assert err.loc == ("models", "sql", "adapter", "base") and "itself an adapter" in err.msg


def test_an_adapter_takes_no_fields_of_its_own_engine() -> None:
    bad = spec(adapter={"base": "base", "weights": "/elsewhere/lora"}, gpus=1,
               model="org/x")
    assert {e.loc for e in check_spec(bad, ROOTS)} == {
        ("model",), ("gpus",), ("adapter", "weights")}
    with pytest.raises(ValidationError, match="neither a hub id"):
        spec(adapter={"base": "base", "weights": "--enable-lora"})
    assert SQL.profile_list == [] and SQL.replica_range.max == 0  # nothing placed for it


def test_the_base_starts_with_runtime_lora_loading_when_an_adapter_names_it() -> None:
    prof = Profile()
    assert engine_flags(prof, lora=False) == []
    flags = engine_flags(prof, lora=True)
    assert flags == ["--enable-lora", "--max-loras=4"] and max_loras(flags) == 4
    own = Profile(engine_args=["--max-loras=2", "--max-lora-rank=64"])
    assert engine_flags(own, lora=True) == [
        "--max-loras=2", "--max-lora-rank=64", "--enable-lora"]
    assert max_loras(engine_flags(own, lora=True)) == 2
    assert max_loras([]) == 0  # a replica without LoRA holds none
    # A replica started before the first adapter no longer matches: replaced.
    rep = s.Replica(id="base-1", model="base", node="n", gpus=[0], engine="vllm",
                    weights="org/base", engine_args=[], secret="x")
    stored = s.StoredModel(name="base", model="org/base")
    assert _matches(_spec_runs(stored, lora=False), rep, "x", "x")
    assert not _matches(_spec_runs(stored, lora=True), rep, "x", "x")


# --- the subset rule -----------------------------------------------------------


def reps(*ids: str, slots: int = 4, held: int = 0) -> list[BaseReplica]:
    return [BaseReplica(i, slots, held) for i in ids]


def test_size_is_load_over_target_between_one_and_the_cap() -> None:
    assert [size_for(n, 2, 3) for n in (0, 1, 2, 3, 4, 5, 6, 100)] == [1, 1, 1, 2, 2, 3, 3, 3]


def test_the_subset_grows_under_load_one_replica_a_step_up_to_its_cap() -> None:
    a = SQL.adapter
    assert a is not None
    ready = reps("r1", "r2", "r3", "r4")
    rec = decide("sql", a, None, ready, 0, 0.0, shrink_after=60)
    assert rec.replicas == ["r1"]  # at least one, idle or not
    rec = decide("sql", a, rec, ready, 0, 1.0, shrink_after=60)
    assert rec.replicas == ["r1"]
    for t, want in ((2.0, ["r1", "r2"]), (3.0, ["r1", "r2", "r3"]), (4.0, ["r1", "r2", "r3"])):
        rec = decide("sql", a, rec, ready, 40, t, shrink_after=60)
        assert rec.replicas == want  # max_replicas 3 caps it, whatever the load


def test_full_replicas_are_passed_over_and_the_emptiest_taken() -> None:
    a = SQL.adapter
    assert a is not None
    ready = [BaseReplica("r1", 2, 2), BaseReplica("r2", 2, 1), BaseReplica("r3", 2, 0)]
    rec = decide("sql", a, None, ready, 0, 0.0, shrink_after=60)
    assert rec.replicas == ["r3"]
    rec = decide("sql", a, rec, ready, 40, 1.0, shrink_after=60)
    assert rec.replicas == ["r3", "r2"]
    rec = decide("sql", a, rec, ready, 40, 2.0, shrink_after=60)
    assert rec.replicas == ["r3", "r2"]  # r1's slots are all taken
    assert decide("sql", a, None, [BaseReplica("r1", 1, 1)], 5, 0.0,
                  shrink_after=60).replicas == []


def test_the_subset_shrinks_one_replica_per_window_of_low_load() -> None:
    a = SQL.adapter
    assert a is not None
    ready = reps("r1", "r2", "r3")
    rec = s.AdapterSet(name="sql", base="base", replicas=["r1", "r2", "r3"])
    rec = decide("sql", a, rec, ready, 0, 100.0, shrink_after=60)
    assert rec.replicas == ["r1", "r2", "r3"] and rec.low_since == 100.0
    rec = decide("sql", a, rec, ready, 0, 159.0, shrink_after=60)
    assert len(rec.replicas) == 3
    rec = decide("sql", a, rec, ready, 0, 160.0, shrink_after=60)
    assert rec.replicas == ["r1", "r2"] and rec.unloading == {"r3": 160.0}
    # Load back before the next window: the window starts again.
    rec = decide("sql", a, rec, ready, 3, 200.0, shrink_after=60)
    assert rec.replicas == ["r1", "r2"] and rec.low_since is None
    rec = decide("sql", a, rec, ready, 0, 210.0, shrink_after=60)
    rec = decide("sql", a, rec, ready, 0, 270.0, shrink_after=60)
    assert rec.replicas == ["r1"]
    rec = decide("sql", a, rec, ready, 0, 400.0, shrink_after=60)
    assert rec.replicas == ["r1"]  # never below one
    # Growing again takes a replica still being unloaded first: it has it.
    rec = decide("sql", a, rec, ready, 40, 401.0, shrink_after=60)
    assert rec.replicas[1] in ("r2", "r3") and rec.replicas[1] not in rec.unloading


def test_a_replica_gone_leaves_the_subset_and_another_takes_its_place() -> None:
    a = SQL.adapter
    assert a is not None
    rec = s.AdapterSet(name="sql", base="base", replicas=["r1"])
    rec = decide("sql", a, rec, reps("r2"), 0, 5.0, shrink_after=60)
    assert rec.replicas == ["r2"] and rec.unloading == {"r1": 5.0}


# --- the leader's step and the router ------------------------------------------


class FakeEngines:
    def __init__(self) -> None:
        self.loaded: dict[str, set[str]] = {}  # url -> adapters
        self.calls: list[tuple[str, str, str]] = []
        self.deaf: set[str] = set()  # urls whose listing gets no answer
        self.asking = 0  # listings under way now
        self.most_asking = 0

    async def listed(self, url: str, key: str) -> set[str] | None:
        assert key  # the engine key, never empty
        self.asking += 1
        self.most_asking = max(self.most_asking, self.asking)
        try:
            await asyncio.sleep(0.01)  # an engine's answer takes a while
        finally:
            self.asking -= 1
        if url in self.deaf:
            return None
        return set(self.loaded.get(url, set()))

    async def load(self, url: str, key: str, name: str, path: str) -> str | None:
        self.calls.append(("load", url, name))
        if name in self.loaded.get(url, set()):
            # vLLM's answer to a second load under the same name.
            return (f"HTTP 400: The lora adapter '{name}' has already been loaded. If you "
                    "want to load the adapter in place, set 'load_inplace' to True.")
        self.loaded.setdefault(url, set()).add(name)
        return None

    async def unload(self, url: str, key: str, name: str) -> str | None:
        self.calls.append(("unload", url, name))
        self.loaded.get(url, set()).discard(name)
        return None


@pytest.fixture
async def parts(tmp_path: Path) -> AsyncIterator[tuple[EmbeddedStore, Mirror, Elector]]:
    store = await EmbeddedStore.open(tmp_path / "state.db", expiry_interval=None)
    mirror = Mirror(store)
    mirror.start()
    elector = Elector(store, s.GatewayInfo(id="gw", url="u", version="t", started=0), ttl=10)
    try:
        assert (await elector.tick()).is_leader
        yield store, mirror, elector
    finally:
        await mirror.stop()
        await store.close()


async def test_the_leader_loads_the_subset_and_the_router_routes_only_there(
    parts: tuple[EmbeddedStore, Mirror, Elector],
) -> None:
    store, mirror, elector = parts
    secrets = SecretRing(SECRET)
    await put(store, mirror, s.MODELS + "base", s.StoredModel(name="base", model="org/base"))
    await put(store, mirror, s.MODELS + "sql", s.StoredModel(name="sql", aliases=["q"], **{
        "adapter": {"base": "base", "weights": "/models/sql", "max_replicas": 2,
                    "load_target": 1}}))
    await put(store, mirror, s.NODES + "n1", s.NodeInfo(name="n1", gpus=[], engines=["vllm"]))
    for i in (1, 2, 3):
        rid = f"base-{i}"
        await put(store, mirror, s.REPLICAS + rid, s.Replica(
            id=rid, model="base", node="n1", gpus=[i], engine="vllm", weights="org/base",
            engine_args=["--enable-lora", "--max-loras=4"], secret=secrets.current_id))
        await put(store, mirror, s.STATUS + rid, s.ReplicaStatus(
            id=rid, node="n1", phase="ready", url=f"http://127.0.0.1:{9000 + i}"))
    engines = FakeEngines()
    clock = Clock(1000.0)
    loop = AdapterLoop(store, mirror, elector, secrets, engines, shrink_after=60, drain=30,
                       clock=clock)
    table = RouteTable()
    publisher = Publisher(mirror, table, secrets)

    assert await loop.step()
    rec = mirror.parsed(s.ADAPTERS, s.AdapterSet)["sql"]
    assert rec.replicas == ["base-1"]
    assert engines.calls == [("load", "http://127.0.0.1:9001", "sql")]
    publisher.publish()
    [ep] = table.endpoints("sql")
    assert (ep.replica_id, ep.upstream_model, ep.adapter) == ("base-1", "sql", "sql")
    assert ep.key == secrets.engine_key("base-1", secrets.current_id)
    assert table.resolve("q") == "sql" and len(table.endpoints("base")) == 3
    assert [(e.name, e.parent) for e in table.catalog()] == [("base", ""), ("sql", "base")]

    # Its requests in flight over every gateway grow it, up to max_replicas.
    await put(store, mirror, s.USAGE + "gw", s.Usage(gateway="gw", adapters={"sql": 5}))
    clock.now += 2
    await loop.step()
    clock.now += 2
    await loop.step()
    assert mirror.parsed(s.ADAPTERS, s.AdapterSet)["sql"].replicas == ["base-1", "base-2"]
    # The engines holding it are asked what they list all at once: one slow
    # to answer delays a pass by one call, not one a replica.
    engines.most_asking = 0
    await loop.step()
    assert engines.most_asking == 2
    publisher.publish()
    assert {e.replica_id for e in table.endpoints("sql")} == {"base-1", "base-2"}
    with table.acquire(table.endpoints("sql")[0]):
        assert table.adapter_inflight() == {"sql": 1}
    assert table.adapter_inflight() == {}

    # Idle: out of the router at once after the window, unloaded after the drain.
    await put(store, mirror, s.USAGE + "gw", s.Usage(gateway="gw"))
    await loop.step()
    clock.now += 61
    await loop.step()
    publisher.publish()
    assert [e.replica_id for e in table.endpoints("sql")] == ["base-1"]
    assert ("unload", "http://127.0.0.1:9002", "sql") not in engines.calls
    clock.now += 31
    await loop.step()
    assert engines.calls[-1] == ("unload", "http://127.0.0.1:9002", "sql")
    assert mirror.parsed(s.ADAPTERS, s.AdapterSet)["sql"].unloading == {}

    # An engine that misses a listing keeps it: not loaded again (refused
    # as already loaded), not taken out of the router.
    engines.deaf.add("http://127.0.0.1:9001")
    for _ in range(3):
        clock.now += 2
        await loop.step()
    assert mirror.parsed(s.ADAPTERS, s.AdapterSet)["sql"].replicas == ["base-1"]
    assert engines.calls[-1] == ("unload", "http://127.0.0.1:9002", "sql")
    engines.deaf.clear()

    # An engine that lost it (restarted) is loaded again.
    engines.loaded.clear()
    await loop.step()
    assert engines.calls[-1] == ("load", "http://127.0.0.1:9001", "sql")

    # Not leading: nothing.
    await elector.step_down()
    assert not await loop.step()


async def test_requests_for_an_adapter_stay_in_its_subset_with_prompt_affinity(
    parts: tuple[EmbeddedStore, Mirror, Elector],
) -> None:
    store, mirror, _ = parts
    secrets = SecretRing(SECRET)
    await put(store, mirror, s.MODELS + "base", s.StoredModel(name="base", model="org/base"))
    await put(store, mirror, s.MODELS + "sql", s.StoredModel(name="sql", **{
        "adapter": {"base": "base", "weights": "/models/sql"}}))
    await put(store, mirror, s.NODES + "n1", s.NodeInfo(name="n1", gpus=[], engines=["vllm"]))
    for i in (1, 2, 3, 4):
        rid = f"base-{i}"
        await put(store, mirror, s.REPLICAS + rid, s.Replica(
            id=rid, model="base", node="n1", gpus=[i], engine="vllm", weights="org/base",
            engine_args=["--enable-lora"], secret=secrets.current_id))
        await put(store, mirror, s.STATUS + rid, s.ReplicaStatus(
            id=rid, node="n1", phase="ready", url=f"http://127.0.0.1:{9000 + i}"))
    table = RouteTable()
    publisher = Publisher(mirror, table, secrets)
    publisher.publish()
    # Not loaded anywhere yet: held for (the leader loads it within a pass).
    assert table.endpoints("sql") == () and table.holdable("sql")
    assert "being loaded" in (table.unavailable("sql") or "")
    await put(store, mirror, s.ADAPTERS + "sql", s.AdapterSet(
        name="sql", base="base", replicas=["base-2", "base-4"], unloading={"base-3": 1.0}))
    publisher.publish()
    picks = {i: table.choose("sql", set(), affinity=f"conversation {i}") for i in range(40)}
    assert {ep.replica_id for ep in picks.values() if ep} == {"base-2", "base-4"}
    for i, ep in picks.items():  # the same prefix, the same replica
        again = table.choose("sql", set(), affinity=f"conversation {i}")
        assert ep is not None and again is not None and again.replica_id == ep.replica_id
    # The base's own requests still go to every replica.
    assert len({table.choose("base", set(), affinity=f"c{i}").replica_id  # type: ignore[union-attr]
                for i in range(60)}) == 4


async def test_a_request_for_an_adapter_of_a_stopped_base_is_held_and_starts_the_base(
    parts: tuple[EmbeddedStore, Mirror, Elector],
) -> None:
    store, mirror, _ = parts
    secrets = SecretRing(SECRET)
    await put(store, mirror, s.MODELS + "base", s.StoredModel(
        name="base", model="org/base", replicas={"min": 0, "max": 1}, idle_timeout=60))
    await put(store, mirror, s.MODELS + "sql", s.StoredModel(name="sql", **{
        "adapter": {"base": "base", "weights": "/models/sql"}}))
    table = RouteTable()
    Publisher(mirror, table, secrets).publish()
    assert table.holdable("sql") and "started on demand" in (table.unavailable("sql") or "")
    src = Source()
    src.held = {"sql": 1}
    pub = UsagePublisher(store, mirror, src, "gw", lambda: 0, refresh=30, wall=lambda: 500.0)
    usage, _ = pub.snapshot()
    assert usage.last_used == {"sql": 500.0, "base": 500.0}
    src.held, src.used = {}, {"sql": 450.0, "base": 400.0}
    assert pub.snapshot()[0].last_used == {"sql": 450.0, "base": 450.0}
