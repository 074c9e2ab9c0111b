"""A catalog write held up by a paused gateway (SIGSTOP) is not applied when
it resumes (SIGCONT), after its client gave up and a newer edit was made on
another gateway (docs/design/admin-writes.md, "Catalog writes"): real gateway
processes on the shared etcd, the write sent on a raw socket.

The pause is deterministic: the request says `Expect: 100-continue`, so the
gateway answers "100 Continue" only once its handler asks for the body,
after it stamped the request's arrival; it is stopped then, and the body
goes into the kernel's buffer while it is."""

from __future__ import annotations

import json
import signal
import socket
import time

from tests.support.procs import ADMIN, Cluster, GatewayProc, until, wait_for

SPEC = {"model": "acme/m", "gpus": 1, "replicas": {"min": 0, "max": 0}}


def begin_put(gw: GatewayProc, name: str, spec: dict[str, object],
              headers: dict[str, str]) -> tuple[socket.socket, bytes]:
    """A PUT whose headers the gateway's handler has taken (it asked for the
    body: 100 Continue); the socket and the body still to send."""
    body = json.dumps(spec).encode()
    head = "".join(f"{k}: {v}\r\n" for k, v in {
        "Host": "gw", "Authorization": f"Bearer {ADMIN}", "Content-Type": "application/json",
        "Content-Length": str(len(body)), "Expect": "100-continue", **headers}.items())
    sock = socket.create_connection(("127.0.0.1", gw.port), timeout=10)
    sock.sendall(f"PUT /admin/models/{name} HTTP/1.1\r\n{head}\r\n".encode())
    got = sock.recv(4096)
    assert got.startswith(b"HTTP/1.1 100"), got
    return sock, body


def answer(sock: socket.socket) -> tuple[int, dict[str, object]]:
    data = b""
    sock.settimeout(20)
    while b"\r\n\r\n" not in data or not data.rstrip().endswith(b"}"):
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)


def gpus(gw: GatewayProc, name: str) -> int:
    with gw.admin() as admin:
        r = admin.get(f"/admin/models/{name}")
        assert r.status_code == 200, r.text
        return int(r.json()["gpus"])


def put(gw: GatewayProc, name: str, spec: dict[str, object]) -> None:
    with gw.admin() as admin:
        r = admin.put(f"/admin/models/{name}", json=spec)
        assert r.status_code in (200, 201), r.text


def paused_write(paused: GatewayProc, other: GatewayProc, headers: dict[str, str],
                 pause: float) -> tuple[int, dict[str, object]]:
    """gpus: 4 sent to `paused`, stopped before it reads the body; gpus: 2 put
    (and acknowledged) on `other`; `paused` resumed after `pause` seconds."""
    put(other, "m", SPEC)
    wait_for(lambda: gpus(paused, "m") == 1, 10, "the first spec on both gateways")
    sock, body = begin_put(paused, "m", SPEC | {"gpus": 4}, headers)
    paused.signal(signal.SIGSTOP)
    try:
        sock.sendall(body)  # into the stopped gateway's socket buffer
        stopped_at = time.monotonic()
        put(other, "m", SPEC | {"gpus": 2})  # the newer edit, acknowledged
        time.sleep(max(0.0, pause - (time.monotonic() - stopped_at)))
    finally:
        paused.signal(signal.SIGCONT)
    try:
        return answer(sock)
    finally:
        sock.close()


async def test_a_write_held_by_a_paused_gateway_past_its_deadline_is_not_applied(
        cluster: Cluster) -> None:
    a = cluster.gateway("gw-a")
    b = cluster.gateway("gw-b", admin_write_deadline="2")

    # The client's deadline (ctl's: now + its timeout) passes while gw-a is stopped.
    status, problem = paused_write(
        a, b, {"X-Request-Deadline": f"{time.time() + 1.0:.3f}"}, pause=2.0)
    assert status == 408, problem
    assert "X-Request-Deadline" in str(problem["detail"]), problem
    await until(lambda: gpus(a, "m") == 2, "the newer edit on gw-a")
    assert gpus(b, "m") == 2

    # No deadline from the client: gw-b's own bound (2 s after the request
    # arrived, by its monotonic clock, which ran on while it was stopped).
    status, problem = paused_write(b, a, {}, pause=3.0)
    assert status == 408, problem
    assert "LLMGW_ADMIN_WRITE_DEADLINE" in str(problem["detail"]), problem
    await until(lambda: gpus(b, "m") == 2, "the newer edit on gw-b")
    assert gpus(a, "m") == 2
