"""The prompt tokens of streams whose engine never reports usage, counted
by that engine after the stream, off the request path.

llama-cpp-python's server (0.3.36) ignores `stream_options.include_usage`:
its streams end with no usage event. Their completion tokens are counted
from their events as they pass (app/router/usage/limits.py, one token an event);
their prompt is counted here, once the stream has ended, by the replica that
served it, so the count is the engine's own:

* a text completion's prompt (a string): `POST /extras/tokenize/count`,
  which tokenizes as the completion did (BOS added, special tokens parsed);
* a chat's prompt is the messages rendered by the model's chat template,
  which the tokenize endpoint does not apply and the gateway does not have:
  the engine counts it with the route our agent adds to it
  (app/wire/engine_routes.py, `PROMPT_TOKENS`: the chat's own template and
  tokenizer, the model not run). An engine an older agent started answers
  that 404: it is asked the same chat instead, not streamed, with
  `max_tokens: 1`, and its usage's `prompt_tokens` taken, which costs a
  prefill of the whole prompt again when another request came between.

A client that asked for the stream's usage (`stream_options.include_usage`)
gets it before `[DONE]`, as vLLM sends it: the relay asks `count()` as the
engine's `[DONE]` arrives, and holds that back until the count is in (or
estimated): the same one count, made sooner (relay.py).

At most `concurrency` counts run at once per gateway (each waits for the
engine's lock behind the requests it is serving, under `timeout`), at most
`_MAX_WAITING` wait for their turn; a count that cannot be had (refused,
timed out, unreadable, the gateway stopping) falls back to the estimate
(`estimate_usage`) and is counted as estimated.
docs/design/security.md, "A client's fields, counted whatever their form".
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from typing import Any

from app.router.request_line import UpstreamError
from app.router.upstream import UpstreamClient
from app.router.usage.estimates import estimate_usage
from app.router.usage.limits import Limiter, Ticket
from app.router.usage.meter import Meter
from app.wire.engine_routes import PROMPT_FIELDS, PROMPT_TOKENS

logger = logging.getLogger(__name__)

# Counts waiting for a slot beyond which a stream's prompt is estimated at
# once: bounds the memory held by bodies kept for counting.
_MAX_WAITING = 1000
# Largest answer read from a count (a chat answer of one token is ~0.5 KiB).
_MAX_ANSWER = 64 * 1024
# What a chat's prompt is rendered from by llama-cpp-python's chat handlers
# (messages, and tools/functions for templates that show them): all that a
# count's request keeps of the client's body.
_PROMPT_FIELDS = ("model", *PROMPT_FIELDS)


class PromptCounter:
    """Counts released tickets' prompts (`Ticket.prompt_later`) with their engines."""

    def __init__(self, client: UpstreamClient, limiter: Limiter, concurrency: int,
                 timeout: float,
                 counted: Callable[[str, int], None] | None = None) -> None:
        """`counted(model, tokens)` is told each prompt once counted or
        estimated (the metrics' prompt tokens)."""
        self._client = client
        self._counted = counted
        self._limiter = limiter
        self._slots = asyncio.Semaphore(concurrency)
        self._timeout = timeout
        self._tasks: dict[asyncio.Task[None], Ticket] = {}

    def submit(self, ticket: Ticket) -> None:
        """Counts `ticket`'s prompt in the background and adds it to its key."""
        if len(self._tasks) >= _MAX_WAITING:
            self._estimate(ticket)
            return
        task = asyncio.create_task(self._count(ticket), name="prompt-count")
        self._tasks[task] = ticket
        task.add_done_callback(lambda done: self._tasks.pop(done, None))

    def pending(self) -> int:
        return len(self._tasks)

    async def close(self) -> None:
        """Stops the counts still running; their prompts are estimated."""
        tasks = list(self._tasks.items())
        for task, _ in tasks:
            task.cancel()
        await asyncio.gather(*(t for t, _ in tasks), return_exceptions=True)

    async def count(self, meter: Meter, within: float) -> int | None:
        """The engine's count of `meter`'s prompt, within `within` seconds
        (and this counter's timeout), a slot's wait included; None when it
        cannot be had (the caller estimates it), said in the log. Also asked
        before a stream's end reaches a client that asked for its usage
        (relay.py): that is then the stream's one count."""
        try:
            async with asyncio.timeout(min(within, self._timeout)), self._slots:
                return await self._ask(meter)
        except (UpstreamError, TimeoutError) as exc:
            logger.warning("prompt count failed, estimated instead: %s",
                           exc or type(exc).__name__)
        except Exception:
            logger.exception("prompt count failed, estimated instead")
        return None

    async def _count(self, ticket: Ticket) -> None:
        try:
            tokens = await self.count(ticket.meter, self._timeout)
        except asyncio.CancelledError:
            self._estimate(ticket)
            raise
        if tokens is None:
            self._estimate(ticket)
        else:
            self._add(ticket, tokens, estimated=False)

    def _estimate(self, ticket: Ticket) -> None:
        assert ticket.meter.body is not None
        self._add(ticket, estimate_usage(ticket.meter.body, 0)[0], estimated=True)

    def _add(self, ticket: Ticket, tokens: int, estimated: bool) -> None:
        self._limiter.add_prompt(ticket, tokens, estimated)
        if self._counted is not None:
            self._counted(ticket.model, tokens)

    async def _ask(self, meter: Meter) -> int | None:
        """The engine's count of the meter's prompt; None if it cannot say."""
        assert meter.count_at is not None and meter.body is not None
        url, key = meter.count_at
        body = meter.body
        if meter.chat:
            fields = {k: body[k] for k in _PROMPT_FIELDS if k in body}
            counted = await self._post(url, key, PROMPT_TOKENS, fields, missing_ok=True)
            if counted is not None:
                return _count(counted.get("count"), PROMPT_TOKENS)
            # An engine an older agent started: the chat itself, one token.
            target = "/v1/chat/completions"
            answer = await self._post(url, key, target,
                                      fields | {"max_tokens": 1, "temperature": 0})
            assert answer is not None
            usage = answer.get("usage")
            return _count(usage.get("prompt_tokens") if isinstance(usage, dict) else None,
                          target)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1:
            prompt = prompt[0]  # llama-cpp-python takes a list of one prompt
        if not isinstance(prompt, str):
            return None
        target = "/extras/tokenize/count"
        answer = await self._post(url, key, target, {"input": prompt})
        assert answer is not None
        return _count(answer.get("count"), target)

    async def _post(self, url: str, key: str, target: str, ask: dict[str, Any],
                    missing_ok: bool = False) -> dict[str, Any] | None:
        """The engine's JSON answer to `ask` at `target`; None for a 404 when
        `missing_ok` (a route the engine does not have)."""
        answer = await self._client.post(url, target, json.dumps(ask).encode(), [
            (b"Authorization", b"Bearer " + key.encode()),
            (b"Content-Type", b"application/json"), (b"Accept-Encoding", b"identity")])
        try:
            raw = b""
            while chunk := await answer.readany():
                raw += chunk
                if len(raw) > _MAX_ANSWER:
                    raise UpstreamError(f"{target} answered over {_MAX_ANSWER} bytes")
        finally:
            answer.close()
        if answer.status == 404 and missing_ok:
            return None
        if answer.status != 200:
            raise UpstreamError(f"{target} answered {answer.status}")
        try:
            parsed = json.loads(raw)
        except (ValueError, UnicodeDecodeError):
            raise UpstreamError(f"{target} answered no JSON") from None
        if not isinstance(parsed, dict):
            raise UpstreamError(f"{target} answered no object")
        return parsed


def _count(found: object, target: str) -> int:
    if not isinstance(found, int) or isinstance(found, bool) or found < 0:
        raise UpstreamError(f"{target} answered no count")
    return found
