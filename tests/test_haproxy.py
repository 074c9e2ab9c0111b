"""compose/haproxy.cfg in front of two real gateways: a client keeps being
answered, streams included, when one gateway dies."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.support.procs import (
    ROOT,
    Cluster,
    free_port,
    make_key,
    put_model,
    routes,
    wait_for,
)

# The file compose/docker-compose.yml mounts into its balancer (checked by
# tests/test_compose.py), run here in front of real gateways.
SHIPPED_CONFIG = ROOT / "compose" / "haproxy.cfg"


@pytest.fixture
def haproxy_bin() -> str:
    found = shutil.which("haproxy") or ("/usr/sbin/haproxy"
                                         if Path("/usr/sbin/haproxy").exists() else None)
    if found is None:
        msg = "haproxy is not installed (apt-get install haproxy; scripts/install-test.sh does)"
        if os.environ.get("CI") == "true":
            pytest.fail(msg)
        pytest.skip(msg)
    return found


def shipped_config(port: int, gateways: list[int]) -> str:
    """compose/haproxy.cfg with loopback addresses instead of compose's names,
    and a log of every answer on stderr."""
    text = SHIPPED_CONFIG.read_text()
    text = text.replace("bind :8080", f"bind 127.0.0.1:{port}")
    text = text.replace("global\n", "global\n  log stderr format raw local0\n", 1)
    text = text.replace("defaults\n", "defaults\n  log global\n  option httplog\n", 1)
    for i, gw_port in enumerate(gateways, start=1):
        text, n = re.subn(rf"gateway{i}:8080", f"127.0.0.1:{gw_port}", text)
        assert n == 1, f"compose/haproxy.cfg no longer names gateway{i}:8080"
    return text


@pytest.fixture
def balanced(cluster: Cluster, haproxy_bin: str) -> Iterator[tuple[Cluster, str, str, Path]]:
    gws = [cluster.gateway("gw-a"), cluster.gateway("gw-b")]
    cluster.agent("node-1", gws, "--gpus", "1")
    key = make_key(gws[0])
    put_model(gws[0], "m", {"model": "acme/m", "aliases": ["chat"], "gpus": 1})
    for gw in gws:
        wait_for(lambda g=gw: routes(g, key, "m"), 30, f"{gw.name} routing")
    port = free_port()
    with running_haproxy(haproxy_bin, cluster.tmp,
                         shipped_config(port, [g.port for g in gws]), port) as (url, log):
        yield cluster, url, key, log


@contextlib.contextmanager
def running_haproxy(haproxy_bin: str, tmp: Path, config: str,
                    port: int) -> Iterator[tuple[str, Path]]:
    """haproxy on `config` (listening on `port`), logging to tmp/haproxy.log,
    until it answers /readyz through a backend: its URL and its log."""
    cfg = tmp / "haproxy.cfg"
    cfg.write_text(config)
    log = tmp / "haproxy.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([haproxy_bin, "-db", "-f", str(cfg)],
                                stdout=out, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_for(lambda: httpx.get(url + "/readyz", timeout=1).status_code == 200, 10,
                 "haproxy up")
        yield url, log
    finally:
        proc.kill()
        proc.wait(5)


def answers(log: Path) -> list[int]:
    """The status of every answer haproxy logged."""
    return [int(m) for m in re.findall(r"\] llmgw \S+ \S+ (\d{3}) ", log.read_text())]


def test_clients_are_answered_through_a_gateway_dying(
    balanced: tuple[Cluster, str, str, Path],
) -> None:
    cluster, url, key, log = balanced
    # The SDK's default retries: they resend a request whose idle kept-alive
    # connection was closed under it (see compose/haproxy.cfg). Any answer
    # haproxy gave is in its log, checked below: no error may hide there.
    client = openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=2)

    def ask(i: int) -> None:
        chat = client.chat.completions.create(
            model="chat", messages=[{"role": "user", "content": f"through the lb {i}"}])
        assert f"through the lb {i}" in (chat.choices[0].message.content or "")
        text = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
            model="chat", stream=True,
            messages=[{"role": "user", "content": f"streamed {i}"}]) if c.choices)
        assert f"streamed {i}" in text

    for i in range(4):
        ask(i)
    dead = cluster.procs[0]
    assert dead.name == "gw-a"
    dead.signal(signal.SIGKILL)
    for i in range(4, 12):
        ask(i)  # refused connections are redispatched to the live gateway
    statuses = answers(log)
    assert len(statuses) >= 24 and set(statuses) == {200}, statuses
