"""The catalog: full model specs, their validation, seeding from a file, export.

In-process gateways (create_app, real stores: SQLite, or the shared etcd for
the seeding race); one subprocess for what the CLI prints on a bad file.
"""

from __future__ import annotations

import asyncio
import json
import logging
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from pydantic import ValidationError

from app.control import catalog
from app.control import state as s
from app.control.plan.planner import PlanInput, PlanPolicy, plan
from app.gateway.gateway import Gateway
from app.gateway.main import GatewayApp, create_app
from app.gateway.settings import Settings
from app.wire import catalog as rules
from tests.support.etcd import EtcdServer, ExternalEtcd
from tests.support.procs import ROOT

ADMIN = "catalog-test-admin-token-0123"
SECRET = "catalog-test-secret-0123456789"
EXT = {"url": "https://llm.example.com", "model": "gpt-x"}


def settings(tmp: Path, name: str, **kw: Any) -> Settings:
    return Settings(data_dir=tmp / name, gateway_id=name, admin_token=ADMIN, secret=SECRET,
                    local_agent=False, **kw)


async def started(st: Settings) -> tuple[GatewayApp, Gateway]:
    app = create_app(st)
    gw: Gateway = app.state.gateway
    await gw.start()
    await loaded(gw)
    return app, gw


async def loaded(gw: Gateway) -> None:
    """Until the gateway's mirror has what the store holds now."""
    revision = (await gw.store.range(s.CATALOG_SERIAL)).revision
    assert await gw.mirror.wait_for(revision, 5)


def client(app: GatewayApp) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw",
                             headers={"Authorization": f"Bearer {ADMIN}"})


@pytest.fixture
async def gw(tmp_path: Path) -> AsyncIterator[tuple[httpx.AsyncClient, Gateway]]:
    app, gateway = await started(settings(tmp_path, "gw"))
    try:
        async with client(app) as c:
            yield c, gateway
    finally:
        await gateway.stop()


def profile(**kw: Any) -> dict[str, Any]:
    return {"model": "org/m", "profiles": [kw]}


# (body, the field named, a word of the reason). Each is refused with a 422
# naming the field, and nothing reaches the store.
INVALID: list[tuple[dict[str, Any], list[str | int], str]] = [
    ({"model": "w", "replicas": {"min": 3, "max": 1}}, ["replicas"], "below replicas.min"),
    ({"model": "w", "engine": "tgi"}, ["engine"], "'vllm' or 'llamacpp'"),
    (profile(engine="tgi"), ["profiles", 0, "engine"], "'vllm' or 'llamacpp'"),
    ({"external": EXT, "gpus": 1}, ["gpus"], "external"),
    ({"external": EXT, "profiles": [{}]}, ["profiles"], "external"),
    ({"external": EXT, "replicas": {"min": 1, "max": 1}}, ["replicas"], "external"),
    ({"external": EXT, "model": "org/w"}, ["model"], "external"),
    ({"external": EXT, "quota": "team-a"}, ["quota"], "external"),
    ({"external": EXT | {"url": "ftp://llm.example.com"}}, ["external", "url"], "http"),
    ({"external": EXT | {"url": "llm.example.com"}}, ["external", "url"], "http"),
    ({"external": EXT | {"url": "http://169.254.169.254"}}, ["external", "url"], "link-local"),
    ({"external": EXT | {"url": "http://[fe80::1]:8000"}}, ["external", "url"], "link-local"),
    ({"external": EXT | {"url": "http://[::ffff:169.254.1.1]"}}, ["external", "url"],
     "link-local"),
    ({"external": EXT | {"url": "http://metadata.google.internal/"}}, ["external", "url"],
     "metadata"),
    ({"external": EXT | {"url": "http://100.100.100.200"}}, ["external", "url"], "metadata"),
    ({"external": EXT | {"url": "https://u:p@llm.example.com"}}, ["external", "url"],
     "credentials"),
    ({"external": EXT | {"url": "https://llm.example.com:99999"}}, ["external", "url"],
     "out of range"),
    ({"external": EXT | {"url": "https://llm.example.com/v1"}}, ["external", "url"], "/v1"),
    ({"external": EXT | {"api_key_file": "key.txt"}}, ["external", "api_key_file"], "absolute"),
    ({"external": {"url": EXT["url"]}}, ["external", "model"], "required"),
    (profile(engine_args=["--port=9000"]), ["profiles", 0, "engine_args", 0], "set by llmgw"),
    (profile(engine_args=["--served_model_name=x"]), ["profiles", 0, "engine_args", 0],
     "set by llmgw"),
    (profile(engine_args=["--api-key=sk-1"]), ["profiles", 0, "engine_args", 0],
     "set by llmgw"),
    (profile(engine_args=["--tensor-parallel-size=4"]), ["profiles", 0, "engine_args", 0],
     "set by llmgw"),
    # A middleware of the admin's would wrap llmgw's engine guard and could answer
    # requests before the key is checked (docs/design/security.md, "The engine's port").
    (profile(engine_args=["--middleware=x.Y"]), ["profiles", 0, "engine_args", 0],
     "set by llmgw"),
    (profile(engine_args=["--hf-token=hf_x"]), ["profiles", 0, "engine_args", 0], "secret"),
    (profile(engine_args=["--serv=x"]), ["profiles", 0, "engine_args", 0], "abbreviates"),
    (profile(engine_args=["--max-model-len", "4096"]), ["profiles", 0, "engine_args", 1],
     "--name=value"),
    (profile(engine_args=["-tp=2"]), ["profiles", 0, "engine_args", 0], "--name=value"),
    (profile(engine="llamacpp", engine_args=["--model_alias=x"]),
     ["profiles", 0, "engine_args", 0], "set by llmgw"),
    ({"model": "w", "gpus": 2, "profiles": [{}]}, ["gpus"], "inside each profile"),
    ({"model": "w", "engine": "vllm", "profiles": [{}]}, ["engine"], "inside each profile"),
    # vllm with gpus 0 runs on the CPU build: no GPU memory to ask for.
    (profile(gpus=0, gpu_memory_gib=8), ["profiles", 0, "gpu_memory_gib"], "CPU build"),
    (profile(engine="llamacpp", gpus=1), ["profiles", 0, "gpus"], "CPU nodes"),
    (profile(engine="llamacpp", gpu_memory_gib=8), ["profiles", 0, "gpu_memory_gib"],
     "CPU nodes"),
    (profile(gpu_memory_gib=-1), ["profiles", 0, "gpu_memory_gib"], "greater than 0"),
    (profile(gpu_memory_utilization=1.5), ["profiles", 0, "gpu_memory_utilization"],
     "less than or equal to 1"),
    (profile(engine="llamacpp", gpus=0, max_model_len=4096), ["profiles", 0, "max_model_len"],
     "vLLM setting"),
    (profile(max_model_len=4096, engine_args=["--max_model_len=8192"]),
     ["profiles", 0, "max_model_len"], "given twice"),
    (profile(pool="a b"), ["profiles", 0, "pool"], "letters, digits"),
    (profile(bogus=1), ["profiles", 0, "bogus"], "Extra inputs"),
    ({"model": "w", "profiles": [{"name": "a"}, {"name": "a"}]}, ["profiles", 1, "name"],
     "repeats"),
    ({"model": "w", "profiles": []}, ["profiles"], "at least 1"),
    ({"model": "w", "engine": "llamacpp", "gpus": 2}, ["gpus"], "CPU nodes"),
    ({"model": "w", "replicas": {"min": 0, "max": 2}}, ["idle_timeout"], "idle_timeout"),
    ({"model": "w", "idle_timeout": 0}, ["idle_timeout"], "greater than 0"),
    ({"model": "w", "load_target": 0}, ["load_target"], "greater than or equal to 1"),
    ({"model": "w", "quota": "a b"}, ["quota"], "letters, digits"),
    ({}, ["model"], "required"),
    ({"model": "/etc/models/w"}, ["model"], "model root"),
    ({"model": "/models/w", "revision": "main"}, ["revision"], "hub id"),
    ({"model": "-w"}, ["model"], "hub id"),
]


@pytest.mark.parametrize(("body", "field", "reason"), INVALID,
                         ids=[f"{'.'.join(map(str, f))}:{r}" for _, f, r in INVALID])
async def test_an_invalid_spec_is_refused_naming_the_field_and_nothing_is_stored(
    gw: tuple[httpx.AsyncClient, Gateway], body: dict[str, Any], field: list[str | int],
    reason: str,
) -> None:
    c, gateway = gw
    r = await c.put("/admin/models/m", json=body)
    assert r.status_code == 422, r.text
    assert r.headers["content-type"].startswith("application/problem+json")
    problem = r.json()
    assert problem["status"] == 422 and problem["title"] == "Invalid request body"
    named = [e for e in problem["errors"] if e["loc"] == ["body", *field]]
    assert named, problem["errors"]
    assert any(reason in e["msg"] for e in named), named
    assert (await c.get("/admin/models")).json() == []
    assert await gateway.store.get(s.CATALOG_SERIAL) is None  # no write at all


async def test_an_alias_taken_by_another_model_is_a_409_naming_it(
    gw: tuple[httpx.AsyncClient, Gateway],
) -> None:
    c, _ = gw
    assert (await c.put("/admin/models/m1", json={"model": "w", "aliases": ["a1"]})).status_code \
        == 201
    r = await c.put("/admin/models/m2", json={"external": EXT, "aliases": ["a1"]})
    assert r.status_code == 409 and "'a1' already names model 'm1'" in r.json()["detail"]
    assert [m["name"] for m in (await c.get("/admin/models")).json()] == ["m1"]


FULL: dict[str, dict[str, Any]] = {
    "flat": {"model": "org/flat", "aliases": ["f"], "engine": "vllm", "gpus": 2,
             "replicas": {"min": 1, "max": 3}, "load_target": 8, "idle_timeout": 600,
             "quota": "team-a"},
    "cpu": {"model": "/models/small.gguf", "engine": "llamacpp"},
    "profiled": {"model": "org/big", "revision": "v2", "profiles": [
        {"name": "h200", "engine": "vllm", "gpus": 1, "gpu_memory_gib": 80,
         "engine_args": ["--max-model-len=32768", "--enable-prefix-caching",
                         "--max_num_seqs=64"], "priority": 10, "pool": "fast"},
        {"name": "a10", "gpus": 4, "gpu_memory_gib": 24}],
        "replicas": {"min": 0, "max": 2}, "idle_timeout": 300},
    "remote": {"aliases": ["gpt"], "external": {
        "url": "https://llm.example.com", "model": "gpt-x",
        "api_key_file": "/etc/llmgw/keys/provider.key"}},
}


async def test_full_specs_are_stored_as_given_and_exported(
    gw: tuple[httpx.AsyncClient, Gateway],
) -> None:
    c, _ = gw
    for name, spec in FULL.items():
        r = await c.put(f"/admin/models/{name}", json=spec)
        assert r.status_code == 201, r.text
        assert r.json() == spec | {"name": name, "created": r.json()["created"]}
    got = (await c.get("/admin/models/profiled")).json()
    assert got["profiles"] == FULL["profiled"]["profiles"]
    assert got["status"]["wanted"] == 0
    # Its key file is not on this host: withheld, and its status says why,
    # once the read (off the event loop, docs/design/security.md, "Files an admin names")
    # has come back.
    for _ in range(100):
        remote = (await c.get("/admin/models/remote")).json()
        if "does not exist" in str(remote["status"]["health"].get("detail")):
            break
        await asyncio.sleep(0.05)
    assert remote["status"] == {"wanted": 0, "replicas": 0, "ready": 0, "failed": [],
                                "unplaced": None, "placement": None, "health": {
                                    "state": "unplaceable", "reasons": {}, "detail": (
                                        "the key file of external model 'remote' cannot be "
                                        "used: it does not exist")}}
    r = await c.get("/admin/catalog")
    assert r.headers["content-type"] == "application/json"
    assert r.json() == {"models": FULL}
    r = await c.get("/admin/catalog", headers={"Accept": "application/yaml"})
    assert r.headers["content-type"] == "application/yaml"
    assert yaml.safe_load(r.text) == {"models": FULL}


async def test_export_seeds_a_new_store_with_the_same_catalog(tmp_path: Path) -> None:
    app_a, gw_a = await started(settings(tmp_path, "a"))
    try:
        async with client(app_a) as c:
            for name, spec in FULL.items():
                assert (await c.put(f"/admin/models/{name}", json=spec)).status_code == 201
            exported = await c.get("/admin/catalog", headers={"Accept": "application/yaml"})
            first = (await c.get("/admin/catalog")).json()
    finally:
        await gw_a.stop()
    path = tmp_path / "catalog.yaml"
    path.write_text(exported.text)
    app_b, gw_b = await started(settings(tmp_path, "b", catalog_file=path))
    try:
        async with client(app_b) as c:
            assert (await c.get("/admin/catalog")).json() == first
            # Seeded through the catalog's own write path: aliases resolve.
            assert (await c.put("/admin/models/x", json={"model": "w", "aliases": ["gpt"]})
                    ).status_code == 409
    finally:
        await gw_b.stop()


async def test_a_seed_never_overwrites_a_catalog_the_store_has(tmp_path: Path) -> None:
    path = tmp_path / "catalog.json"
    path.write_text(json.dumps({"models": {"m": {"model": "org/m"}}}))
    app, gw = await started(settings(tmp_path, "gw", catalog_file=path))
    try:
        async with client(app) as c:
            assert (await c.put("/admin/models/m", json={"model": "org/m2"})).status_code == 200
            assert (await c.delete("/admin/models/m")).status_code == 204
    finally:
        await gw.stop()
    # Restarted with the file: the store's catalog (now empty) stays as edited.
    app, gw = await started(settings(tmp_path, "gw", catalog_file=path))
    try:
        assert gw.mirror.models() == {}
    finally:
        await gw.stop()


async def test_two_gateways_starting_together_seed_once(
    tmp_path: Path, etcd_server: EtcdServer | ExternalEtcd, etcd_prefix: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    path = tmp_path / "catalog.yaml"
    path.write_text(yaml.safe_dump({"models": {
        "small": {"model": "/models/small.gguf", "engine": "llamacpp", "aliases": ["s"]},
        "remote": {"external": {"url": "http://127.0.0.1:9", "model": "up"}},
    }}))
    shared = {"etcd_endpoints": etcd_server.endpoint, "etcd_prefix": etcd_prefix,
              "catalog_file": path}
    apps = [create_app(settings(tmp_path, name, port=port, **shared))
            for name, port in (("g1", 18101), ("g2", 18102))]
    gateways: list[Gateway] = [a.state.gateway for a in apps]
    caplog.set_level(logging.INFO, logger="app.gateway.assembly")
    await asyncio.gather(*(g.start() for g in gateways))
    try:
        for g in gateways:
            await loaded(g)
            assert sorted(g.mirror.models()) == ["remote", "small"]
        serial = await gateways[0].store.get(s.CATALOG_SERIAL)
        assert serial is not None and serial.create_revision == serial.mod_revision
        small = await gateways[0].store.get(s.MODELS + "small")
        assert small is not None and small.mod_revision == serial.mod_revision
        seeded = [r for r in caplog.records if r.getMessage().startswith("seeded the catalog")]
        skipped = [r for r in caplog.records if "not used" in r.getMessage()]
        assert (len(seeded), len(skipped)) == (1, 1), caplog.text
        # The one that says it seeded is the one the serial names.
        assert seeded[0].getMessage().endswith(f"(gateway {json.loads(serial.value)['by']})")
    finally:
        await asyncio.gather(*(g.stop() for g in gateways))


async def test_an_unreachable_store_defers_the_seed_and_exports_nothing(tmp_path: Path) -> None:
    path = tmp_path / "catalog.yaml"
    path.write_text(yaml.safe_dump({"models": {"m": {"model": "org/m"}}}))
    # Nothing listens on this port: the store never answers.
    app = create_app(settings(tmp_path, "blind", etcd_endpoints="127.0.0.1:9",
                              etcd_timeout=0.3, catalog_file=path))
    gw: Gateway = app.state.gateway
    await gw.start()  # serves meanwhile; the seed is retried in the background
    try:
        assert any(t.get_name() == "catalog-seed" and not t.done() for t in gw.supervisor.spawned)
        async with client(app) as c:
            r = await c.get("/admin/catalog")
            # Not an empty catalog, which saved as a file would seed nothing.
            assert r.status_code == 503 and r.json()["title"] == "State not loaded", r.text
    finally:
        await gw.stop()


def test_a_bad_catalog_file_stops_the_gateway_naming_the_field(tmp_path: Path) -> None:
    path = tmp_path / "catalog.yaml"
    path.write_text(yaml.safe_dump({"models": {
        "a": {"model": "w", "aliases": ["x"]},
        "b": {"model": "w", "aliases": ["x"], "profiles": [{"engine_args": ["--port=1"]}]},
    }}))
    with pytest.raises(ValidationError) as info:
        settings(tmp_path, "gw", catalog_file=path)
    text = str(info.value)
    assert "models.b.profiles.0.engine_args.0: --port is set by llmgw itself" in text
    assert "models.b.aliases.0: 'x' already names model 'a'" in text
    # The CLI says so and exits before opening any store.
    env = {"LLMGW_CATALOG_FILE": str(path), "LLMGW_DATA_DIR": str(tmp_path / "d"),
           "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-m", "app.cli", "serve"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2, out
    assert "invalid setting catalog_file" in out.stderr
    assert "models.b.profiles.0.engine_args.0" in out.stderr
    assert not (tmp_path / "d" / "state.db").exists()


@pytest.mark.parametrize(("data", "says"), [
    ([1, 2], "expected a mapping"),
    ({"models": {"m": {"model": "w"}}, "extra": 1}, "extra: unknown key"),
    ({"models": {"bad name": {"model": "w"}}}, "models.bad name: model name"),
    ({"models": {"m": {"model": "w", "gpus": "many"}}}, "models.m.gpus: Input should be"),
    ({"models": {f"m{i}": {"model": "w"} for i in range(128)}}, "at most 127"),
])
def test_a_catalog_is_parsed_whole_or_not_at_all(data: object, says: str) -> None:
    with pytest.raises(rules.CatalogError, match=says.replace(".", r"\.")):
        rules.parse_catalog(data, ["/models"])


def test_a_file_that_is_not_yaml_is_named(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("models: {m: [")
    with pytest.raises(rules.CatalogError, match="is not valid YAML"):
        catalog.load_file(path, [])
    with pytest.raises(rules.CatalogError, match="cannot read"):
        catalog.load_file(tmp_path / "absent.yaml", [])


# --- old specs, and what the leader places ------------------------------------------


def gpu_node(name: str, gpus: int) -> s.NodeInfo:
    return s.NodeInfo(name=name, gpus=[s.GpuInfo(index=i) for i in range(gpus)],
                      engines=["vllm", "llamacpp"])


def run_plan(models: dict[str, s.StoredModel], nodes: list[s.NodeInfo],
             replicas: dict[str, s.Replica]) -> Any:
    return plan(PlanInput(
            models, {n.name: n for n in nodes}, replicas, now=100.0),
            PlanPolicy(drain_seconds=2.0, new_suffix=lambda: "a1"))


def test_old_stored_specs_and_replicas_load_and_mean_the_same() -> None:
    # Exactly what the previous version wrote for a 2-GPU model and its replica.
    old_model = (b'{"model":"org/m","revision":"v1","aliases":["al"],"engine":"vllm","gpus":2,'
                 b'"replicas":{"min":1,"max":2},"name":"m","created":1700000000.0}')
    old_replica = (b'{"id":"m-a0","model":"m","node":"n1","gpus":[0,1],"engine":"vllm",'
                   b'"weights":"org/m","weights_revision":"v1","draining_since":null}')
    spec = s.StoredModel.model_validate_json(old_model)
    assert [(p.engine, p.gpu_count, p.engine_args) for p in spec.profile_list] == [
        ("vllm", 2, [])]
    assert (spec.replica_range.min, spec.replica_range.max) == (1, 2)
    assert rules.check_spec(spec, ["/models"]) == []
    rep = s.Replica.model_validate_json(old_replica)
    assert run_plan({"m": spec}, [gpu_node("n1", 2)], {rep.id: rep}).empty
    # An old CPU spec: gpus normalised to 0, as that version stored it.
    cpu = s.StoredModel.model_validate_json(
        b'{"model":"org/c","engine":"llamacpp","gpus":0,"replicas":{"min":1,"max":1},'
        b'"aliases":[],"revision":null,"name":"c","created":1.0}')
    assert [(p.engine, p.gpu_count) for p in cpu.profile_list] == [("llamacpp", 0)]
    # And the export of an old spec reads back as the same spec.
    again = rules.parse_catalog(catalog.export({"m": spec}), ["/models"])["m"]
    assert again.profile_list == spec.profile_list and again.replica_range == spec.replica_range


def test_replicas_carry_the_first_profile_and_follow_its_engine_args() -> None:
    spec = s.StoredModel(name="m", model="org/m", profiles=[
        s.Profile(name="big", gpus=2, engine_args=["--max-model-len=8192"]),
        s.Profile(name="small", gpus=1)])
    p = run_plan({"m": spec}, [gpu_node("n1", 2)], {})
    [rep] = p.create
    assert (rep.profile, rep.engine, rep.gpus, rep.engine_args, rep.weights) == (
        "big", "vllm", [0, 1], ["--max-model-len=8192"], "org/m")
    # Unchanged: kept. New engine args: the replica is replaced (drained).
    assert run_plan({"m": spec}, [gpu_node("n1", 2)], {rep.id: rep}).empty
    changed = spec.model_copy(update={"profiles": [
        s.Profile(name="big", gpus=2, engine_args=["--max-model-len=4096"])]})
    assert run_plan({"m": changed}, [gpu_node("n1", 4)], {rep.id: rep}).drain == [rep.id]
    # Turned external: its replicas go, nothing is placed.
    ext = s.StoredModel(name="m", external=s.External(url="https://x.example", model="m"))
    p = run_plan({"m": ext}, [gpu_node("n1", 4)], {rep.id: rep})
    assert (p.drain, p.create, p.unplaced) == ([rep.id], [], {})
