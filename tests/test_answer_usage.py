"""A whole answer's usage read without decoding the answer
(app/router/usage/answer_usage.py): always the top-level `usage` a full decode
finds, whatever else the answer holds."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest

from app.router.usage import answer_usage as au
from app.router.usage.answer_usage import answer_usage

USAGE = {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10,
         "prompt_tokens_details": None}


def _answer(**tail: Any) -> dict[str, Any]:
    return {"id": "chatcmpl-1", "object": "chat.completion", "model": "m",
            "choices": [{"index": 0, "message": {"role": "assistant",
                                                 "content": "hi " * 400}}],
            "usage": USAGE, **tail}


def test_openai_and_vllm_answers_are_read_from_their_tail() -> None:
    # OpenAI ends with usage; vLLM adds null members after it.
    for doc in (_answer(), _answer(prompt_logprobs=None, kv_transfer_params=None)):
        body = json.dumps(doc).encode()
        assert au._tail_usage(body) == (True, USAGE)
        assert answer_usage(body) == USAGE
        assert au._tail_usage(json.dumps(doc, indent=2).encode()) == (True, USAGE)


@pytest.mark.parametrize("doc", [
    # A nested usage last: not the answer's; the whole decode finds the top one.
    _answer(extra={"usage": {"prompt_tokens": 99}}),
    {"data": [{"usage": {"prompt_tokens": 99}}], "usage": USAGE, "x": [{"usage": 1}]},
    # "usage" as a value, and inside strings, escaped or not.
    {"usage": USAGE, "object": "usage"},
    {"usage": USAGE, "content": 'say "usage": {"prompt_tokens": 99}}'},
    {"usage": USAGE, '"usage': {"prompt_tokens": 99}},
])
def test_what_is_not_provably_top_level_falls_back_to_the_whole_decode(
        doc: dict[str, Any]) -> None:
    body = json.dumps(doc).encode()
    found, usage = au._tail_usage(body)
    assert not found or usage == USAGE
    assert answer_usage(body) == USAGE


@pytest.mark.parametrize("body, want", [
    (b'{"data": [{"usage": {"prompt_tokens": 99}}]}', None),  # nested only: none
    (b'{"usage": {"prompt_tokens": 1}', None),  # cut short
    (b'{"usage": {"prompt_tokens": 1}},}', None),  # trailing junk
    (b'{"usage": {"prompt_tokens": 1}, }', None),
    (b'[{"usage": {"prompt_tokens": 1}}]', None),  # not an object
    (b'\xff{"usage": 1}', None),
    (b'', None),
    (b'{"usage": null}', None),
    (b'{"a": 1, "usage" : {"prompt_tokens": 1} }', {"prompt_tokens": 1}),
    # Malformed before the member: not checked (the engine's usage counts).
    (b'{"a": ]]' + b" " * 40 + b', "usage": {"prompt_tokens": 1}}', {"prompt_tokens": 1}),
])
def test_odd_bodies(body: bytes, want: Any) -> None:
    assert answer_usage(body) == want


def _value(rng: random.Random, depth: int) -> Any:
    kind = rng.randrange(7 if depth < 3 else 4)
    if kind == 0:
        return rng.choice([None, True, 1, -2.5, 'a "usage": {}', "usage", "\\"])
    if kind in (1, 2, 3):
        return rng.choice(["x", 'he said "usage"', "{", "}", ",", ""])
    if kind in (4, 5):
        return _obj(rng, depth + 1)
    return [_value(rng, depth + 1) for _ in range(rng.randrange(3))]


def _obj(rng: random.Random, depth: int) -> dict[str, Any]:
    keys = ["usage", "model", "a", '"usage', "usage\\", "choices"]
    return {rng.choice(keys): _value(rng, depth) for _ in range(rng.randrange(4))}


@pytest.mark.parametrize("seed", range(4))
def test_random_answers_agree_with_the_whole_decode(seed: int) -> None:
    rng = random.Random(seed)
    fast = 0
    for _ in range(3000):
        doc = _obj(rng, 0)
        if rng.random() < 0.5:
            doc["usage"] = {"prompt_tokens": rng.randrange(100)}
        body = json.dumps(doc, indent=rng.choice([None, 1])).encode()
        want = doc.get("usage")
        assert answer_usage(body) == want, body
        found, usage = au._tail_usage(body)
        if found:
            fast += 1
            assert usage == want, body
    assert fast > 300  # the fast path is taken, not only the fallback
