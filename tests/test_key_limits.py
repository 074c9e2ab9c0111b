"""Client key limits, router side (app/router/usage/limits.py), in-process with an
injected clock: each gateway's share, the windows, what a refusal says, and
the usage read from answers and streams."""

from __future__ import annotations

import asyncio
import gzip
import json
import time

import pytest
from hypothesis import given
from hypothesis import strategies as st

from app.router.usage.estimates import ask_for_usage, estimate_usage, usage_asked_in
from app.router.usage.limits import Limiter, Limits, Ticket
from app.router.usage.overlimit import OverLimit, share
from tests.support.proxy_rig import FakeClock


def _admitted(limiter: Limiter, limits: Limits, gateways: int, tries: int) -> int:
    n = 0
    for _ in range(tries):
        try:
            limiter.admit("k", "m", limits, gateways).release()
            n += 1
        except OverLimit:
            pass
    return n


def test_shares_round_up_so_n_gateways_admit_at_most_the_limit_plus_n_minus_1() -> None:
    assert share(None, 3) is None
    assert [share(4, n) for n in (1, 2, 3, 4, 5)] == [4, 2, 2, 1, 1]
    for limit in range(1, 20):
        for n in range(1, 6):
            total = n * (share(limit, n) or 0)
            assert limit <= total <= limit + n - 1, (limit, n)
    # Two gateways, each with its own window, requests spread evenly or not.
    clock = FakeClock()
    for limit, most in ((4, 4), (5, 6)):
        a, b = Limiter(clock=clock), Limiter(clock=clock)
        rpm = Limits(requests_per_minute=limit)
        assert _admitted(a, rpm, 2, 10) + _admitted(b, rpm, 2, 10) == most
        clock.now += 61


def test_requests_per_minute_is_a_sliding_window_with_retry_after() -> None:
    clock = FakeClock()
    lim = Limiter(clock=clock)
    rpm = Limits(requests_per_minute=2)
    lim.admit("k", "m", rpm).release()
    clock.now += 20
    lim.admit("k", "m", rpm).release()
    clock.now += 10
    with pytest.raises(OverLimit) as over:
        lim.admit("k", "m", rpm)
    assert over.value.kind == "requests"
    assert over.value.retry_after == 30  # the first leaves the window at 60 s
    assert "limit 2" in over.value.message
    lim.admit("other", "m", rpm).release()  # another key has its own window
    clock.now += 30
    lim.admit("k", "m", rpm).release()  # the first has left the window
    with pytest.raises(OverLimit):
        lim.admit("k", "m", rpm)


def test_tokens_are_charged_when_the_answer_ends_and_may_overshoot_by_it() -> None:
    clock = FakeClock()
    lim = Limiter(clock=clock)
    tpm = Limits(tokens_per_minute=100)
    t1 = lim.admit("k", "m", tpm)
    t2 = lim.admit("k", "m", tpm)  # under the limit while nothing is charged
    t1.meter.note({"prompt_tokens": 30, "completion_tokens": 50})
    t1.release()
    clock.now += 5
    t2.meter.note({"prompt_tokens": 10, "completion_tokens": 40})
    t2.release()  # 130 charged: over by what was in flight, as documented
    with pytest.raises(OverLimit) as over:
        lim.admit("k", "m", tpm)
    assert over.value.kind == "tokens"
    # 130 - 80 = 50 < 100 once t1's tokens, charged 5 s ago, leave the window.
    assert over.value.retry_after == 55
    clock.now += 55
    lim.admit("k", "m", tpm).release()
    assert lim.take_usage() == {("k", "m"): (3, 40, 90, 0)}
    assert lim.take_usage() == {}


def test_concurrency_counts_this_gateways_requests_in_flight() -> None:
    lim = Limiter(clock=FakeClock())
    conc = Limits(concurrent_requests=3)
    held = [lim.admit("k", "m", conc, gateways=2) for _ in range(2)]  # share: 2
    with pytest.raises(OverLimit) as over:
        lim.admit("k", "m", conc, gateways=2)
    assert over.value.retry_after == 1 and "2 on each of 2 gateways" in over.value.message
    held[0].release()
    held[0].release()  # idempotent
    assert lim.inflight("k") == 1
    lim.admit("k", "m", conc, gateways=2).release()
    held[1].release()
    assert lim.inflight("k") == 0


async def test_a_request_refused_below_its_keys_limit_waits_a_bounded_time() -> None:
    """`admit_or_wait`: refused on a claim below the key's limit, a request
    waits for the claims loop's steps (`settle`), counted as waiting on each
    limit it was refused on, and is refused at `claim_wait` if no step
    raised the claim; never waits at the key's limit or with no loop."""
    clock = FakeClock()
    lim = Limiter(clock=clock, wall=clock)
    lim.set_claims({})  # the loop has run: nothing claimed, the floor
    limits = Limits(requests_per_minute=10, concurrent_requests=2)
    steps: list[asyncio.Future[None]] = []

    def settle() -> asyncio.Future[None]:  # a loop whose step never ends
        steps.append(asyncio.get_running_loop().create_future())
        return steps[-1]

    held = lim.admit("k", "m", limits, 3)  # the floor
    with pytest.raises(OverLimit) as over:  # no loop to wait for: at once
        await lim.admit_or_wait("k", "m", limits, 3)
    assert over.value.short and over.value.also == ("concurrent_requests",)
    lim.settle, lim.claim_wait = settle, 0.2
    start = time.monotonic()
    waiting = asyncio.create_task(lim.admit_or_wait("k", "m", limits, 3))
    await asyncio.sleep(0.05)
    assert lim.key_loads()["k"].waiting == {"requests_per_minute": 1,
                                            "concurrent_requests": 1}
    with pytest.raises(OverLimit):
        await waiting
    assert 0.2 <= time.monotonic() - start < 1.0 and len(steps) == 1
    assert lim.key_loads()["k"].waiting == {}
    # A raise by the step: admitted when it ends.
    waiting = asyncio.create_task(lim.admit_or_wait("k", "m", limits, 3))
    await asyncio.sleep(0)
    lim.set_claims({"k": {"requests_per_minute": 10, "concurrent_requests": 2}})
    steps[-1].set_result(None)
    second = await waiting
    # At the key's limit here: refused at once, not short.
    lim.settle = settle
    with pytest.raises(OverLimit) as over:
        await lim.admit_or_wait("k", "m", limits, 3)
    assert not over.value.short and len(steps) == 2
    for t in (held, second):
        t.release()


def test_expiry_is_checked_against_the_wall_clock() -> None:
    clock = FakeClock()
    lim = Limiter(clock=clock, wall=clock)
    assert not lim.expired(None)
    assert not lim.expired(clock.now + 1)
    clock.now += 1
    assert lim.expired(clock.now)


def _sse(*objs: object) -> bytes:
    return b"".join(b"data: " + (o if isinstance(o, bytes) else json.dumps(o).encode())
                    + b"\n\n" for o in objs)


CHUNK = {"object": "chat.completion.chunk", "choices": [{"delta": {"content": "hi"}}]}
USAGE = {"object": "chat.completion.chunk", "choices": [],
         "usage": {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10}}


def _ticket() -> Ticket:
    return Limiter(clock=FakeClock()).admit("k", "m", Limits())


@given(st.dictionaries(st.text().filter(lambda k: k != "stream_options"),
                       st.recursive(st.none() | st.booleans() | st.integers() | st.text(),
                                    lambda inner: st.lists(inner, max_size=3)
                                    | st.dictionaries(st.text(), inner, max_size=3),
                                    max_leaves=8), min_size=1, max_size=5),
       st.sampled_from(["", " ", "\n", " \r\n\t"]), st.booleans())
def test_the_usage_request_appended_to_a_clients_bytes_reads_as_the_body_asking_it(
        body: dict[str, object], space: str, ascii_only: bool) -> None:
    raw = (json.dumps(body, ensure_ascii=ascii_only)[:-1] + space + "}" + space).encode()
    sent = usage_asked_in(raw)
    assert sent is not None and json.loads(sent) == body | {
        "stream_options": {"include_usage": True}}


def test_no_usage_request_is_appended_where_the_bytes_are_no_object_opened_and_closed() -> None:
    for raw in (b"{}", b"{ \n}", b' {"a": 1}', b'\xef\xbb\xbf{"a": 1}', b'[{"a": 1}]',
                '{"a": 1}'.encode("utf-16-be"), '{"a": 1}'.encode("utf-16-le")):
        assert usage_asked_in(raw) is None, raw


def test_a_streams_usage_is_read_and_cut_only_for_a_client_that_did_not_ask() -> None:
    body: dict[str, object] = {"stream": True}
    assert ask_for_usage(body) is True
    assert body["stream_options"] == {"include_usage": True}
    asked: dict[str, object] = {"stream_options": {"include_usage": True}}
    assert ask_for_usage(asked) is False
    assert ask_for_usage({"stream_options": "junk"}) is False  # the engine refuses it

    stream = _sse(CHUNK, USAGE, b"[DONE]")
    cut = _ticket()
    cut.meter.strip_usage = True
    assert cut.meter.read_events(stream) == _sse(CHUNK, b"[DONE]")
    assert (cut.meter.prompt_tokens, cut.meter.completion_tokens) == (7, 3)
    kept = _ticket()
    assert kept.meter.read_events(stream) == stream
    assert (kept.meter.prompt_tokens, kept.meter.completion_tokens) == (7, 3)
    # A chunk naming usage but carrying choices is the client's, never cut.
    mixed = CHUNK | {"usage": {"prompt_tokens": 1, "completion_tokens": 1}}
    assert cut.meter.read_events(_sse(mixed)) == _sse(mixed)
    # OpenAI's `"usage": null` on every chunk once asked: passed, nothing noted.
    nulls = _sse(CHUNK | {"usage": None}, b"[DONE]")
    fresh = _ticket()
    fresh.meter.strip_usage = True
    assert fresh.meter.read_events(nulls) == nulls and fresh.meter.prompt_tokens == 0
    # CRLF framing (sse-starlette, llama-cpp-python) is cut the same way.
    crlf = stream.replace(b"\n\n", b"\r\n\r\n")
    assert cut.meter.read_events(crlf) == _sse(CHUNK, b"[DONE]").replace(b"\n\n", b"\r\n\r\n")


def test_a_streams_events_and_its_done_are_counted_however_its_chunks_fall() -> None:
    """What an estimate counts (`Meter.events`) and whether [DONE] came, for
    one event a chunk (the usual: a scan fewer), events together, [DONE]
    alone or behind an event, a comment before one event, CRLF framing."""
    one, done = _sse(CHUNK), _sse(b"[DONE]")
    for chunks, events, ended in (
            ([one, one, one], 3, False),
            ([one + one, one], 3, False),
            ([one, done], 1, True),
            ([one + done], 1, True),
            ([b": keep-alive\n\n" + one, done], 1, True),
            ([one.replace(b"\n\n", b"\r\n\r\n"), done.replace(b"\n\n", b"\r\n\r\n")], 1,
             True),
            # No space after "data:": counted as events, [DONE] not seen (as before).
            ([b"data:{\"choices\": []}\n\n", b"data:[DONE]\n\n"], 2, False)):
        meter = _ticket().meter
        for chunk in chunks:
            assert meter.read_events(chunk) == chunk
        assert (meter.events, meter.ended) == (events, ended), chunks


def test_a_plain_answers_usage_is_read_even_compressed() -> None:
    answer = json.dumps({"choices": [], "usage": {"prompt_tokens": 5,
                                                  "completion_tokens": 9}}).encode()
    for body, encoding in ((answer, None), (gzip.compress(answer), "gzip")):
        t = _ticket()
        t.meter.read_answer(body, encoding)
        assert (t.meter.prompt_tokens, t.meter.completion_tokens) == (5, 9)
    for junk, encoding in ((b"not json", None), (b"\x00", "gzip"), (answer, "br")):
        t = _ticket()
        t.meter.read_answer(junk, encoding)
        assert (t.meter.prompt_tokens, t.meter.completion_tokens) == (0, 0)
    t = _ticket()
    t.meter.note({"prompt_tokens": -1, "completion_tokens": "3"})  # nonsense is not counted
    assert (t.meter.prompt_tokens, t.meter.completion_tokens) == (0, 0)


def test_a_stream_without_its_usage_event_is_estimated_and_counted_as_such() -> None:
    clock = FakeClock()
    lim = Limiter(clock=clock)
    tpm = Limits(tokens_per_minute=100)
    cut = lim.admit("k", "m", tpm)
    whole = lim.admit("k", "m", tpm)
    cut.meter.body = {"messages": [{"role": "user", "content": "a" * 400}]}
    # 60 events and [DONE], no usage: llama-cpp-python's server, say.
    cut.meter.read_events(b'data: {"choices": []}\n\n' * 60 + b"data: [DONE]\n\n")
    cut.release()
    whole.meter.body = {"messages": [{"role": "user", "content": "hi"}]}
    whole.meter.read_events(b'data: {"choices": []}\n\n'
                      b'data: {"choices": [], "usage": {"prompt_tokens": 3, '
                      b'"completion_tokens": 1}}\n\n')
    whole.release()
    assert lim.take_usage() == {("k", "m"): (2, 100 + 3, 59 + 1, 1)}
    # The estimate counts against the key's tokens per minute like any usage.
    with pytest.raises(OverLimit):
        lim.admit("k", "m", tpm)


def test_a_llamacpp_stream_to_its_end_is_counted_its_prompt_added_later() -> None:
    # llama-cpp-python: a role-only event, one event a token, a last one with
    # the finish reason, [DONE]; no usage event ever.
    clock = FakeClock()
    lim = Limiter(clock=clock)
    tpm = Limits(tokens_per_minute=30)
    chat = lim.admit("k", "m", tpm)
    chat.meter.body, chat.meter.chat = {"messages": [{"role": "user", "content": "a" * 400}]}, True
    chat.meter.count_at = ("http://engine", "engine-key")
    role = b'data: {"choices": [{"delta": {"role": "assistant"}}]}\r\n\r\n'
    token = b'data: {"choices": [{"delta": {"content": "x"}}]}\r\n\r\n'
    end = b'data: {"choices": [{"delta": {}, "finish_reason": "length"}]}\r\n\r\n'
    chat.meter.read_events(role + token * 7)
    chat.meter.read_events(token * 5 + end + b"data: [DONE]\r\n\r\n")
    chat.release()
    assert chat.prompt_later and (chat.meter.prompt_tokens, chat.meter.completion_tokens) == (0, 12)
    text = lim.admit("k", "m", tpm)  # a text completion: no role event
    text.meter.body, text.meter.count_at = {"prompt": "hello"}, ("http://engine", "engine-key")
    text.meter.read_events(token * 3 + end + b"data: [DONE]\r\n\r\n")
    text.release()
    assert text.prompt_later and text.meter.completion_tokens == 3
    # Cut before its [DONE]: estimated as before, its prompt not counted later.
    cut = lim.admit("k", "m", tpm)
    cut.meter.body, cut.meter.chat = {"messages": [{"role": "user", "content": "12345678"}]}, True
    cut.meter.count_at = ("http://engine", "engine-key")
    cut.meter.read_events(role + token * 4)
    cut.release()
    assert not cut.prompt_later
    assert lim.take_usage() == {("k", "m"): (3, 2, 12 + 3 + 4, 1)}
    # The prompts come later: the counted one not estimated, a failed count
    # estimated; both reach usage and the key's window.
    lim.add_prompt(chat, 9, estimated=False)
    lim.add_prompt(text, 2, estimated=True)
    assert lim.take_usage() == {("k", "m"): (0, 11, 0, 1)}
    with pytest.raises(OverLimit):  # 12 + 3 + 4 + 2 + 9 + 2 = 32 tokens >= 30
        lim.admit("k", "m", tpm)
    clock.now += 61
    lim.admit("k", "m", tpm).release()


@pytest.mark.parametrize(("body", "events", "expected"), [
    ({"messages": [{"role": "user", "content": "12345"}]}, 0, (2, 0)),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "1234"},
                                                {"type": "image_url", "image_url": {}}]}]},
     3, (1, 2)),
    ({"prompt": "12345678"}, 1, (2, 0)),
    ({"prompt": [1, 2, 3]}, 2, (3, 1)),
    ({"prompt": [[1, 2], [3]]}, 2, (3, 1)),
    ({"prompt": 7, "messages": "nonsense"}, 5, (0, 4)),
])
def test_estimates(body: dict[str, object], events: int, expected: tuple[int, int]) -> None:
    assert estimate_usage(body, events) == expected
