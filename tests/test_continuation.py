"""A stream that survives its engine, in-process: the proxy over two vLLM
stand-ins (tests/fakes/fake_vllm.py run as aiohttp apps on loopback), the
first told to drop its streams mid-way; the official `openai` client reads
through the ASGI app. What only real processes show (a SIGKILLed engine, an
agent's replicas) is in tests/test_continuation_procs.py.
docs/design/stream-continuation.md."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import openai
import pytest
from aiohttp.test_utils import TestServer

from app.router.continuation import Splice, resumable
from app.router.published import Endpoint
from app.router.timeouts import Timeouts
from tests.fakes import fake_vllm
from tests.fakes.fake_vllm import FakeVLLM, parse_args
from tests.support.proxy_rig import CLIENT_KEY, AsgiCall, Rig, started

ASKED = "one two three four five six seven"
WHOLE = f"fake-vllm small echo: {ASKED}"  # the stand-in's answer, 10 words
MESSAGES = [{"role": "user", "content": ASKED}]


class Engine:
    """A vLLM stand-in serving "small" on a loopback port."""

    def __init__(self, die_after: int = 0, token_delay: float = 0.0) -> None:
        fake_vllm._import_aiohttp()  # the stand-in imports aiohttp once its argv is good
        self.fake = FakeVLLM(parse_args(["serve", "org/small", "--served-model-name",
                                         "small"]))
        self.fake.die_after = die_after
        self.fake.token_delay = token_delay
        self.server = TestServer(self.fake.make_app(), host="127.0.0.1",
                                 handler_cancellation=True)

    @property
    def url(self) -> str:
        return str(self.server.make_url("")).rstrip("/")

    @property
    def words(self) -> int:
        """Words this engine generated."""
        return self.fake.stats.generation_tokens


@contextlib.asynccontextmanager
async def engines(rig: Rig, *specs: Engine | str) -> AsyncIterator[list[Engine]]:
    """Starts the stand-ins and routes "small" to them, in order (replica
    ids a, b, ...; the first listed is tried first); a string is an
    in-process `Upstream` of that mode instead (tests/support/proxy_rig.py)."""
    eps: list[Endpoint] = []
    started_: list[Engine] = []
    for rid, spec in zip("abc", specs, strict=False):
        if isinstance(spec, str):
            up = await rig.upstream(rid, spec)
            eps.append(Endpoint(rid, up.url, f"engine-key-{rid}", engine="vllm"))
            continue
        await spec.server.start_server()
        started_.append(spec)
        eps.append(Endpoint(rid, spec.url, f"engine-key-{rid}", engine="vllm"))
    rig.table.set_endpoints({"small": eps})
    try:
        yield started_
    finally:
        for e in started_:
            await e.server.close()


def sdk(rig: Rig) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(
        base_url="http://gateway/v1", api_key=CLIENT_KEY, max_retries=0,
        http_client=httpx.AsyncClient(transport=httpx.ASGITransport(app=rig.proxy)))


async def read_chat(client: openai.AsyncOpenAI, **extra: Any) -> tuple[str, list[Any]]:
    stream = await client.chat.completions.create(
        model="small", messages=MESSAGES, stream=True, **extra)  # type: ignore[call-overload]
    chunks = [c async for c in stream]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    return text, chunks


# --- end to end, in-process ---------------------------------------------------------


async def test_a_chat_stream_whose_engine_dies_is_continued_on_another_replica(
        rig: Rig) -> None:
    async with engines(rig, Engine(die_after=4), Engine()) as (a, b):
        async with sdk(rig) as client:
            text, chunks = await read_chat(client, stream_options={"include_usage": True})
            assert text == WHOLE  # every word once, in order
            assert rig.attempts == [a.url + "/v1/chat/completions",
                                    b.url + "/v1/chat/completions"]
            assert 1 <= a.words <= 4 and b.words + 4 >= 10  # a died; b made the rest
            # One stream: one id, one role chunk, the usage both parts' sum.
            assert len({(c.id, c.created, c.model) for c in chunks}) == 1
            assert [c.choices[0].delta.role for c in chunks if c.choices].count(
                "assistant") == 1
            assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
            usage = chunks[-1].usage
            # The same request unbroken (a is cooling down: b serves it).
            whole, unbroken = await read_chat(client, stream_options={"include_usage": True})
        assert whole == WHOLE
        assert usage == unbroken[-1].usage and usage is not None
        assert (usage.prompt_tokens, usage.completion_tokens) == (len(ASKED.split()) + 1, 10)
    assert rig.observed.seen == [("small", 200), ("small", 200)]
    assert rig.observed.continuations == [("small", "completed")]
    assert rig.observed.details[0][2:] == (8, 10)  # the key is charged as the client is told
    assert rig.table.inflight("a") == rig.table.inflight("b") == 0


async def test_without_include_usage_the_continuation_shows_no_usage(rig: Rig) -> None:
    async with engines(rig, Engine(die_after=2), Engine()), sdk(rig) as client:
        text, chunks = await read_chat(client)
    assert text == WHOLE
    assert all(c.usage is None for c in chunks)  # asked for the key's sake, cut
    assert rig.observed.details[0][2:] == (8, 10)


async def test_a_text_completion_stream_is_continued_from_its_prompt_and_text(
        rig: Rig) -> None:
    async with engines(rig, Engine(die_after=3), Engine()) as (a, b), sdk(rig) as client:
        stream = await client.completions.create(model="small", prompt="say it",
                                                 stream=True, max_tokens=50)
        chunks = [c async for c in stream]
    assert "".join(c.choices[0].text for c in chunks) == "fake-vllm small echo: say it"
    assert len({c.id for c in chunks}) == 1
    assert a.words >= 1 and b.words >= 1
    assert rig.observed.continuations == [("small", "completed")]


async def test_a_continuation_that_breaks_too_ends_the_stream_with_an_error(rig: Rig) -> None:
    async with engines(rig, Engine(die_after=3), "die"), sdk(rig) as client:
        stream = await client.chat.completions.create(model="small", messages=MESSAGES,
                                                      stream=True)
        got = []
        with pytest.raises(openai.APIError, match="Replica b broke off the stream"):
            async for chunk in stream:
                got.append(chunk)
    # The role and a's words, then b's one whole event: one continuation only.
    assert 2 <= len(got) <= 5 and got[-1].id == got[0].id
    assert rig.observed.seen == [("small", 502)]
    assert rig.observed.continuations == [("small", "failed")]
    assert set(rig.table.cooldowns()) == {"a", "b"}


async def test_with_no_other_replica_the_stream_ends_with_an_error_as_before(
        rig: Rig) -> None:
    async with engines(rig, Engine(die_after=3)), sdk(rig) as client:
        stream = await client.chat.completions.create(model="small", messages=MESSAGES,
                                                      stream=True)
        with pytest.raises(openai.APIError, match="Replica a broke off the stream"):
            async for _ in stream:
                pass
    assert rig.observed.seen == [("small", 502)]
    assert rig.observed.continuations == [("small", "no_replica")]


async def test_a_client_that_leaves_triggers_no_continuation(rig: Rig) -> None:
    async with engines(rig, Engine(token_delay=0.05), Engine()) as (a, b):
        call = AsgiCall(rig.proxy, {"model": "small", "messages": MESSAGES, "stream": True})
        assert (await call.next())["status"] == 200
        await call.next()
        call.leave.set()
        await asyncio.wait_for(call.task, 2)
        await asyncio.sleep(0.2)
        assert b.words == 0 and rig.attempts == [a.url + "/v1/chat/completions"]
    assert rig.observed.seen == [("small", 499)]
    assert rig.observed.continuations == []


async def test_no_continuation_once_the_deadline_is_near() -> None:
    rig = Rig(Timeouts(connect=2, first_byte=10, idle=10, request=1.4, cooldown=5))
    async with started(rig), engines(rig, Engine(die_after=4, token_delay=0.15),
                                     Engine()) as (_, b):
        call = AsgiCall(rig.proxy, {"model": "small", "messages": MESSAGES, "stream": True})
        assert (await call.next())["status"] == 200
        body = await call.rest()
    # a died about 0.6 s in, with under a second (MIN_LEFT) of the 1.4 s left.
    assert b"broke off the stream" in body and b"[DONE]" not in body
    assert b.words == 0 and rig.observed.continuations == []


async def test_a_continuation_that_sends_nothing_ends_at_the_first_byte_limit() -> None:
    rig = Rig(Timeouts(connect=2, first_byte=0.5, idle=10, request=10, cooldown=5))
    async with started(rig), engines(rig, Engine(die_after=3), "silent-start"):
        call = AsgiCall(rig.proxy, {"model": "small", "messages": MESSAGES, "stream": True})
        assert (await call.next())["status"] == 200
        body = await call.rest()
    assert body.endswith(b'"Replica b sent nothing for 0.5 s.", "type": "server_error", '
                         b'"param": null, "code": "upstream_timeout"}}\n\n')
    assert rig.observed.seen == [("small", 504)]
    assert rig.observed.continuations == [("small", "failed")]


async def test_the_stand_in_refuses_what_vllm_refuses(rig: Rig) -> None:
    async with engines(rig, Engine()) as (a,), httpx.AsyncClient(base_url=a.url) as http:
        both = await http.post("/v1/chat/completions", json={
            "model": "small", "continue_final_message": True,
            "messages": [*MESSAGES, {"role": "assistant", "content": "fake-vllm"}]})
        not_assistant = await http.post("/v1/chat/completions", json={
            "model": "small", "messages": MESSAGES, "continue_final_message": True,
            "add_generation_prompt": False})
        continued = await http.post("/v1/chat/completions", json={
            "model": "small", "continue_final_message": True, "add_generation_prompt": False,
            "messages": [*MESSAGES, {"role": "assistant", "content": "fake-vllm small"}]})
    assert both.status_code == 400 and "Cannot set both" in both.json()["error"]["message"]
    assert not_assistant.status_code == 400
    answer = continued.json()
    assert answer["choices"][0]["message"]["content"] == WHOLE[len("fake-vllm small"):]
    assert answer["usage"]["completion_tokens"] == 8  # the words after the given two


# --- what is sent, what is rewritten: the logic alone -------------------------------

VLLM = Endpoint("a", "http://a", "k", engine="vllm")


def _event(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


def _chunk(delta: dict[str, Any], finish: str | None = None, ident: str = "chatcmpl-1",
           created: int = 111) -> bytes:
    return _event({"id": ident, "object": "chat.completion.chunk", "created": created,
                   "model": "small", "choices": [{"index": 0, "delta": delta,
                                                  "finish_reason": finish}]})


def _splice(body: dict[str, Any], path: str = "/v1/chat/completions") -> Splice:
    splice = resumable(body, path, "small", VLLM)
    assert splice is not None
    return splice


def test_the_continuation_asks_to_continue_the_final_assistant_message() -> None:
    body = {"model": "small", "messages": MESSAGES, "stream": True, "max_tokens": 9,
            "max_completion_tokens": 12, "stream_options": {"include_usage": True}}
    splice = _splice(body)
    splice.pass_on(_chunk({"role": "assistant", "content": ""}))
    splice.pass_on(_chunk({"content": "Hello"}) + _chunk({"content": " there"}))
    assert splice.request() == body | {
        "messages": [*MESSAGES, {"role": "assistant", "content": "Hello there"}],
        "continue_final_message": True, "add_generation_prompt": False,
        "max_tokens": 7, "max_completion_tokens": 10}
    assert body["messages"] == MESSAGES  # the client's body is left as it was


def test_a_text_completion_continues_its_prompt_with_the_default_maximum() -> None:
    splice = _splice({"model": "small", "prompt": ["Once"], "stream": True},
                     "/v1/completions?x=1")
    splice.pass_on(_event({"id": "cmpl-1", "created": 1, "model": "small",
                           "choices": [{"index": 0, "text": " upon", "finish_reason": None}]}))
    assert splice.request() == {"model": "small", "prompt": ["Once upon"], "stream": True,
                                "max_tokens": 15}


@pytest.mark.parametrize("events", [
    _chunk({"tool_calls": [{"index": 0, "function": {"name": "f"}}]}),  # a tool call
    _chunk({"reasoning_content": "hmm"}),  # reasoning, not content
    _chunk({"content": "x"}, finish="stop"),  # the answer was whole
    b"data: [DONE]\n\n",  # the stream had ended
    b"data: {not json\n\n",  # what the client got is not understood
    _chunk({"content": "a"}) * 4,  # max_tokens reached
])
def test_what_cannot_be_continued_is_not(events: bytes) -> None:
    splice = _splice({"model": "small", "messages": MESSAGES, "max_tokens": 4})
    splice.pass_on(events)
    assert splice.request() is None


def test_a_stream_is_cut_short_until_its_done_came_in_whatever_chunk() -> None:
    splice = _splice({"model": "small", "messages": MESSAGES})
    splice.pass_on(_chunk({"role": "assistant", "content": ""}))
    assert splice.cut_short() and splice.request() is not None
    splice = _splice({"model": "small", "messages": MESSAGES})
    splice.pass_on(_chunk({"content": "a"}) + b"data: [DONE]\n\n")  # in one read
    splice.pass_on(b": a comment after\n\n")
    assert not splice.cut_short() and splice.request() is None


@pytest.mark.parametrize(("body", "ep"), [
    ({"n": 2}, VLLM), ({"echo": True}, VLLM), ({"prompt_logprobs": 1}, VLLM),
    ({"response_format": {"type": "json_object"}}, VLLM), ({"guided_json": {}}, VLLM),
    ({"continue_final_message": True}, VLLM),
    ({}, Endpoint("a", "http://a", "k", engine="llamacpp")),
    ({}, Endpoint("a", "http://a", "k", upstream_model="gpt-x")),
])
def test_requests_a_continuation_could_not_honour_are_not_resumable(
        body: dict[str, Any], ep: Endpoint) -> None:
    assert resumable({"model": "small", "messages": MESSAGES} | body,
                     "/v1/chat/completions", "small", ep) is None
    assert resumable({"model": "small", "messages": MESSAGES, "n": 1,
                      "response_format": {"type": "text"}}, "/v1/chat/completions", "small",
                     VLLM) is not None


def test_the_continuations_events_are_rewritten_as_the_first_engines() -> None:
    splice = _splice({"model": "small", "messages": MESSAGES})
    splice.pass_on(_chunk({"role": "assistant", "content": ""}) + _chunk({"content": "a"})
                   + _chunk({"content": " b"}))
    assert splice.request() is not None
    splice.resumed = True
    out = splice.pass_on(
        _chunk({"role": "assistant", "content": ""}, ident="chatcmpl-2", created=222)
        + _chunk({"content": " c"}, "stop", ident="chatcmpl-2", created=222)
        + _event({"id": "chatcmpl-2", "created": 222, "model": "small", "choices": [],
                  "usage": {"prompt_tokens": 12, "completion_tokens": 1,
                            "total_tokens": 13}})
        + b"data: [DONE]\n\n")
    events = [e for e in out.split(b"\n\n") if e]
    assert events[-1] == b"data: [DONE]"
    objs = [json.loads(e[6:]) for e in events[:-1]]
    assert [(o["id"], o["created"]) for o in objs] == [("chatcmpl-1", 111)] * 2  # role cut
    assert objs[0]["choices"][0]["delta"] == {"content": " c"}
    assert objs[1]["usage"] == {"prompt_tokens": 10, "completion_tokens": 3,
                                "total_tokens": 13}
    assert not splice.cut_short()
