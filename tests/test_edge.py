"""Before a client is authenticated
(docs/design/security.md, "Before a client is authenticated"): tokens are
checked before a body is read, bodies are capped, and slow clients are
cut. Raw sockets against a real `llmgw serve`, as a hostile client would."""

from __future__ import annotations

import signal
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from app.control.state import MAX_GPUS, MAX_REPLICAS_REPORTED, MAX_TEXT
from app.wire.tokens import node_token
from tests.support.procs import ADMIN, SECRET, Cluster, GatewayProc, make_key

MB = 1024 * 1024


@pytest.fixture
def gw(solo: Cluster) -> Iterator[GatewayProc]:
    yield solo.gateway("gw-edge", local_agent="false")


def rss_mib(gw: GatewayProc) -> float:
    assert gw.popen is not None
    for line in Path(f"/proc/{gw.popen.pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def _status(answer: bytes) -> int:
    assert answer.startswith(b"HTTP/1.1 "), answer[:100]
    return int(answer.split(b" ", 2)[1])


def send_big(gw: GatewayProc, method: str, path: str, token: str, size: int) -> tuple[int, bool]:
    """Sends headers declaring `size` bytes, waits a moment for an early
    answer, then sends the body (if no answer came). Returns the status and
    whether it came before any of the body was sent."""
    head = (f"{method} {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {size}\r\n"
            + (f"Authorization: Bearer {token}\r\n" if token else "") + "\r\n").encode()
    with socket.create_connection(("127.0.0.1", gw.port), timeout=30) as sock:
        sock.sendall(head)
        sock.settimeout(2)
        try:
            early = sock.recv(65536)
        except TimeoutError:
            early = b""
        if early:
            return _status(early), True
        sock.settimeout(60)
        chunk = b" " * MB
        try:
            for _ in range(size // MB):
                sock.sendall(chunk)
        except OSError:
            pass  # answered and closed while we sent
        return _status(sock.recv(65536)), False


def test_no_body_is_read_before_the_token(gw: GatewayProc) -> None:
    before = rss_mib(gw)
    for path in ("/admin/models/m1", "/agent/v1/nodes/n1/status", "/agent/v1/nodes/n1"):
        status, early = send_big(gw, "PUT", path, "", 100 * MB)
        assert (status, early) == (401, True), path
    # A node's token opens its own node's routes only.
    status, early = send_big(gw, "PUT", "/agent/v1/nodes/n1", node_token(SECRET, "n2"), 100 * MB)
    assert (status, early) == (401, True)
    status, early = send_big(gw, "PUT", "/admin/models/m1", "wrong", 100 * MB)
    assert (status, early) == (401, True)
    grown = rss_mib(gw) - before
    print(f"gateway RSS {before:.0f} MiB before, grew {grown:.1f} MiB over five 100 MB POSTs")
    assert grown < 10, grown


def test_bodies_are_capped_per_route_group(gw: GatewayProc) -> None:
    # Declared over the cap: 413 before the body is read, with the token.
    status, early = send_big(gw, "PUT", "/admin/models/m1", ADMIN, 2 * MB)
    assert (status, early) == (413, True)
    status, early = send_big(gw, "PUT", "/agent/v1/nodes/n1/status", node_token(SECRET, "n1"),
                             2 * MB)
    assert (status, early) == (413, True)

    # Chunked (no length declared): refused once it passes the cap.
    def chunks() -> Iterator[bytes]:
        for _ in range(4):
            yield b" " * MB

    r = httpx.put(gw.url + "/admin/models/m1", content=chunks(), timeout=30,
                  headers={"Authorization": f"Bearer {ADMIN}"})
    assert r.status_code == 413
    assert r.headers["content-type"].startswith("application/problem+json")
    assert r.json()["title"] == "Request body too large"
    # Under the cap, the route answers as ever.
    r = httpx.put(gw.url + "/admin/models/m1", timeout=10, json={"model": "w"},
                  headers={"Authorization": f"Bearer {ADMIN}"})
    assert r.status_code == 201, r.text
    r = httpx.get(gw.url + "/admin/models/m1", timeout=10,
                  headers={"Authorization": f"Bearer {ADMIN}"})
    assert r.status_code == 200 and r.json()["model"] == "w"



def _closed_within(sock: socket.socket, limit: float) -> tuple[float, bytes]:
    """Seconds until the gateway closed `sock` (reading what it sent), at
    most `limit`; raises if still open then."""
    start = time.monotonic()
    got = b""
    sock.settimeout(limit)
    while True:
        data = sock.recv(65536)
        if not data:
            return time.monotonic() - start, got
        got += data


@pytest.fixture
def quick(solo: Cluster) -> Iterator[GatewayProc]:
    """A gateway giving clients 1 s for their headers and between body bytes."""
    yield solo.gateway("gw-quick", local_agent="false", header_timeout="1", body_timeout="1")


def test_slow_headers_are_cut(quick: GatewayProc) -> None:
    # A connection that never sends a byte.
    with socket.create_connection(("127.0.0.1", quick.port)) as sock:
        took, got = _closed_within(sock, 5)
    assert took < 3 and got.startswith(b"HTTP/1.1 408"), (took, got)

    # One byte of headers every 0.2 s: closed about 1 s after it began,
    # though bytes keep coming.
    head = f"GET /admin/models HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {ADMIN}\r\n\r\n"
    with socket.create_connection(("127.0.0.1", quick.port)) as sock:
        took = _trickle(sock, head.encode())
    assert took is not None and took < 3, took

    # The next request on a kept-open connection gets its own second: one
    # whose headers come in parts within it is served, twice; a third that
    # trickles is cut about 1 s after its first byte.
    with socket.create_connection(("127.0.0.1", quick.port)) as sock:
        for _ in range(2):
            sock.sendall(head[:20].encode())
            time.sleep(0.5)
            sock.sendall(head[20:].encode())
            answer = _whole_response(sock)
            assert _status(answer) == 200, answer[:200]
            time.sleep(0.5)
        took = _trickle(sock, head.encode())
    assert took is not None and took < 3, took


def _whole_response(sock: socket.socket) -> bytes:
    """One response, read to its last byte (it may come in several parts)."""
    sock.settimeout(5)
    got = b""
    while b"\r\n\r\n" not in got:
        got += _recv(sock)
    head, _, body = got.partition(b"\r\n\r\n")
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                  if line.lower().startswith(b"content-length:"))
    while len(body) < length:
        body += _recv(sock)
    return got


def _recv(sock: socket.socket) -> bytes:
    data = sock.recv(65536)
    if not data:
        raise ConnectionAbortedError("closed before the response's end")
    return data


def _trickle(sock: socket.socket, data: bytes) -> float | None:
    """Sends `data` a byte every 0.2 s; the seconds until the gateway
    answered or closed, None if it never did."""
    start = time.monotonic()
    for byte in data:
        try:
            sock.sendall(bytes([byte]))
        except OSError:
            return time.monotonic() - start
        sock.settimeout(0.2)
        try:
            sock.recv(65536)  # the 408, or b"" once closed
        except TimeoutError:
            continue
        return time.monotonic() - start
    return None


def test_a_stalled_body_is_cut(quick: GatewayProc) -> None:
    head = (f"PUT /admin/models/m1 HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {ADMIN}\r\n"
            "Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"model\":").encode()
    with socket.create_connection(("127.0.0.1", quick.port)) as sock:
        sock.sendall(head)
        took, got = _closed_within(sock, 5)
    assert took < 3 and got == b"", (took, got)
    # Bytes that keep coming are not a stall, however slowly the body goes.
    body = b'{"model": "w"}' + b" " * 6
    head = (f"PUT /admin/models/m1 HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {ADMIN}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode()
    with socket.create_connection(("127.0.0.1", quick.port)) as sock:
        sock.sendall(head)
        for i in range(0, len(body), 4):
            time.sleep(0.4)
            sock.sendall(body[i:i + 4])
        sock.settimeout(5)
        assert _status(sock.recv(65536)) == 201


@pytest.fixture
def brief(solo: Cluster) -> Iterator[GatewayProc]:
    """A gateway closing kept-open connections after 1 s idle."""
    yield solo.gateway("gw-brief", local_agent="false", keep_alive_timeout="1")


def test_a_request_sent_during_a_pause_is_served(brief: GatewayProc) -> None:
    # A gateway paused (SIGSTOP: a debugger, a frozen VM, a swapped-out host)
    # past the keep-alive timeout, with a request arriving meanwhile on a
    # kept-open connection: on resume, uvloop ran the overdue keep-alive timer
    # before reading the socket, and closed the connection on the request
    # (the client saw a reset, and may not retry a POST). It is served.
    get = b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n"
    with socket.create_connection(("127.0.0.1", brief.port)) as sock:
        sock.sendall(get)
        assert _status(_whole_response(sock)) == 200
        for _ in range(2):  # on one connection, pause after pause
            time.sleep(0.2)  # the gateway has armed its keep-alive timer
            brief.signal(signal.SIGSTOP)
            try:
                time.sleep(0.2)
                sock.sendall(get)
                time.sleep(2.5)  # past the keep-alive timeout
            finally:
                brief.signal(signal.SIGCONT)
            try:
                answer = _whole_response(sock)
            except OSError as exc:
                raise AssertionError(f"request sent during the pause not served: {exc!r}") from exc
            assert _status(answer) == 200, answer[:200]
        # Idle, the connection is still closed after the keep-alive timeout.
        took, got = _closed_within(sock, 5)
    assert took < 3 and got == b"", (took, got)


def test_v1_refusal_before_the_body_closes_the_connection(quick: GatewayProc) -> None:
    head = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 100000000\r\n\r\n")
    with socket.create_connection(("127.0.0.1", quick.port)) as sock:
        sock.sendall(head)
        took, got = _closed_within(sock, 5)
    assert _status(got) == 401 and b"connection: close" in got.lower() and took < 3, (took, got)


def test_hostile_json_is_a_400_not_a_500(gw: GatewayProc) -> None:
    key = make_key(gw)
    chat = gw.url + "/v1/chat/completions"
    auth = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
    deep = b"[" * 100_000
    huge = b'{"model": "m", "max_tokens": ' + b"9" * 5000 + b"}"
    for body in (deep, b'{"model": "m", "x": ' + deep + b"}", huge):
        r = httpx.post(chat, content=body, headers=auth, timeout=10)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["type"] == "invalid_request_error" and err["message"]
        assert set(err) == {"message", "type", "param", "code"}
    admin = {"Authorization": f"Bearer {ADMIN}", "Content-Type": "application/json"}
    for body in (deep, huge):
        r = httpx.put(gw.url + "/admin/models/m1", content=body, headers=admin, timeout=10)
        assert 400 <= r.status_code < 500, r.text
        assert r.headers["content-type"].startswith("application/problem+json")
    assert "Traceback" not in gw.output()


def _loc(r: httpx.Response) -> list[list[object]]:
    assert r.status_code == 422, r.text
    return [e["loc"] for e in r.json()["errors"]]


def test_agent_reports_are_capped_field_by_field(gw: GatewayProc) -> None:
    auth = {"Authorization": f"Bearer {node_token(SECRET, 'n1')}"}
    url = gw.url + "/agent/v1/nodes/n1"
    status = {"id": "m-1", "node": "n1", "phase": "failed", "detail": "x" * 900_000}
    assert _loc(httpx.put(url + "/status", json={"replicas": [status]}, headers=auth,
                          timeout=10)) == [["body", "replicas", 0, "detail"]]
    many = [status | {"detail": ""}] * (MAX_REPLICAS_REPORTED + 1)
    assert _loc(httpx.put(url + "/status", json={"replicas": many}, headers=auth,
                          timeout=10)) == [["body", "replicas"]]
    gpus = [{"index": i, "name": "H100"} for i in range(MAX_GPUS + 1)]
    assert _loc(httpx.put(url, json={"name": "n1", "gpus": gpus}, headers=auth,
                          timeout=10)) == [["body", "gpus"]]
    assert _loc(httpx.put(url, json={"name": "n1", "gpu_discovery": "y" * 100_000},
                          headers=auth, timeout=10)) == [["body", "gpu_discovery"]]
    # Within the caps, the node is taken.
    ok = {"name": "n1", "gpus": gpus[:MAX_GPUS], "gpu_discovery": "y" * MAX_TEXT}
    r = httpx.put(url, json=ok, headers=auth, timeout=10)
    assert r.status_code == 200, r.text
    r = httpx.get(gw.url + "/readyz", timeout=10)
    assert r.json()["store"] == "ok"


def test_forwarded_headers_are_read_for_the_pages_and_no_answer_names_the_server(
        gw: GatewayProc) -> None:
    # uvicorn's X-Forwarded-* rewrite is kept off /v1 (the router reads no
    # client address) but still serves the rest: a redirect behind a local
    # TLS-terminating proxy keeps its scheme. No answer says "server: uvicorn".
    forwarded = {"X-Forwarded-Proto": "https", "X-Forwarded-For": "203.0.113.9"}
    r = httpx.get(gw.url + "/docs/", headers=forwarded, follow_redirects=False)
    assert r.status_code == 307 and r.headers["location"].startswith("https://"), r.headers
    v1 = httpx.post(gw.url + "/v1/chat/completions", json={}, headers={"Authorization": "Bearer x"})
    assert v1.status_code == 401
    for answer in (r, v1, httpx.get(gw.url + "/healthz")):
        assert "server" not in answer.headers, answer.headers
