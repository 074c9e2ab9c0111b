"""TLS on the gateway's port (docs/design/tls.md): a real all-in-one
gateway serving https with a certificate from a test CA (trustme), reached
by the official `openai` client, `llmgw ctl` and a separate `llmgw agent`,
each verifying it; its in-process agent pins its certificate."""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import ssl
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import trustme
from pydantic import ValidationError

from app.agent.agent import Agent
from app.agent.gateway_client import GatewayClient, GatewayUnreachable
from app.gateway.settings import Settings
from app.tls import client_context, pinned_context
from tests.support.procs import (
    ADMIN,
    FAKE_BIN,
    ROOT,
    Cluster,
    GatewayProc,
    free_port,
    serve_one,
    wait_for,
)
from tests.test_agent_steps import MemoryGateway, config
from tests.test_ctl import ctl, one_line_error


@dataclass
class Pki:
    ca: Path  # the test CA's certificate: what clients trust
    cert: Path  # the gateway's certificate, for 127.0.0.1 and localhost
    key: Path


def issue(ca: trustme.CA, where: Path, name: str) -> tuple[Path, Path]:
    leaf = ca.issue_cert("127.0.0.1", "localhost")
    cert, key = where / f"{name}.pem", where / f"{name}-key.pem"
    cert.write_bytes(b"".join(p.bytes() for p in leaf.cert_chain_pems))
    leaf.private_key_pem.write_to_path(str(key))
    return cert, key


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    where = tmp_path_factory.mktemp("pki")
    ca = trustme.CA()
    ca.cert_pem.write_to_path(str(where / "ca.pem"))
    cert, key = issue(ca, where, "gateway")
    return Pki(where / "ca.pem", cert, key)


@pytest.fixture(scope="module")
def tls_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    c = Cluster(tmp_path_factory.mktemp("tls"), None, "")
    try:
        yield c
    finally:
        c.close()


@pytest.fixture(scope="module")
def gw(tls_cluster: Cluster, pki: Pki) -> GatewayProc:
    """An all-in-one gateway on https with model "m" served. Its process has
    no LLMGW_CA_FILE: its in-process agent gets the replica ready only
    through the pinned certificate."""
    gw = tls_cluster.gateway("gw-tls", ca=str(pki.ca), tls_cert_file=str(pki.cert),
                             tls_key_file=str(pki.key), local_node="gpu-1", local_gpus="1",
                             vllm_bin=str(FAKE_BIN / "vllm"))
    assert gw.url.startswith("https://")
    return gw


@pytest.fixture(scope="module")
def key(gw: GatewayProc) -> str:
    return serve_one(gw).key


def test_the_official_client_gets_a_completion_over_verified_https(
        gw: GatewayProc, key: str, pki: Pki) -> None:
    trusting = httpx.Client(verify=ssl.create_default_context(cafile=str(pki.ca)))
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0, timeout=10,
                           http_client=trusting)
    said = client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "hi"}])
    assert said.choices[0].message.content

    # Without the CA, the same client refuses the gateway.
    strict = openai.OpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0, timeout=10,
                           http_client=httpx.Client())
    with pytest.raises(openai.APIConnectionError):
        strict.models.list()

    # Agents and the cluster page are told the https URL.
    with gw.admin() as admin:
        (info,) = admin.get("/admin/gateways").json()
    assert info["url"] == f"https://127.0.0.1:{gw.port}"


def test_nothing_is_answered_in_clear_on_the_tls_port(gw: GatewayProc, key: str) -> None:
    request = (f"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {key}"
               "\r\nConnection: close\r\n\r\n").encode()
    with socket.create_connection(("127.0.0.1", gw.port), timeout=5) as sock:
        sock.sendall(request)
        got = b""
        while chunk := sock.recv(65536):
            got += chunk
    assert not got.startswith(b"HTTP/"), got[:200]
    assert b'"m"' not in got
    with pytest.raises(httpx.TransportError):
        httpx.get(f"http://127.0.0.1:{gw.port}/healthz", timeout=5)


def test_ctl_verifies_the_gateway_with_llmgw_ca_file(gw: GatewayProc, key: str,
                                                      pki: Pki, tmp_path: Path) -> None:
    done = ctl("models", gateway=gw.url, LLMGW_CA_FILE=str(pki.ca))
    assert done.returncode == 0, done.stderr
    assert "m" in done.stdout.split()

    said = one_line_error(ctl("models", gateway=gw.url))  # the system's CAs only
    assert said.startswith(f"llmgw ctl: cannot reach the gateway at {gw.url}: "
                           "certificate verify failed"), said
    assert "LLMGW_CA_FILE" in said and ADMIN not in said

    said = one_line_error(ctl("models", gateway=gw.url,
                              LLMGW_CA_FILE=str(tmp_path / "missing.pem")))
    assert "LLMGW_CA_FILE" in said and "missing.pem" in said


def test_an_agent_with_llmgw_ca_file_joins_the_https_gateway(
        tls_cluster: Cluster, gw: GatewayProc, pki: Pki) -> None:
    tls_cluster.agent("node-b", [gw], "--gpus", "1", env_extra={"LLMGW_CA_FILE": str(pki.ca)})

    def joined() -> bool:
        with gw.admin() as admin:
            return "node-b" in {n["name"] for n in admin.get("/admin/nodes").json()}

    wait_for(joined, 20, "node-b in /admin/nodes")


async def test_the_agent_client_refuses_a_gateway_its_cas_do_not_vouch_for(
        gw: GatewayProc, pki: Pki) -> None:
    # The system's CAs (no LLMGW_CA_FILE): the test CA is unknown. The
    # default (no context given) is the same: never unverified.
    for client in (GatewayClient([gw.url], "node-c", "token", tls=client_context(None)),
                   GatewayClient([gw.url], "node-c", "token")):
        await client.start()
        try:
            with pytest.raises(GatewayUnreachable,
                               match=r"certificate verify failed.*LLMGW_CA_FILE"):
                await client.heartbeat({})
        finally:
            await client.close()


class FailingGateway(MemoryGateway):
    """Refuses the first three heartbeats, then answers with a short TTL
    (the agent beats again 0.1 s later)."""

    def __init__(self) -> None:
        super().__init__()
        self.beats = 0
        self.fifth = asyncio.Event()

    async def heartbeat(self, inventory: dict[str, Any]) -> dict[str, Any]:
        self.beats += 1
        if self.beats <= 3:
            raise GatewayUnreachable("https://gw: certificate verify failed: test")
        if self.beats == 5:
            self.fifth.set()
        return {"node": inventory["name"], "ttl": 0.3}


async def test_an_agent_logs_a_failure_once_per_streak(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    gateway = FailingGateway()
    agent = Agent(config(tmp_path), client=gateway)
    agent.heartbeat_every = 0.0  # a failed step still waits 1 s before the next
    caplog.set_level(logging.DEBUG, logger="app.agent.agent")
    task = asyncio.create_task(
        agent._every(lambda: agent.heartbeat_every, agent.heartbeat, "heartbeat"))
    try:
        await asyncio.wait_for(gateway.fifth.wait(), 10)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    said = [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "app.agent.agent"]
    failed = "heartbeat failed: https://gw: certificate verify failed: test"
    assert said == [(logging.WARNING, failed), (logging.DEBUG, failed), (logging.DEBUG, failed),
                    (logging.INFO, "heartbeat works again")]


async def test_the_local_agents_pin_trusts_the_gateways_certificate_alone(
        pki: Pki, tmp_path: Path) -> None:
    """pinned_context: the file's leaf verifies with no CA known and under any
    host name; another certificate from the same CA does not, although the
    file (a full chain here) holds that CA too."""
    ca = trustme.CA()
    mine, mine_key = issue(ca, tmp_path, "mine")
    other, other_key = issue(ca, tmp_path, "other")
    full_chain = tmp_path / "full-chain.pem"
    full_chain.write_bytes(mine.read_bytes() + ca.cert_pem.bytes())

    async def handshake(cert: Path, key: Path) -> None:
        server_ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        server_ctx.load_cert_chain(cert, key)
        server = await asyncio.start_server(lambda r, w: w.close(), "127.0.0.1", 0,
                                            ssl=server_ctx)
        port = server.sockets[0].getsockname()[1]
        try:
            _, writer = await asyncio.open_connection(
                "127.0.0.1", port, ssl=pinned_context(full_chain),
                server_hostname="not-the-name")
            writer.close()
        finally:
            server.close()
            await server.wait_closed()

    await handshake(mine, mine_key)
    with pytest.raises(ssl.SSLCertVerificationError):
        await handshake(other, other_key)


def test_serve_with_a_certificate_and_no_key_stops_in_one_line(pki: Pki,
                                                               tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLMGW_")}
    env |= {"LLMGW_TLS_CERT_FILE": str(pki.cert), "LLMGW_PORT": str(free_port()),
            "LLMGW_DATA_DIR": str(tmp_path)}
    done = subprocess.run([sys.executable, "-m", "app.cli", "serve"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=30)
    assert done.returncode == 2, (done.stdout, done.stderr)
    (line,) = done.stderr.strip().splitlines()
    assert "LLMGW_TLS_CERT_FILE and LLMGW_TLS_KEY_FILE go together" in line


@pytest.mark.parametrize("which, says", [
    ("missing", "No such file"), ("swapped", "cannot serve TLS"),
    ("mismatched", "cannot serve TLS")])
def test_a_bad_certificate_or_key_is_refused_at_start(
        pki: Pki, tmp_path: Path, which: str, says: str) -> None:
    cert, key = pki.cert, pki.key
    if which == "missing":
        key = tmp_path / "missing.pem"
    elif which == "swapped":
        cert, key = key, cert
    else:
        _, key = issue(trustme.CA(), tmp_path, "stranger")
    with pytest.raises(ValidationError, match=says):
        Settings(data_dir=tmp_path, tls_cert_file=cert, tls_key_file=key)


def test_tls_makes_the_default_public_url_https(pki: Pki, tmp_path: Path) -> None:
    on = Settings(data_dir=tmp_path, port=8443, tls_cert_file=pki.cert, tls_key_file=pki.key)
    assert on.public_url == "https://127.0.0.1:8443"
    assert Settings(data_dir=tmp_path, port=8080).public_url == "http://127.0.0.1:8080"
