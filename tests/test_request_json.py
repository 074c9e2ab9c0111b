"""A /v1 request body's JSON (app/router/request_read.py, `parse_json`):
the scanner called straight for a UTF-8 body that starts with `{`, and
`json.loads` for anything else. Whatever the path, the value is
`json.loads`'s, and so is the error a client is told."""

from __future__ import annotations

import json

import pytest

from app.router.own_answers import Reply
from app.router.request_read import parse_json

BODIES = [
    b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}',
    b'{"a": 1}  \n\t\r ',
    b' \n{"a": 1}',
    '{"text": "caf\u00e9 \u2603 \U0001f600"}'.encode(),
    b'{"lone": "\\ud800", "pair": "\\ud83d\\ude00", "nul": "\\u0000"}',
    b'{"n": 1e400, "m": -0.0, "big": 123456789012345678901234567890, "f": 1.5}',
    b'{"dup": 1, "dup": 2}',
    '{"a": "\u00e9"}'.encode("utf-16"),
    '{"a": "\u00e9"}'.encode("utf-16-le"),
    '{"a": "\u00e9"}'.encode("utf-32"),
    '{"a": "\u00e9"}'.encode("utf-8-sig"),
    b'{"a": NaN, "b": Infinity}',
]

BAD = [
    b'{"a": 1} x',
    b'{"a": 1}{"b": 2}',
    b'{"a": 1,}',
    b'{"a": "\xff"}',
    b'{"a": "\x01"}',
    b'{"a"',
    b"{",
    b"",
    b"   ",
    b'{"a": 1} \x00',
]


@pytest.mark.parametrize("raw", BODIES)
def test_a_body_reads_as_json_loads_reads_it(raw: bytes) -> None:
    want = json.loads(raw)
    got = parse_json(raw)
    assert json.dumps(got, sort_keys=True) == json.dumps(want, sort_keys=True)
    assert got.keys() == want.keys()


@pytest.mark.parametrize("raw", BAD)
def test_bad_json_is_told_as_json_loads_tells_it(raw: bytes) -> None:
    with pytest.raises(ValueError) as loads_says:
        json.loads(raw)
    with pytest.raises(Reply) as reply:
        parse_json(raw)
    assert reply.value.status == 400
    assert str(loads_says.value) in reply.value.body.decode()


def test_a_body_not_an_object_is_refused() -> None:
    for raw in (b"[1, 2]", b'"text"', b"3", b"null"):
        with pytest.raises(Reply) as reply:
            parse_json(raw)
        assert b"must be a JSON object" in reply.value.body


def test_a_body_nested_too_deeply_is_refused_not_a_500() -> None:
    for raw in (b'{"a": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", b"[" * 100_000):
        with pytest.raises(Reply) as reply:
            parse_json(raw)
        assert reply.value.status == 400, reply.value.body
