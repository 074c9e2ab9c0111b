"""compose/haproxy.cfg in front of two real gateways: a client keeps being
answered, streams included, when one gateway dies."""

from __future__ import annotations

import contextlib
import os
import re
import selectors
import shutil
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.support.procs import (
    ROOT,
    Cluster,
    GatewayProc,
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


# The cfg's own knobs (compose runs their defaults: 30 s, as the gateways'
# LLMGW_HEADER_TIMEOUT and LLMGW_BODY_TIMEOUT, and 1,000 connections a
# source), shortened here so that the test takes seconds.
REQUEST_TIMEOUT = 2.0
PER_SOURCE = 20
SLOW_SOURCE, TRICKLE_SOURCE = "127.0.0.2", "127.0.0.3"  # the normal client: 127.0.0.1
# Seconds per word of the stand-in engine's replies: a stream of STREAM
# words outlasts the request timeout.
TOKEN_DELAY = 0.25
STREAM = " ".join(f"w{i}" for i in range(12))


class Slow:
    """Connections from `source` that each send part of a request, then
    nothing (or a body's byte now and then, `trickle`): when each was
    closed, and what it was answered."""

    def __init__(self, port: int, source: str, n: int, head: bytes,
                 trickle: float = 0.0) -> None:
        self.started = time.monotonic()
        self.closed: dict[int, float] = {}  # index: seconds after the start
        self.answers: dict[int, bytes] = {}
        self._socks: list[socket.socket] = []
        for i in range(n):
            s = socket.socket()
            s.bind((source, 0))
            s.connect(("127.0.0.1", port))
            self._socks.append(s)
            self.answers[i] = b""
            self._send(i, head)
        self._trickle = trickle
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()

    def _send(self, i: int, data: bytes) -> None:
        try:
            self._socks[i].sendall(data)
        except OSError:  # already closed by the balancer: seen by _watch
            pass

    def _watch(self) -> None:
        last_byte = time.monotonic()
        with selectors.DefaultSelector() as sel:
            for i, s in enumerate(self._socks):
                sel.register(s, selectors.EVENT_READ, i)
            while len(self.closed) < len(self._socks):
                if time.monotonic() - self.started > REQUEST_TIMEOUT + 20:
                    return  # the test's assertions say what stayed open
                for key, _ in sel.select(0.05):
                    i = key.data
                    try:
                        data = self._socks[i].recv(4096)
                    except OSError:
                        data = b""
                    self.answers[i] += data
                    if not data:
                        self.closed[i] = time.monotonic() - self.started
                        sel.unregister(self._socks[i])
                if self._trickle and time.monotonic() - last_byte >= self._trickle:
                    last_byte = time.monotonic()
                    for i in range(len(self._socks)):
                        if i not in self.closed:
                            self._send(i, b"x")

    def closed_within(self, seconds: float) -> list[int]:
        return sorted(i for i, t in self.closed.items() if t <= seconds)

    def done(self) -> None:
        self._thread.join(REQUEST_TIMEOUT + 25)
        for s in self._socks:
            s.close()


def slow_m_behind(cluster: Cluster, gws: list[GatewayProc], token_delay: float,
                  timeout: float) -> str:
    """Model m on one agent's GPU, the stand-in `token_delay` s a word,
    behind `gws`; returns a key once every one of them routes it."""
    cluster.agent("node-1", gws, "--gpus", "1",
                  env_extra={"FAKE_VLLM_TOKEN_DELAY": str(token_delay)})
    key = make_key(gws[0])
    put_model(gws[0], "m", {"model": "acme/m", "gpus": 1})
    for gw in gws:
        wait_for(lambda g=gw: routes(g, key, "m"), timeout, f"{gw.name} routing")
    return key


@pytest.fixture
def guarded(cluster: Cluster, haproxy_bin: str,
            monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[str, str, int, Path]]:
    gws = [cluster.gateway("gw-a"), cluster.gateway("gw-b")]
    key = slow_m_behind(cluster, gws, TOKEN_DELAY, 30)
    monkeypatch.setenv("LLMGW_LB_REQUEST_TIMEOUT", f"{REQUEST_TIMEOUT:g}s")
    monkeypatch.setenv("LLMGW_LB_CONNS_PER_SOURCE", str(PER_SOURCE))
    port = free_port()
    with running_haproxy(haproxy_bin, cluster.tmp,
                         shipped_config(port, [g.port for g in gws]), port) as (url, log):
        yield url, key, port, log


def test_slow_clients_are_cut_and_one_source_held_to_its_share(
    guarded: tuple[str, str, int, Path],
) -> None:
    """Slowloris through the balancer: one source's connections past its
    limit are closed at once, the rest get a 408 at the request timeout, as
    does a body trickled byte by byte (haproxy buffers the whole request, so
    no gateway saw it to refuse it for its missing key); meanwhile a client
    from another address is answered, a stream longer than that timeout
    included."""
    url, key, port, log = guarded
    slow = Slow(port, SLOW_SOURCE, PER_SOURCE + 10,
                b"POST /v1/chat/completions HTTP/1.1\r\nHost: lb\r\n")
    trickled = Slow(port, TRICKLE_SOURCE, 1,
                    b"POST /v1/chat/completions HTTP/1.1\r\nHost: lb\r\n"
                    b"Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{",
                    trickle=0.2)
    client = openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=30)
    chat = client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "beside the slow ones"}])
    assert "beside the slow ones" in (chat.choices[0].message.content or "")
    began = time.monotonic()
    text = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model="m", stream=True, messages=[{"role": "user", "content": STREAM}]) if c.choices)
    assert text.endswith(STREAM) and time.monotonic() - began > REQUEST_TIMEOUT + 0.5, text
    slow.done()
    trickled.done()

    # The 10 past the limit: closed at once, unanswered.
    refused = slow.closed_within(REQUEST_TIMEOUT / 2)
    assert len(refused) == 10 and all(slow.answers[i] == b"" for i in refused), (
        f"{len(refused)} of the {PER_SOURCE + 10} connections of one source were closed at "
        f"once (limit {PER_SOURCE}); closed: {slow.closed}")
    # The others: a 408 at the request timeout.
    held = sorted(set(range(PER_SOURCE + 10)) - set(refused))
    assert all(REQUEST_TIMEOUT - 0.2 <= slow.closed.get(i, 1e9) <= REQUEST_TIMEOUT + 2
               for i in held), slow.closed
    assert all(slow.answers[i].startswith(b"HTTP/1.1 408 ") for i in held), slow.answers
    assert REQUEST_TIMEOUT - 0.2 <= trickled.closed.get(0, 1e9) <= REQUEST_TIMEOUT + 2, (
        trickled.closed)
    assert trickled.answers[0].startswith(b"HTTP/1.1 408 "), trickled.answers
    # haproxy answered each 408 itself: no gateway had any of them.
    cut = re.findall(r"llmgw llmgw/<NOSRV> \S+ 408 ", log.read_text())
    assert len(cut) == PER_SOURCE + 1, log.read_text()[-2000:]
