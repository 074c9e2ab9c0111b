"""Client key limits and usage, router side: decided per request with no I/O.

The request path never waits on the store (DESIGN invariant 2), so gateways
cannot ask each other, or etcd, how much of a key's minute is left. Instead
each of the N live gateways enforces an equal share of each limit,
`ceil(limit / N)`, locally (docs/architecture.md, "Client keys"): N gateways
together admit at most `N * ceil(limit / N) <= limit + N - 1` per window,
whatever way a load balancer spreads the requests. The price: a client whose
requests all reach one gateway gets that gateway's share only.

* requests per minute: a sliding window of admission times (exact, no
  bucket rounding); a request counts when admitted, whatever its outcome.
* tokens per minute: prompt + completion tokens, known only when an answer
  ends, so they are charged then; a request is admitted while the window's
  tokens are under the share, so a gateway overshoots its share by at most
  the tokens of the answers it had in flight when it reached it.
* concurrent requests: this gateway's in-flight requests of the key.
* expiry: the key's Unix time against the (injected) wall clock.

Usage (requests, prompt and completion tokens per key and model) is counted
here and taken in batches by whoever writes it to the store (`take_usage`);
the router never imports the control plane (DESIGN invariant 8). A stream
that ends before the engine's usage event (the client left, the engine
died, a timeout) would otherwise cost its key nothing, however long it ran:
its tokens are estimated instead, and counted as estimated
(`estimate_usage`). A stream from an engine that never reports its usage
(llama-cpp-python's server) is counted instead: its completion tokens
from its events here, its prompt by the engine, after the stream, through
app/router/counting.py, which then adds them (`add_prompt`).
"""

from __future__ import annotations

import json
import math
import re
import time
import zlib
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

WINDOW = 60.0  # seconds: the "minute" of requests and tokens per minute
# How long a client refused for concurrency is told to wait: no request's
# end can be predicted, and one second is what a polite retry costs.
_CONCURRENCY_RETRY = 1
_EVENT_SPLIT = re.compile(rb"(\r\n\r\n|\n\n|\r\r)")


@dataclass(frozen=True, slots=True)
class Limits:
    """A key's limits for all gateways together; None: unlimited."""

    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    concurrent_requests: int | None = None


NO_LIMITS = Limits()


def share(limit: int | None, gateways: int) -> int | None:
    """One gateway's share of `limit` among `gateways`: rounded up, so that a
    key stays usable on every gateway (a share of 0 would refuse it for
    ever), at the cost of at most `gateways - 1` over the limit in all."""
    if limit is None:
        return None
    return -(-limit // max(gateways, 1))


class OverLimit(Exception):
    """The key is over one of its limits: a 429 with Retry-After."""

    def __init__(self, kind: str, message: str, retry_after: float) -> None:
        super().__init__(message)
        self.kind = kind  # "requests" or "tokens", OpenAI's error type
        self.message = message
        # Whole seconds, at least 1: what HTTP's Retry-After can say.
        self.retry_after = max(1, math.ceil(retry_after))


class _KeyState:
    __slots__ = ("inflight", "requests", "token_sum", "tokens")

    def __init__(self) -> None:
        self.requests: deque[float] = deque()  # admission times in the window
        self.tokens: deque[tuple[float, int]] = deque()  # (charged at, tokens)
        self.token_sum = 0
        self.inflight = 0

    def prune(self, now: float, window: float) -> None:
        while self.requests and self.requests[0] <= now - window:
            self.requests.popleft()
        while self.tokens and self.tokens[0][0] <= now - window:
            self.token_sum -= self.tokens.popleft()[1]

    def idle(self) -> bool:
        return not (self.requests or self.tokens or self.inflight)


class Limiter:
    """This gateway's view of every key's window. One per gateway.

    `clock` times the windows (monotonic); `wall` is compared with expiry
    times, which are Unix times. Tests pass one fake for both."""

    def __init__(self, clock: Callable[[], float] = time.monotonic,
                 wall: Callable[[], float] = time.time, window: float = WINDOW) -> None:
        self._clock = clock
        self._wall = wall
        self._window = window
        self._keys: dict[str, _KeyState] = {}
        # (key id, model) -> [requests, prompt tokens, completion tokens, estimated]
        self._usage: dict[tuple[str, str], list[int]] = {}

    def expired(self, expires: float | None) -> bool:
        return expires is not None and self._wall() >= expires

    def admit(self, key_id: str, model: str, limits: Limits, gateways: int = 1) -> Ticket:
        """A ticket for one request of `key_id`, or OverLimit. Release the
        ticket when the request ends, however it ends."""
        now = self._clock()
        st = self._keys.get(key_id)
        if st is None:
            st = self._keys[key_id] = _KeyState()
        st.prune(now, self._window)
        of = f"of {gateways} gateways" if gateways > 1 else "gateway"
        rpm = share(limits.requests_per_minute, gateways)
        if rpm is not None and len(st.requests) >= rpm:
            raise OverLimit("requests", (
                f"Rate limit reached for requests per minute (RPM) on this key: limit "
                f"{limits.requests_per_minute}, {rpm} on each {of}. Please try again later."),
                st.requests[0] + self._window - now)
        tpm = share(limits.tokens_per_minute, gateways)
        if tpm is not None and st.token_sum >= tpm:
            raise OverLimit("tokens", (
                f"Rate limit reached for tokens per minute (TPM) on this key: limit "
                f"{limits.tokens_per_minute}, {tpm} on each {of}, used {st.token_sum} "
                "here. Please try again later."), self._tokens_free_at(st, tpm) - now)
        conc = share(limits.concurrent_requests, gateways)
        if conc is not None and st.inflight >= conc:
            raise OverLimit("requests", (
                f"Too many concurrent requests on this key: limit "
                f"{limits.concurrent_requests}, {conc} on each {of}. Please try again "
                "when one has finished."), _CONCURRENCY_RETRY)
        if rpm is not None:  # unlimited keys keep no timestamps
            st.requests.append(now)
        st.inflight += 1
        return Ticket(self, key_id, model, st, charge_tokens=tpm is not None)

    def _tokens_free_at(self, st: _KeyState, tpm: int) -> float:
        """When enough charged tokens leave the window to bring it under `tpm`."""
        left = st.token_sum
        for at, tokens in st.tokens:
            left -= tokens
            if left < tpm:
                return at + self._window
        return self._clock()

    def _finish(self, ticket: Ticket) -> None:
        st = ticket.state
        st.inflight -= 1
        # A stream from an engine that reports no usage, whole to its
        # [DONE]: one token an event but the framing ones (llama-cpp-python
        # sends a role-only event first in a chat, and a last one with the
        # finish reason and no text); its prompt is counted by the engine
        # once this ends, and added then (`add_prompt`).
        ticket.prompt_later = (ticket.count_at is not None and ticket.ended
                               and not ticket.noted and ticket.body is not None)
        if ticket.prompt_later:
            ticket.completion_tokens = max(0, ticket.events - (2 if ticket.chat else 1))
        estimated = (ticket.events > 0 and not ticket.noted and ticket.body is not None
                     and not ticket.prompt_later)
        if estimated:
            assert ticket.body is not None
            ticket.prompt_tokens, ticket.completion_tokens = estimate_usage(
                ticket.body, ticket.events)
        tokens = ticket.prompt_tokens + ticket.completion_tokens
        if ticket.charge_tokens and tokens:
            st.tokens.append((self._clock(), tokens))
            st.token_sum += tokens
        if st.idle() and self._keys.get(ticket.key_id) is st:
            del self._keys[ticket.key_id]
        counts = self._usage.setdefault((ticket.key_id, ticket.model), [0, 0, 0, 0])
        counts[0] += 1
        counts[1] += ticket.prompt_tokens
        counts[2] += ticket.completion_tokens
        counts[3] += estimated

    def add_prompt(self, ticket: Ticket, tokens: int, estimated: bool) -> None:
        """The prompt tokens of a released ticket whose prompt was counted
        after its end (`Ticket.prompt_later`), or estimated when that count
        failed: added to its key's usage and, if it has a token limit, to its
        window, as of now."""
        if ticket.charge_tokens and tokens:
            st = self._keys.get(ticket.key_id)
            if st is None:
                st = self._keys[ticket.key_id] = _KeyState()
            st.prune(self._clock(), self._window)
            st.tokens.append((self._clock(), tokens))
            st.token_sum += tokens
        counts = self._usage.setdefault((ticket.key_id, ticket.model), [0, 0, 0, 0])
        counts[1] += tokens
        counts[3] += estimated

    def inflight(self, key_id: str) -> int:
        st = self._keys.get(key_id)
        return st.inflight if st is not None else 0

    def take_usage(self) -> dict[tuple[str, str], tuple[int, int, int, int]]:
        """Usage counted since the last call, by (key id, model), as
        (requests, prompt tokens, completion tokens, requests whose tokens
        were estimated); the caller writes it."""
        taken, self._usage = self._usage, {}
        return {k: (v[0], v[1], v[2], v[3]) for k, v in taken.items()}


class Ticket:
    """One admitted request: its place in the key's concurrency, and the
    usage its answer reports. `release()` is idempotent."""

    __slots__ = ("_done", "_limiter", "body", "charge_tokens", "chat", "completion_tokens",
                 "count_at", "ended", "events", "key_id", "model", "noted", "prompt_later",
                 "prompt_tokens", "state", "strip_usage")

    def __init__(self, limiter: Limiter, key_id: str, model: str, state: _KeyState,
                 charge_tokens: bool) -> None:
        self._limiter = limiter
        self.key_id = key_id
        self.model = model
        self.state = state
        self.charge_tokens = charge_tokens
        self.prompt_tokens = 0
        self.completion_tokens = 0
        # Set when we asked the engine for a stream's usage and the client did
        # not: the usage-only event is then cut from what the client sees.
        self.strip_usage = False
        # A stream's request body and the SSE events relayed so far: what its
        # usage is estimated from if it ends before the engine's usage event.
        self.body: dict[str, Any] | None = None
        self.events = 0
        self.noted = False  # the engine reported usage
        self.chat = False  # a chat completion (else a text completion)
        self.ended = False  # the stream's `data: [DONE]` came
        # Set when the stream comes from an engine that reports no usage
        # (llama.cpp): its (base URL, engine key), to count the prompt with.
        self.count_at: tuple[str, str] | None = None
        # Set on release: the prompt is to be counted by the engine, then
        # added (`Limiter.add_prompt`); prompt_tokens stays 0 until then.
        self.prompt_later = False
        self._done = False

    def release(self) -> None:
        if not self._done:
            self._done = True
            self._limiter._finish(self)

    def note(self, usage: Any) -> None:
        """Takes OpenAI's `usage` object, if it is one. A later one replaces an
        earlier one: with vLLM's continuous usage stats each is cumulative."""
        if not isinstance(usage, dict):
            return
        prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens", 0)
        if isinstance(prompt, int) and prompt >= 0:
            self.prompt_tokens = prompt
            self.noted = True
        if isinstance(completion, int) and completion >= 0:
            self.completion_tokens = completion

    def read_answer(self, body: bytes, encoding: str | None) -> None:
        """The usage of a whole JSON answer (gzip or deflate undone for the read)."""
        if encoding is not None:
            if encoding.lower() not in ("gzip", "deflate"):
                return
            try:
                body = zlib.decompress(body, wbits=47)  # gzip or zlib, by its header
            except zlib.error:
                return
        try:
            answer = json.loads(body)
        except (ValueError, UnicodeDecodeError):
            return
        if isinstance(answer, dict):
            self.note(answer.get("usage"))

    def read_events(self, chunk: bytes) -> bytes:
        """Notes the usage in `chunk` (whole SSE events) and returns what the
        client gets: `chunk`, less the usage-only event if `strip_usage`."""
        done = chunk.count(b"data: [DONE]")
        if done:
            self.ended = True
        self.events += chunk.count(b"data:") - done
        if b'"usage"' not in chunk:  # most events: no parse at all
            return chunk
        parts = _EVENT_SPLIT.split(chunk)
        out: list[bytes] = []
        for event, end in zip(parts[0::2], [*parts[1::2], b""], strict=True):
            # OpenAI sends `"usage": null` on every chunk once asked: no parse.
            if (b'"usage"' in event and b'"usage":null' not in event
                    and b'"usage": null' not in event and self._usage_only(event)):
                continue
            out += [event, end]
        return b"".join(out)

    def _usage_only(self, event: bytes) -> bool:
        """Notes the event's usage; True when it is the usage-only chunk we
        asked for on the client's behalf (no choices), which it must not see."""
        data = b"".join(line[5:].lstrip() for line in event.splitlines()
                        if line.startswith(b"data:"))
        try:
            obj = json.loads(data)
        except (ValueError, UnicodeDecodeError):
            return False
        if not isinstance(obj, dict):
            return False
        self.note(obj.get("usage"))
        return self.strip_usage and obj.get("choices") == [] and isinstance(
            obj.get("usage"), dict)


# Characters per token of a prompt whose count the engine never reported:
# OpenAI's rule of thumb for English text.
_CHARS_PER_TOKEN = 4


def estimate_usage(body: dict[str, Any], events: int) -> tuple[int, int]:
    """(prompt, completion) tokens of a stream cut before its usage event.

    Completion: one token per event after the first (vLLM sends one token an
    event, after a first that carries the role only). Prompt: the text's
    characters / 4, or the count of a prompt given as token ids. Rough, but
    a key's limits and usage then see the work a cut stream made."""
    chars = tokens = 0
    messages = body.get("messages")
    for m in messages if isinstance(messages, list) else ():
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, str):
            chars += len(content)
        elif isinstance(content, list):
            chars += sum(len(p["text"]) for p in content
                         if isinstance(p, dict) and isinstance(p.get("text"), str))
    prompt = body.get("prompt")
    for p in [prompt] if isinstance(prompt, str) else prompt if isinstance(prompt, list) else ():
        if isinstance(p, str):
            chars += len(p)
        elif isinstance(p, int):
            tokens += 1
        elif isinstance(p, list):
            tokens += len(p)
    return tokens + -(-chars // _CHARS_PER_TOKEN), max(0, events - 1)


def ask_for_usage(body: dict[str, Any]) -> bool:
    """Makes a streamed request ask the engine for its usage; True if the
    client had not asked (its usage event must then be cut). `stream_options`
    is an object or null here, its `include_usage` a boolean or null
    (app/router/fields.py refused any other form)."""
    opts = body.get("stream_options")
    if opts is None:
        opts = {}
    if not isinstance(opts, dict) or opts.get("include_usage") is True:
        return False
    body["stream_options"] = opts | {"include_usage": True}
    return True
