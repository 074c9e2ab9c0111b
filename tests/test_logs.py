"""Log lines in-process (app/logs.py, app/router/access.py): both formats,
the request id on every line about a request, the access line and its cost
when off. Through real processes: tests/test_operator_seat.py."""

from __future__ import annotations

import asyncio
import io
import json
import logging
import socket
import time
from collections.abc import Iterator
from urllib.parse import quote

import pytest
import uvicorn

from app import logs
from app.gateway.http1 import protocol
from app.logs import handler, request_id
from tests.support.procs import wait_for
from tests.support.proxy_rig import MESSAGES, Rig


@pytest.fixture
def captured() -> Iterator[tuple[io.StringIO, io.StringIO]]:
    """What the root logger writes in text and in JSON, INFO and up."""
    text, js = io.StringIO(), io.StringIO()
    root = logging.getLogger()
    handlers = [handler("text", text), handler("json", js)]
    level = root.level
    root.setLevel(logging.INFO)
    for h in handlers:
        root.addHandler(h)
    try:
        yield text, js
    finally:
        for h in handlers:
            root.removeHandler(h)
        root.setLevel(level)


def _records(js: io.StringIO) -> list[dict[str, object]]:
    return [json.loads(line) for line in js.getvalue().splitlines()]


def test_both_formats_carry_the_fields_the_request_id_and_the_traceback(
        captured: tuple[io.StringIO, io.StringIO]) -> None:
    text, js = captured
    log = logging.getLogger("tests.logs")
    token = request_id.set("req-42")
    try:
        log.info("served %s", "it", extra={"key_id": "k1", "tokens": 7, "note": "two words"})
        try:
            raise ValueError("boom")
        except ValueError:
            log.exception("failed")
    finally:
        request_id.reset(token)
    log.warning("no request here")
    first, failed, alone = [line for line in text.getvalue().splitlines()
                            if " tests.logs: " in line]
    assert first.endswith("INFO tests.logs: served it request_id=req-42 key_id=k1 tokens=7 "
                          'note="two words"')
    assert failed.endswith("ERROR tests.logs: failed request_id=req-42")
    assert "Traceback" in text.getvalue() and "ValueError: boom" in text.getvalue()
    assert alone.endswith("WARNING tests.logs: no request here")

    served, boom, plain = _records(js)
    assert served["message"] == "served it" and served["level"] == "INFO"
    assert served["logger"] == "tests.logs" and str(served["time"]).endswith("Z")
    assert (served["request_id"], served["key_id"], served["tokens"]) == ("req-42", "k1", 7)
    assert "ValueError: boom" in str(boom["exc_info"]) and boom["request_id"] == "req-42"
    assert "request_id" not in plain


async def test_a_requests_own_lines_and_its_access_line_carry_its_id(
        rig: Rig, captured: tuple[io.StringIO, io.StringIO]) -> None:
    _, js = captured
    bad, good = await rig.upstream("a", "503"), await rig.upstream("b")
    rig.route("small", ("a", bad.url), ("b", good.url))
    r = await rig.http.post("/v1/chat/completions", headers={
        "Authorization": "Bearer sk-client-key-0123456789", "X-Request-Id": "retry-me"},
        json={"model": "small", "messages": MESSAGES})  # hashes to "a", tried first
    assert r.status_code == 200 and r.headers["x-request-id"] == "retry-me"
    assert len(bad.seen) == 1  # retried on b, the same id sent to both
    for up in (bad, good):
        sent = {k.lower(): v for k, v in up.seen[0][0].items()}
        assert sent["x-request-id"] == "retry-me"
    lines = _records(js)
    retried = [x for x in lines if "trying another" in str(x["message"])]
    assert retried and retried[0]["request_id"] == "retry-me"
    (access,) = [x for x in lines if x["logger"] == "app.access"]
    assert access["request_id"] == "retry-me" and access["replica"] == "b"
    assert access["key_id"] == "k1" and access["model"] == "small" and access["status"] == 200


async def test_no_access_record_is_made_while_its_logger_is_off(rig: Rig) -> None:
    up = await rig.upstream("a")
    rig.route("small", ("a", up.url))
    made: list[str] = []
    factory = logging.getLogRecordFactory()

    def counting(*args: object, **kwargs: object) -> logging.LogRecord:
        record = factory(*args, **kwargs)
        made.append(record.name)
        return record

    access = logging.getLogger("app.access")
    logging.setLogRecordFactory(counting)
    try:
        access.setLevel(logging.WARNING)
        assert (await rig.chat("small")).status_code == 200
        assert "app.access" not in made
        access.setLevel(logging.INFO)
        assert (await rig.chat("small")).status_code == 200
        assert made.count("app.access") == 1
    finally:
        logging.setLogRecordFactory(factory)
        access.setLevel(logging.NOTSET)


# What a client would like the log to show after its own request's line.
FORGED = "2030-01-01 00:00:00,000 INFO app.access: GET /v1/models 200 request_id=forged"


async def test_a_path_cannot_forge_a_line_in_either_format(
        rig: Rig, captured: tuple[io.StringIO, io.StringIO]) -> None:
    """`GET /v1/models%0a<a line>` with no key, through uvicorn as `llmgw
    serve` runs it (httptools, the slow-client protocol): uvicorn decodes the
    path, control characters and all, and the access line prints it."""
    text, js = captured
    # Each kind of line end (\n, \r, NEL, U+2028), a terminal escape, a tab.
    tail = "\n" + FORGED + "\r" + FORGED + "\x85\u2028\x1b[2J\tend"
    target = "/v1/models" + quote(tail, safe="/:,")
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(
        rig.proxy, log_config=None, access_log=False, lifespan="off",
        http=protocol(30.0, 30.0)))
    serving = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        while not server.started:  # noqa: ASYNC110 (a flag uvicorn sets, no event)
            await asyncio.sleep(0.01)
        reader, writer = await asyncio.open_connection(*sock.getsockname())
        writer.write(f"GET {target} HTTP/1.1\r\nHost: gw\r\nConnection: close\r\n\r\n".encode())
        answer = await asyncio.wait_for(reader.read(), 10)
        writer.close()
    finally:
        server.should_exit = True
        await serving
    assert answer.startswith(b"HTTP/1.1 401 "), answer[:80]

    lines = text.getvalue().split("\n")
    assert not [x for x in lines if x.startswith(FORGED[:10])], "a forged line was written"
    (access,) = [x for x in lines if " app.access: " in x]
    # Every character as it came, the unprintable ones escaped as in a
    # Python string: readable, and nothing of it starts a line.
    assert (f"INFO app.access: GET /v1/models\\n{FORGED}\\r{FORGED}\\x85\\u2028\\x1b[2J\\tend 401 "
            "request_id=") in access, access
    assert all(x.isprintable() for x in lines), [x for x in lines if not x.isprintable()]

    # JSON: one valid object a line, however the log is cut into lines
    # (at \n, or at every line end Python knows), the path as it came.
    for cut in (js.getvalue().split("\n")[:-1], js.getvalue().splitlines()):
        records = [json.loads(x) for x in cut]
        (record,) = [x for x in records if x["logger"] == "app.access"]
        assert record["message"] == f"GET /v1/models{tail} 401"


def test_a_field_cannot_forge_a_line(captured: tuple[io.StringIO, io.StringIO]) -> None:
    """A field's value (the access line's model, replica...) is quoted as
    JSON when it holds a space or anything unprintable."""
    text, js = captured
    value = "small\rERROR\x1b[2J\u2028"  # no space in it
    logging.getLogger("tests.logs").info("said", extra={"model": value, "plain": "a-b"})
    (line,) = text.getvalue().split("\n")[:-1]
    assert line.endswith(' said model="small\\rERROR\\u001b[2J\\u2028" plain=a-b'), line
    (record,) = _records(js)
    assert record["model"] == value


class Writes(io.StringIO):
    """A stream that counts its write calls."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def write(self, s: str) -> int:
        self.calls += 1
        return super().write(s)


@pytest.fixture
def root_restored() -> Iterator[None]:
    """The root logger's handlers and level as they were, whatever a test
    configured, and the writer thread stopped."""
    root = logging.getLogger()
    saved, level = list(root.handlers), root.level
    try:
        yield
    finally:
        logs.stop()
        for h in list(root.handlers):
            root.removeHandler(h)
        for h in saved:
            root.addHandler(h)
        root.setLevel(level)


@pytest.mark.usefixtures("root_restored")
def test_lines_logged_together_leave_in_one_write_and_none_is_lost_at_stop() -> None:
    """The writer thread takes what is queued in batches: a line costs the
    event loop no wake of another thread (a queue nobody waits on is put to
    without a system call), and a burst leaves in one write. `stop()`
    writes what is still queued."""
    out = Writes()
    logs.configure("info", "text", stream=out, every=0.2)
    burst = logging.getLogger("app.burst")
    for i in range(100):
        burst.info("line %d", i)
    time.sleep(0.5)  # the writer's batch
    assert out.getvalue().count("app.burst: line ") == 100, out.getvalue()[-300:]
    assert out.calls <= 2, out.calls  # one write (two if a wake fell in the burst)
    burst.info("the last")
    logs.stop()
    assert out.getvalue().endswith("app.burst: the last\n"), out.getvalue()[-200:]
    burst.info("after the stop")  # written at once, on this thread
    assert out.getvalue().endswith("app.burst: after the stop\n")


@pytest.mark.usefixtures("root_restored")
def test_an_idle_writer_sleeps_until_a_line_comes() -> None:
    """The writer thread wakes for a line, not on a clock: an idle gateway
    spends nothing on it (it woke every 50 ms, 1.5 ms of CPU a second)."""
    out = Writes()
    logs.configure("info", "text", stream=out, every=0.01)
    writer = logs._writer
    assert writer is not None
    time.sleep(0.3)  # thirty of its batches' length, nothing logged
    assert writer.wakes == 0 and out.calls == 0
    logging.getLogger("app.idle").info("one line")
    wait_for(lambda: out.getvalue().endswith("app.idle: one line\n"), 5, "the line written")
    time.sleep(0.3)
    assert writer.wakes == 1 and out.calls == 1
