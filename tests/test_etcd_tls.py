"""TLS from gateways to etcd (docs/design/tls.md): a real etcd
serving its clients over https with --client-cert-auth, certificates from a
test CA (trustme); the store and a real `llmgw serve` reach it with a CA and
a client certificate, and every way of getting it wrong is said as such."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import trustme

from app.store.base import StoreUnavailable
from app.store.etcd.store import EtcdStore
from app.store.etcd.tls import EtcdTls, load
from tests.support.etcd import EtcdServer, EtcdTlsFiles, free_port, throwaway_etcd, unready_gateway
from tests.support.procs import ROOT, Cluster, wait_for


def issue(ca: trustme.CA, root: Path, *names: str) -> tuple[Path, Path]:
    cert = ca.issue_cert(*names)
    stem = names[0].replace(".", "_")
    cert.cert_chain_pems[0].write_to_path(root / f"{stem}.pem")
    cert.private_key_pem.write_to_path(root / f"{stem}.key")
    return root / f"{stem}.pem", root / f"{stem}.key"


class Pki:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.ca = trustme.CA()
        self.ca_file = root / "ca.pem"
        self.ca.cert_pem.write_to_path(self.ca_file)
        self.client_cert, self.client_key = issue(self.ca, root, "llmgw-gateway")

    def etcd_files(self, *names: str) -> EtcdTlsFiles:
        cert, key = issue(self.ca, self.root, *names)
        return EtcdTlsFiles(self.ca_file, cert, key, self.client_cert, self.client_key)

    def tls(self, client: bool = True) -> EtcdTls:
        return load(self.ca_file, self.client_cert if client else None,
                    self.client_key if client else None)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return Pki(tmp_path_factory.mktemp("etcd-pki"))


@pytest.fixture(scope="module")
def tls_etcd(pki: Pki, tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdServer]:
    """One etcd for the module, its certificate for 127.0.0.1 and localhost."""
    with throwaway_etcd(tmp_path_factory.mktemp("etcd-tls"),
                        tls=pki.etcd_files("127.0.0.1", "localhost")) as server:
        yield server


async def refused(store: EtcdStore) -> str:
    """The reason the store gives, after a call that must fail."""
    await store.connect()
    try:
        with pytest.raises(StoreUnavailable):
            await store.put("k", b"v")
        health = store.health()
        assert health.state == "unreachable"
        return health.reason
    finally:
        await store.close()


async def test_a_store_with_the_ca_and_a_client_certificate_reads_writes_and_watches(
        tls_etcd: EtcdServer, pki: Pki) -> None:
    assert tls_etcd.endpoint.startswith("https://127.0.0.1:")
    store = await EtcdStore.open([tls_etcd.endpoint], "/tls-a/", 3.0, tls=pki.tls())
    try:
        start = await store.put("a", b"1") + 1
        got = await store.get("a")
        assert got is not None and got.value == b"1"
        watch = store.watch("", start)
        first = asyncio.ensure_future(anext(watch))
        revision = await store.put("b", b"2")
        batch = await asyncio.wait_for(first, 10)
        assert [(e.key, e.mod_revision) for e in batch.events] == [("b", revision)]
        assert store.health().state == "reachable"
        await watch.aclose()  # type: ignore[attr-defined]
    finally:
        await store.close()


async def test_without_a_client_certificate_etcd_is_unreachable_and_says_why(
        tls_etcd: EtcdServer, pki: Pki) -> None:
    reason = await refused(EtcdStore([tls_etcd.endpoint], "/tls-b/", 2.0,
                                     tls=pki.tls(client=False)))
    assert reason.startswith("TLS: etcd ended the TLS connection: it may want a client "
                             "certificate"), reason


async def test_a_ca_that_did_not_sign_etcds_certificate_is_refused(
        tls_etcd: EtcdServer, pki: Pki, tmp_path: Path) -> None:
    stranger = tmp_path / "stranger-ca.pem"
    trustme.CA().cert_pem.write_to_path(stranger)
    tls = load(stranger, pki.client_cert, pki.client_key)
    reason = await refused(EtcdStore([tls_etcd.endpoint], "/tls-c/", 2.0, tls=tls))
    assert "certificate did not verify against LLMGW_ETCD_CA_FILE" in reason, reason
    assert "CERTIFICATE_VERIFY_FAILED" in reason, reason


async def test_the_certificate_is_checked_against_the_name_written_not_the_address(
        pki: Pki, tmp_path: Path) -> None:
    """etcd's certificate names only etcd.example. Dialled as 127.0.0.1 it
    fails; dialled as etcd.example (resolved by us to 127.0.0.1) it passes."""

    async def resolver(host: str, port: int) -> list[str]:
        assert host == "etcd.example"
        return ["127.0.0.1"]

    with throwaway_etcd(tmp_path, tls=pki.etcd_files("etcd.example")) as etcd:
        reason = await refused(EtcdStore([etcd.endpoint], "/tls-d/", 2.0, tls=pki.tls()))
        assert "certificate does not name the host" in reason, reason
        by_name = f"https://etcd.example:{etcd.client_port}"
        store = EtcdStore([by_name], "/tls-d/", 3.0, tls=pki.tls(), resolver=resolver)
        await store.connect()
        try:
            await store.put("k", b"by name")
            got = await store.get("k")
            assert got is not None and got.value == b"by name"
        finally:
            await store.close()


async def test_localhost_by_name_passes_with_a_certificate_for_localhost(
        tls_etcd: EtcdServer, pki: Pki) -> None:
    store = await EtcdStore.open([f"https://localhost:{tls_etcd.client_port}"], "/tls-d/",
                                 3.0, tls=pki.tls())
    try:
        assert await store.put("k", b"v") > 0
    finally:
        await store.close()


async def test_each_host_gets_its_own_verified_channel_and_a_failed_one_hands_over(
        tls_etcd: EtcdServer, pki: Pki) -> None:
    """One name-check per gRPC channel: two hosts, two channels. The first
    (nothing listens there) fails two calls at once; the next call goes to
    the second, verified as localhost (moved once, not once per failure)."""

    async def resolver(host: str, port: int) -> list[str]:
        return ["127.0.0.1"]

    gone = f"https://gone.example:{free_port()}"
    here = f"https://localhost:{tls_etcd.client_port}"
    store = EtcdStore([gone, here], "/tls-f/", 2.0, tls=pki.tls(), resolver=resolver,
                      resolve_interval=0.0)
    await store.connect()
    try:
        failures = await asyncio.gather(store.put("k", b"1"), store.get("k"),
                                        return_exceptions=True)
        assert [type(f) for f in failures] == [StoreUnavailable, StoreUnavailable], failures
        assert await store.put("k", b"v") > 0
        assert store.health().state == "reachable"
        channel = store._connection.channel
        assert channel is not None
        assert channel.target.startswith("gone.example=ipv4:127.0.0.1:")
        assert f"; localhost=ipv4:127.0.0.1:{tls_etcd.client_port}" in channel.target
    finally:
        await store.close()


def test_tls_files_with_plain_endpoints_and_mixed_schemes_are_refused() -> None:
    with pytest.raises(ValueError, match="are not https://"):
        EtcdStore(["127.0.0.1:2379"], "/x/", tls=EtcdTls())
    with pytest.raises(ValueError, match="mix https:// and plain"):
        EtcdStore(["https://127.0.0.1:2379", "127.0.0.2:2379"], "/x/")


def test_a_gateway_reaches_etcd_over_tls_and_one_without_its_certificate_says_why(
        tls_etcd: EtcdServer, pki: Pki, tmp_path: Path) -> None:
    cluster = Cluster(tmp_path, tls_etcd.endpoint, "/tls-e/")
    try:
        gw = cluster.gateway("gw-tls", etcd_ca_file=str(pki.ca_file),
                             etcd_cert_file=str(pki.client_cert),
                             etcd_key_file=str(pki.client_key))
        with gw.admin() as admin:
            r = admin.put("/admin/models/m", json={"model": "w"})
            assert r.status_code in (200, 201), r.text
            r = admin.get("/admin/models")
            assert r.status_code == 200, r.text
            assert "m" in {m["name"] for m in r.json()}
        # No client certificate: not ready, saying why; never a 500.
        bare = unready_gateway(cluster, "gw-bare", etcd_ca_file=str(pki.ca_file))
        ready = wait_for(lambda: _unready(bare.url), 20, "gw-bare to say why it is not ready")
        assert ready.status_code == 503
        assert ready.json()["store"].startswith(
            "unreachable: TLS: etcd ended the TLS connection"), ready.text
        assert "Traceback" not in bare.output()
    finally:
        cluster.close()


def _unready(url: str) -> httpx.Response | None:
    try:
        r = httpx.get(url + "/readyz", timeout=1)
    except httpx.TransportError:
        return None
    return r if str(r.json().get("store")).startswith("unreachable") else None


@pytest.mark.parametrize("settings, says", [
    ({"LLMGW_ETCD_CERT_FILE": "CERT"},
     "LLMGW_ETCD_CERT_FILE and LLMGW_ETCD_KEY_FILE go together"),
    ({"LLMGW_ETCD_CA_FILE": "MISSING"}, "LLMGW_ETCD_CA_FILE MISSING: No such file"),
    ({"LLMGW_ETCD_CERT_FILE": "CERT", "LLMGW_ETCD_KEY_FILE": "CA"},
     "cannot use a client certificate for etcd"),
    ({"LLMGW_ETCD_ENDPOINTS": "https://127.0.0.1:2379,http://127.0.0.2:2379"},
     "mix https:// and plain"),
    ({"LLMGW_ETCD_ENDPOINTS": "127.0.0.1:2379", "LLMGW_ETCD_CA_FILE": "CA"},
     "are for https:// etcd endpoints"),
])
def test_serve_with_bad_etcd_tls_settings_stops_in_one_line(
        pki: Pki, tmp_path: Path, settings: dict[str, str], says: str) -> None:
    files = {"CERT": str(pki.client_cert), "CA": str(pki.ca_file),
             "MISSING": str(tmp_path / "missing.pem")}
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLMGW_")}
    env |= {"LLMGW_PORT": str(free_port()), "LLMGW_DATA_DIR": str(tmp_path),
            "LLMGW_SECRET": "s" * 32, "LLMGW_ADMIN_TOKEN": "a" * 32,
            "LLMGW_ETCD_ENDPOINTS": "https://127.0.0.1:2379"}
    env |= {k: files.get(v, v) for k, v in settings.items()}
    says = says.replace("MISSING", files["MISSING"])
    done = subprocess.run([sys.executable, "-m", "app.cli", "serve"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=30)
    assert done.returncode == 2, (done.stdout, done.stderr)
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith("llmgw: invalid setting") and says in line, line
