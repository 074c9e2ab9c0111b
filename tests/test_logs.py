"""Log lines in-process (app/logs.py, app/router/access.py): both formats,
the request id on every line about a request, the access line and its cost
when off. Through real processes: tests/test_operator_seat.py."""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Iterator

import pytest

from app.logs import handler, request_id
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
