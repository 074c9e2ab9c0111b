"""compose/haproxy.cfg in front of three gateways while they stop, die and
restart one after another, under steady load: plain requests of about 1 s
and streams of a few seconds through the balancer, and streams straight to
a gateway. What runs is the shipped file with only its addresses changed,
and a third `server` line cloned from the second (compose runs two
gateways); its check timings are used as shipped (`inter 1s fall 2 rise 2`),
which the gateways' default LLMGW_SHUTDOWN_NOTICE_SECONDS (3 s) covers."""

from __future__ import annotations

import re
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.support.procs import (
    Cluster,
    GatewayProc,
    free_port,
    routes,
    wait_for,
)
from tests.test_haproxy import haproxy_bin as haproxy_bin
from tests.test_haproxy import running_haproxy, shipped_config, slow_m_behind

# Seconds per word of the stand-in engine's replies: "fake-vllm m echo: p1"
# takes 1 s; a stream's reply of 30 words, 7.5 s: longer than the 5 s the
# gateway used to give open requests on SIGTERM.
TOKEN_DELAY = 0.25
STREAM_WORDS = " ".join(f"w{i}" for i in range(26))


def three_gateway_config(port: int, gateways: list[int]) -> str:
    text = shipped_config(port, gateways[:2])
    line = re.search(r"^\s*server gateway2 .*$", text, re.M)
    assert line is not None, "compose/haproxy.cfg no longer has a gateway2 server line"
    third = line.group(0).replace("gateway2", "gateway3").replace(
        f"127.0.0.1:{gateways[1]}", f"127.0.0.1:{gateways[2]}")
    return text.replace(line.group(0), line.group(0) + "\n" + third)


class Rig:
    def __init__(self, cluster: Cluster, url: str, key: str, log: Path) -> None:
        self.cluster, self.url, self.key, self.log = cluster, url, key, log

    @property
    def gateways(self) -> list[GatewayProc]:
        return [p for p in self.cluster.procs if isinstance(p, GatewayProc)]

    def server_of(self, tag: str) -> str:
        """The haproxy server that last served the request tagged `tag`."""
        # haproxy writes a request's line once the answer is sent: its client
        # may have read it before (a rehearsal found no line for the last one).
        found = wait_for(lambda: re.findall(rf"gateways/(\S+) .*\?i={tag} HTTP",
                                            self.log.read_text()),
                         5, f"haproxy's log line for {tag}")
        return str(found[-1])

    def whole(self) -> None:
        """Every server up in haproxy's view: none said down since it started."""
        down = [ln for ln in self.log.read_text().splitlines() if " is DOWN" in ln]
        assert not down, down

    def servers(self, tags: list[str]) -> tuple[set[str], list[str]]:
        """The servers haproxy logged for `tags`, and the tags it logged no
        line for within 5 s (a CI rehearsal found one request of dozens
        unlogged, its answer a 200 to its client)."""
        def logged() -> dict[str, str]:
            found = re.findall(r"gateways/(\S+) .*\?i=(\w+) HTTP", self.log.read_text())
            return {tag: server for server, tag in found}
        deadline = time.monotonic() + 5
        lines = logged()
        while not set(tags) <= set(lines) and time.monotonic() < deadline:
            time.sleep(0.2)
            lines = logged()
        return {lines[t] for t in tags if t in lines}, [t for t in tags if t not in lines]


@pytest.fixture
def rig(cluster: Cluster, haproxy_bin: str) -> Iterator[Rig]:
    gws = [cluster.gateway(f"gw-{i}") for i in (1, 2, 3)]
    key = slow_m_behind(cluster, gws, TOKEN_DELAY, 40)
    port = free_port()
    with running_haproxy(haproxy_bin, cluster.tmp,
                         three_gateway_config(port, [g.port for g in gws]), port) as (url, log):
        time.sleep(2.5)  # every server's checks passed (rise 2, 1 s apart)
        yield Rig(cluster, url, key, log)


class Load:
    """Clients in threads, each sending one kind of request after another
    until stopped; every outcome kept, tagged (`?i=` in the URL, so that
    haproxy's log says which gateway served it)."""

    def __init__(self, base: str, key: str) -> None:
        # No SDK retries: every resend here is the balancer's.
        self._client = openai.OpenAI(base_url=base + "/v1", api_key=key, max_retries=0,
                                     timeout=60)
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        self._n = 0
        self.ok: list[str] = []
        self.failed: dict[str, str] = {}

    def _tag(self, kind: str) -> str:
        with self._lock:
            self._n += 1
            return f"{kind}{self._n}"

    def one(self, stream: bool) -> None:
        tag = self._tag("s" if stream else "p")
        try:
            if stream:
                text = "".join(c.choices[0].delta.content or "" for c in
                               self._client.chat.completions.create(
                                   model="m", stream=True, extra_query={"i": tag},
                                   messages=[{"role": "user",
                                              "content": f"{tag} {STREAM_WORDS}"}])
                               if c.choices)
                assert text.endswith(f"{tag} {STREAM_WORDS}"), text
            else:
                chat = self._client.chat.completions.create(
                    model="m", extra_query={"i": tag},
                    messages=[{"role": "user", "content": tag}])
                assert (chat.choices[0].message.content or "").endswith(tag)
            with self._lock:
                self.ok.append(tag)
        except Exception as exc:  # what the client saw is the outcome
            with self._lock:
                self.failed[tag] = repr(exc)

    def run(self, plain: int, streams: int, once: bool = False) -> None:
        """`plain` and `streams` clients; `once`: one request each."""
        def loop(stream: bool) -> None:
            while not self._stop.is_set():
                self.one(stream)
                if once:
                    return
        # Streams first: leastconn spreads them over the servers before the
        # plain requests come, so that each gateway relays some.
        for stream, count in ((True, streams), (False, plain)):
            for _ in range(count):
                t = threading.Thread(target=loop, args=(stream,), daemon=True)
                t.start()
                self._threads.append(t)

    def finish(self, timeout: float = 40) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout)
        assert not any(t.is_alive() for t in self._threads), "clients still running"


def test_a_gateway_stopped_with_sigterm_loses_no_request(rig: Rig) -> None:
    victim = rig.gateways[0]
    load = Load(rig.url, rig.key)
    direct = Load(victim.url, rig.key)  # clients that know the gateway itself
    load.run(plain=4, streams=4)
    direct.run(plain=0, streams=3, once=True)
    time.sleep(1.5)
    victim.signal(signal.SIGTERM)
    victim.wait(30)
    time.sleep(1.0)
    load.finish()
    direct.finish()
    assert load.failed == {} and direct.failed == {}, (load.failed, direct.failed)
    assert len(direct.ok) == 3
    served, unlogged = rig.servers(load.ok)
    assert served == {"gateway1", "gateway2", "gateway3"}, served
    assert len(unlogged) <= 1, f"haproxy logged no line for {unlogged} of {len(load.ok)}"


def test_a_gateway_killed_loses_no_plain_request(rig: Rig) -> None:
    victim = rig.gateways[1]
    load = Load(rig.url, rig.key)
    load.run(plain=9, streams=6)  # leastconn: two streams and three plain each
    time.sleep(2.0)
    # Killed while it relays streams (each 7.5 s long), with every server up
    # in haproxy's view: a CI rehearsal's kill cut nothing, and the test
    # said only ({}, {}).
    rig.whole()
    victim.signal(signal.SIGKILL)
    time.sleep(4.0)  # haproxy marks it down (fall 2)
    load.finish()
    plain_failed = {t: e for t, e in load.failed.items() if t.startswith("p")}
    assert plain_failed == {}, plain_failed
    cut = {t: rig.server_of(t) for t in load.failed}
    assert cut and set(cut.values()) == {"gateway2"}, (cut, load.failed,
                                                      rig.log.read_text()[-2000:])
    assert len(load.ok) >= 20, load.ok


def test_a_rolling_restart_loses_no_request(rig: Rig) -> None:
    load = Load(rig.url, rig.key)
    load.run(plain=3, streams=3)
    for gw in rig.gateways:
        time.sleep(1.0)
        gw.signal(signal.SIGTERM)
        gw.wait(30)
        gw.start()
        wait_for(lambda g=gw: httpx.get(g.url + "/readyz", timeout=1).status_code == 200,
                 20, f"{gw.name} ready again")
        wait_for(lambda g=gw: routes(g, rig.key, "m"), 20, f"{gw.name} routing again")
        time.sleep(2.5)  # haproxy's checks see it up (rise 2, 1 s apart)
    load.finish()
    assert load.failed == {}, load.failed
    assert len(load.ok) >= 20, load.ok
