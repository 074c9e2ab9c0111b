"""A gateway's stop (docs/design/stopping.md), seen by its clients:
SIGTERM makes /readyz say 503 at once while requests are still served for
the notice period; open streams then run to their end; the lead passes on
at the signal; what outlives the grace period is cut with an error event; a
second signal stops at once. Clients here talk to the gateway directly (the
balancer in front is tests/test_haproxy_stop.py)."""

from __future__ import annotations

import array
import datetime
import email.utils
import fcntl
import os
import select
import signal
import subprocess
import termios
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
from pydantic import ValidationError

from app.gateway.settings import Settings
from tests.support.procs import Cluster, GatewayProc, make_key, put_model, routes, wait_for

# Seconds the stand-in engine takes per word: a reply of n words takes n x this.
TOKEN_DELAY = 0.25


def words(n: int) -> str:
    return " ".join(f"w{i}" for i in range(n))


class Streams:
    """Streams read to their end in threads; each one's text or error."""

    def __init__(self, gw: GatewayProc, key: str, count: int, length: int) -> None:
        self.results: dict[int, str | BaseException] = {}
        self._client = openai.OpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0)
        self._threads = [threading.Thread(target=self._one, args=(i, length), daemon=True)
                         for i in range(count)]
        for t in self._threads:
            t.start()

    def _one(self, i: int, length: int) -> None:
        try:
            text = "".join(c.choices[0].delta.content or "" for c in
                           self._client.chat.completions.create(
                               model="m", stream=True,
                               messages=[{"role": "user", "content": f"s{i} {words(length)}"}])
                           if c.choices)
            self.results[i] = text
        except Exception as exc:  # what the client saw is the result
            self.results[i] = exc

    def join(self, timeout: float) -> dict[int, str | BaseException]:
        for t in self._threads:
            t.join(timeout)
        assert len(self.results) == len(self._threads), "streams still running"
        return self.results


@pytest.fixture
def fleet(cluster: Cluster) -> tuple[Cluster, str]:
    """One slow engine (a word per TOKEN_DELAY) behind the cluster's gateways."""
    gw = cluster.gateway("gw-a", shutdown_notice_seconds="2")
    cluster.gateway("gw-b")
    wait_for(lambda: gw.leader()["leader"] == "gw-a", 10, "gw-a leading")
    cluster.agent("node-1", cluster.procs[:2], "--gpus", "1",  # type: ignore[arg-type]
                  env_extra={"FAKE_VLLM_TOKEN_DELAY": str(TOKEN_DELAY)})
    key = make_key(gw)
    put_model(gw, "m", {"model": "acme/m", "gpus": 1})
    wait_for(lambda: routes(gw, key, "m"), 30, "gw-a routing")
    return cluster, key


def test_a_stopping_gateway_serves_on_then_lets_its_streams_end(
    fleet: tuple[Cluster, str],
) -> None:
    cluster, key = fleet
    gw, other = cluster.procs[0], cluster.procs[1]
    assert isinstance(gw, GatewayProc) and isinstance(other, GatewayProc)
    streams = Streams(gw, key, count=3, length=30)  # ~8 s each: past uvicorn's old 5 s
    # A balancer's check on a kept connection, as haproxy's are: its next
    # request arrives within a millisecond of the signal.
    check = httpx.Client(base_url=gw.url, timeout=2)
    assert check.get("/readyz").status_code == 200
    time.sleep(1.0)
    gw.signal(signal.SIGTERM)
    signalled = time.monotonic()
    # At once: balancers' checks see it going, while it still answers.
    ready = check.get("/readyz")
    assert ready.status_code == 503 and ready.json()["status"] == "stopping", ready.text
    check.close()
    # A request a balancer sends before it noticed is still served.
    plain = httpx.post(gw.url + "/v1/chat/completions", timeout=10,
                       headers={"Authorization": f"Bearer {key}"},
                       json={"model": "m", "messages": [{"role": "user", "content": "late"}]})
    assert plain.status_code == 200, plain.text
    # The lead passes on at the signal, not when the streams are done.
    wait_for(lambda: other.leader()["is_leader"], 6, "gw-b leading")
    assert gw.popen is not None and gw.popen.poll() is None, "gw-a gone before its streams"
    results = streams.join(30)
    for i, text in results.items():
        assert isinstance(text, str) and text.endswith(f"s{i} {words(30)}"), (i, text)
    gw.wait(10)
    assert time.monotonic() - signalled > 2.0  # the notice period was served


def test_the_grace_period_ends_in_an_error_event_and_a_second_signal_stops_at_once(
    fleet: tuple[Cluster, str],
) -> None:
    cluster, key = fleet
    short = cluster.gateway("gw-c", shutdown_notice_seconds="0.5",
                            shutdown_grace_seconds="1")
    wait_for(lambda: routes(short, key, "m"), 30, "gw-c routing")
    streams = Streams(short, key, count=1, length=40)  # ~10 s: cut after ~1.5 s
    time.sleep(1.0)
    short.signal(signal.SIGTERM)
    (cut,) = streams.join(15).values()
    # Not a closed connection: an error event, which the SDK raises.
    assert isinstance(cut, openai.APIError) and not isinstance(cut, openai.APIConnectionError), (
        repr(cut))
    assert "stopped before the answer was complete" in cut.message, cut.message
    assert short.wait(10) is not None

    patient = cluster.gateway("gw-d", shutdown_notice_seconds="30")
    wait_for(lambda: routes(patient, key, "m"), 30, "gw-d routing")
    long = Streams(patient, key, count=1, length=40)
    time.sleep(1.0)
    patient.signal(signal.SIGTERM)
    time.sleep(0.5)
    patient.signal(signal.SIGTERM)  # an operator who will not wait
    try:
        patient.wait(3)
    except subprocess.TimeoutExpired:
        pytest.fail("a second SIGTERM did not stop the gateway at once")
    long.join(5)


def test_the_grace_period_is_at_most_the_request_timeout(tmp_path: Path) -> None:
    with pytest.raises(ValidationError, match=r"LLMGW_SHUTDOWN_GRACE_SECONDS \(601.0 s\) must "
                                              r"not exceed LLMGW_REQUEST_TIMEOUT \(600.0 s\)"):
        Settings(data_dir=tmp_path, shutdown_grace_seconds=601)
    Settings(data_dir=tmp_path, shutdown_grace_seconds=600)
    Settings(data_dir=tmp_path, shutdown_grace_seconds=30, request_timeout=30,
             drain_seconds=60)


def test_a_stop_writes_every_queued_log_line_before_the_process_ends(solo: Cluster) -> None:
    """Lines are written by a thread (app/logs.py), and uvicorn ends a stop
    by raising the caught SIGTERM again: the process then dies at once, so
    whatever was still queued had to be written before that. Here the log
    is a pipe of one page that nobody reads until the process has stopped,
    so the writer is stuck at the signal with the stop's lines queued
    behind it: the last of them must still come out (CI once lost them on
    a busy machine: "gateway ... stopped" missing after a clean stop)."""
    fifo = solo.tmp / "gw-pipe.log"
    os.mkfifo(fifo)
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    try:
        fcntl.fcntl(reader, fcntl.F_SETPIPE_SZ, 4096)
        gw = solo.gateway("gw-pipe", local_agent="false", shutdown_notice_seconds="0")

        def queued() -> int:
            n = array.array("i", [0])
            fcntl.ioctl(reader, termios.FIONREAD, n)
            return n[0]

        seen: list[tuple[float, int]] = []

        def fill() -> bool:
            """Requests (a refused one is a log line) until the pipe has not
            taken a byte for half a second: its writer is stuck on it."""
            httpx.get(gw.url + "/v1/models", headers={"Authorization": "Bearer no"})
            now, n = time.monotonic(), queued()
            if not seen or seen[-1][1] != n:
                seen.append((now, n))
            return n > 0 and now - seen[-1][0] > 0.5
        wait_for(fill, 20, "the log pipe full", 0)
        gw.signal(signal.SIGTERM)
        time.sleep(2.0)  # stopped (no notice period), its last lines queued
        out = bytearray()
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            ready, _, _ = select.select([reader], [], [], 0.5)
            chunk = os.read(reader, 65536) if ready else b""
            if ready and not chunk:
                break  # every writer gone: the process has ended
            out += chunk
        code = gw.wait(10)
    finally:
        os.close(reader)
    text = out.decode(errors="replace")
    assert code in (0, -signal.SIGTERM), code
    assert "gateway gw-pipe stopped" in text, text[-1500:]


def test_a_signal_is_heard_at_once_and_the_date_header_steps_each_second(solo: Cluster) -> None:
    """uvicorn's server looks at a signal's stop every 0.1 s, a wake of the
    loop ten times a second; `llmgw serve`'s ticks once a second (the Date
    header's step) and the signal wakes it (app/cli.py)."""
    gw = solo.gateway("gw-tick", local_agent="false", shutdown_notice_seconds="0")

    def date() -> str:
        r = httpx.get(gw.url + "/healthz")
        assert r.status_code == 200
        return r.headers["date"]

    first = date()
    time.sleep(2.2)
    second = date()
    stamps = [email.utils.parsedate_to_datetime(d).timestamp() for d in (first, second)]
    assert stamps[1] - stamps[0] >= 2 and abs(stamps[1] - time.time()) <= 2, (first, second)
    # Just after a tick (the header changed), so that the next is most of a
    # second away: without the wake, the stop waited for it.
    wait_for(lambda: date() != second, 3, "a tick", 0.01)
    time.sleep(0.3)
    sent = time.time()
    gw.signal(signal.SIGTERM)
    line = next(ln for ln in gw.logged("stopping: open requests have").splitlines()
                if "stopping: open requests have" in ln)
    # The text format's time: local, to the millisecond.
    heard = datetime.datetime.strptime(" ".join(line.split()[:2]),
                                       "%Y-%m-%d %H:%M:%S,%f").timestamp()
    assert heard - sent < 0.2, line
    assert gw.wait(30) in (0, -signal.SIGTERM)
