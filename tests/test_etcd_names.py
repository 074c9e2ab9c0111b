"""etcd members addressed as operators write them: host names (compose's
`etcd1:2379`), IPv4 or `[IPv6]:port`. etcd3aio would hand gRPC an `ipv4:`
target, which refuses a name; the store resolves names itself, again when
every endpoint fails, and refuses a malformed endpoint at start by name."""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path

import httpx
import pytest

from app.store.base import StoreUnavailable
from app.store.etcd.endpoints import EtcdEndpoint, grpc_target, parse_endpoint
from app.store.etcd.store import EtcdStore
from tests.support.etcd import EtcdServer, ExternalEtcd, throwaway_etcd, unready_gateway
from tests.support.procs import Cluster, make_key, put_model, wait_for


@pytest.fixture
def host_name() -> str:
    """This machine's name, which /etc/hosts maps to loopback here."""
    name = socket.gethostname()
    addresses = {info[4][0] for info in socket.getaddrinfo(name, None)}
    assert addresses and all(a.startswith("127.") or a == "::1" for a in addresses), (
        f"{name} resolves to {addresses}: these tests use loopback only")
    return name


def port_of(server: EtcdServer | ExternalEtcd) -> int:
    return int(server.endpoint.rsplit(":", 1)[1])


# -- parsing, at start ------------------------------------------------------------------


@pytest.mark.parametrize("text, expected", [
    ("etcd1:2379", EtcdEndpoint("etcd1", 2379)),
    ("etcd-1.example.com.:2379", EtcdEndpoint("etcd-1.example.com.", 2379)),
    ("llmgw_etcd_1:2379", EtcdEndpoint("llmgw_etcd_1", 2379)),  # compose v1 names
    ("10.0.0.5:2379", EtcdEndpoint("10.0.0.5", 2379)),
    ("[::1]:2379", EtcdEndpoint("::1", 2379)),
    ("[fd00::5]:12379", EtcdEndpoint("fd00::5", 12379)),
    (" http://etcd2:2379/ ", EtcdEndpoint("etcd2", 2379)),  # as etcdctl writes them
    ("https://etcd2:2379", EtcdEndpoint("etcd2", 2379, tls=True)),
    ("HTTPS://[::1]:2379/", EtcdEndpoint("::1", 2379, tls=True)),
])
def test_endpoints_parse(text: str, expected: EtcdEndpoint) -> None:
    assert parse_endpoint(text) == expected
    assert parse_endpoint(str(expected)) == expected  # str() is the canonical form


@pytest.mark.parametrize("text, why", [
    ("etcd1", "no port"),
    ("etcd1:", "port ''"),
    ("etcd1:client", "port 'client'"),
    ("etcd1:70000", "port '70000'"),
    ("::1:2379", "IPv6 address needs brackets"),
    ("[::1]", "needs a port"),
    ("[etcd1]:2379", "not an IPv6 address"),
    ("999.1.1.1:2379", "not an IPv4 address"),
    ("etcd 1:2379", "not a host name"),
    ("unix://etcd1:2379", "unknown scheme"),
])
def test_a_bad_endpoint_is_refused_at_start_by_name(text: str, why: str) -> None:
    with pytest.raises(ValueError) as raised:
        EtcdStore(["127.0.0.1:2379", text], "/llmgw/")
    message = str(raised.value)
    assert message.startswith(f"etcd endpoint {text!r}: ") and why in message, message


def test_the_grpc_target_keeps_ipv4_plain_and_maps_it_beside_ipv6() -> None:
    assert grpc_target([("10.0.0.1", 2379), ("10.0.0.2", 2379), ("10.0.0.1", 2379)]) == (
        "ipv4:10.0.0.1:2379,10.0.0.2:2379")
    assert grpc_target([("::1", 2379)]) == "ipv6:[::1]:2379"
    assert grpc_target([("127.0.0.1", 1), ("::1", 2)]) == "ipv6:[::ffff:127.0.0.1]:1,[::1]:2"


def test_a_gateway_with_a_bad_endpoint_stops_naming_it(tmp_path: Path) -> None:
    cluster = Cluster(tmp_path, "127.0.0.1:2379,etcd1", "/llmgw/")
    try:
        gw = unready_gateway(cluster, "gw-a")
        assert gw.wait(30) != 0
        assert "etcd endpoint 'etcd1': no port" in gw.output()
    finally:
        cluster.close()


# -- reaching etcd by name and by IPv6 ----------------------------------------------------


async def test_the_store_reaches_etcd_by_host_name(
    etcd_server: EtcdServer | ExternalEtcd, etcd_prefix: str, host_name: str
) -> None:
    store = await EtcdStore.open([f"{host_name}:{port_of(etcd_server)}"], etcd_prefix, 2.0)
    try:
        revision = await store.put("k", b"by name")
        got = await store.get("k")
        assert got is not None and (got.value, got.mod_revision) == (b"by name", revision)
        assert store.health().state == "reachable"
    finally:
        await store.close()


async def test_the_store_reaches_etcd_by_ipv6(tmp_path: Path, etcd_prefix: str) -> None:
    with throwaway_etcd(tmp_path, host="::1") as server:
        assert server.endpoint.startswith("[::1]:")
        store = await EtcdStore.open([server.endpoint], etcd_prefix, 2.0)
        try:
            revision = await store.put("k", b"by ipv6")
            got = await store.get("k")
            assert got is not None and (got.value, got.mod_revision) == (b"by ipv6", revision)
        finally:
            await store.close()


async def test_names_are_resolved_again_when_every_endpoint_fails(
    etcd_server: EtcdServer | ExternalEtcd, etcd_prefix: str
) -> None:
    """A recreated container comes back at a new address under its name:
    127.0.0.2 (where this etcd does not listen), then 127.0.0.1."""
    answers = {"etcd-moved": ["127.0.0.2"]}
    looked_up: list[str] = []

    async def resolver(host: str, port: int) -> list[str]:
        looked_up.append(host)
        return answers[host]

    # The watch starts past what is there: the shared etcd may have been
    # compacted by earlier tests, and revision 1 would then be refused.
    direct = await EtcdStore.open([etcd_server.endpoint], prefix=etcd_prefix)
    try:
        start = await direct.put("before", b"") + 1
    finally:
        await direct.close()
    store = EtcdStore([f"etcd-moved:{port_of(etcd_server)}"], etcd_prefix, 1.0,
                      resolver=resolver, resolve_interval=0.0)
    await store.connect()
    try:
        with pytest.raises(StoreUnavailable):
            await store.put("k", b"at the old address")
        assert looked_up == ["etcd-moved"]
        assert store.health().state == "unreachable"
        # A watch tried at the old address too (it reports its own failure).
        watch = store.watch("", start)
        first = asyncio.ensure_future(anext(watch))
        async with asyncio.timeout(5):  # a poll of a plain value: no event to wait on
            while not store.health().reason.startswith("etcd watch: UNAVAILABLE"):  # noqa: ASYNC110
                await asyncio.sleep(0.01)

        answers["etcd-moved"] = ["127.0.0.1"]
        # Only a new lookup leads there: the old address refuses.
        revision = await store.put("k", b"at the new address")
        assert store.health().state == "reachable"
        # The watch carries on at the new address.
        batch = await asyncio.wait_for(first, 10)
        assert [(e.key, e.mod_revision) for e in batch.events] == [("k", revision)]
        # While etcd answers, names are not looked up again.
        lookups = len(looked_up)
        await store.put("k", b"again")
        got = await store.get("k")
        assert got is not None and got.value == b"again"
        assert len(looked_up) == lookups
        await watch.aclose()  # type: ignore[attr-defined]
    finally:
        await store.close()


async def test_a_member_whose_name_does_not_resolve_leaves_the_others_serving(
    etcd_server: EtcdServer | ExternalEtcd, etcd_prefix: str
) -> None:
    async def resolver(host: str, port: int) -> list[str]:
        if host == "etcd-gone":
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return ["127.0.0.1"]

    port = port_of(etcd_server)
    store = EtcdStore([f"etcd-gone:{port}", f"etcd-here:{port}"], etcd_prefix, 1.0,
                      resolver=resolver)
    await store.connect()
    try:
        await store.put("k", b"v")
        assert store.health().state == "reachable"
    finally:
        await store.close()


def test_gateways_on_a_host_named_etcd_become_ready_and_take_writes(
    etcd_server: EtcdServer | ExternalEtcd, etcd_prefix: str, tmp_path: Path, host_name: str
) -> None:
    fleet = Cluster(tmp_path, f"{host_name}:{port_of(etcd_server)}", etcd_prefix)
    try:
        a, b = fleet.gateway("gw-a"), fleet.gateway("gw-b")  # each waits for /readyz 200
        put_model(a, "m", {"model": "acme/m", "gpus": 1})
        make_key(b)
        with b.admin() as admin:
            wait_for(lambda: [m["name"] for m in admin.get("/admin/models").json()] == ["m"],
                     10, "the model on gw-b")
            assert [k["name"] for k in admin.get("/admin/keys").json()] == ["tests"]
        assert httpx.get(a.url + "/readyz", timeout=5).json()["store"] == "ok"
        assert "Traceback" not in a.output() + b.output()
    finally:
        fleet.close()
