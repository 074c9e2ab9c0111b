"""A stream that survives its engine: resuming on another replica a chat or
text completion stream whose engine died after the client had its first
byte, spliced into the same response (docs/design/stream-continuation.md).

What reached the client is kept as it passes (whole SSE events, unparsed: an
append a chunk, no JSON on the hot path) and read only if the engine dies.
The continuation asks another vLLM replica to continue the final assistant
message (vLLM's `continue_final_message: true`, `add_generation_prompt:
false`; a text completion's prompt plus the text so far), with the tokens
left of the request's maximum. Its events are rewritten to look like the
first engine's (its `id`, `created` and `model`), its role-only event
dropped, its usage made the request's: prompt tokens those of the original
prompt (the continuation's less the tokens streamed before), completion
tokens those streamed before plus the continuation's.

One continuation a request (`Splice.resumed`), only for a request that can
be continued faithfully (`resumable`), only while the request's deadline
leaves `MIN_LEFT` seconds and its client is there (the watch).
"""

from __future__ import annotations

import json
import logging
from typing import Any, NamedTuple

from app.router import sse
from app.router.access import Exchange
from app.router.published import Endpoint
from app.router.request_line import UpstreamError
from app.router.table import Lease, RouteTable
from app.router.timeouts import Watch, Why
from app.router.upstream import Response, UpstreamClient

logger = logging.getLogger(__name__)

# Bytes of a stream kept to resume it from: past this, a stream is not
# resumed (an answer of some 16,000 tokens at ~250 bytes an event). What it
# costs: this much memory per stream in the worst case.
MAX_KEPT = 4 * 1024 * 1024
_DONE_EVENT = b"data: [DONE]"
# Seconds of its deadline a request must have left to be resumed: less
# would only start work the deadline then cuts.
MIN_LEFT = 1.0
# OpenAI's and vLLM's `max_tokens` when a text completion does not say.
_COMPLETION_DEFAULT_MAX = 16
_CHAT = "/v1/chat/completions"
_COMPLETIONS = "/v1/completions"
# Fields whose effect a continuation cannot reproduce: several choices, the
# prompt echoed or scored again, output constrained from its start (the
# grammar would restart mid-answer), a continuation the client asked itself.
_EXCLUDED = ("echo", "prompt_logprobs", "guided_json", "guided_regex", "guided_choice",
             "guided_grammar", "structured_outputs", "continue_final_message")
# Outcomes counted (`llmgw_stream_continuations_total{outcome}`).
COMPLETED, FAILED, NO_REPLICA, CLIENT_GONE = "completed", "failed", "no_replica", "client_gone"


def resumable(body: dict[str, Any], url_tail: str, model: str,
              ep: Endpoint) -> Splice | None:
    """A `Splice` for a stream that could be resumed elsewhere, else None:
    a vLLM engine's chat or text completion stream of one choice, with no
    field a continuation could not honour."""
    path = url_tail.partition("?")[0]
    if ep.engine != "vllm" or ep.upstream_model or path not in (_CHAT, _COMPLETIONS):
        return None
    if body.get("n") not in (None, 1) or body.get("best_of") not in (None, 1):
        return None
    if any(body.get(name) not in (None, False) for name in _EXCLUDED):
        return None
    fmt = body.get("response_format")
    if fmt is not None and not (isinstance(fmt, dict) and fmt.get("type") == "text"):
        return None
    if path == _CHAT:
        if not isinstance(body.get("messages"), list):
            return None
    else:
        prompt = body.get("prompt")
        if not isinstance(prompt, str) and not (
                isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str)):
            return None
    return Splice(body, url_tail, model, path == _CHAT)


class Splice:
    """One stream's way to be resumed: what reached its client, and the
    rewriting of a continuation's events into the same stream."""

    __slots__ = ("_done", "_kept", "_size", "body", "chat", "created", "ident", "model", "name",
                 "no_replica", "on", "resumed", "streamed", "url_tail")

    def __init__(self, body: dict[str, Any], url_tail: str, model: str, chat: bool) -> None:
        self.body = body
        self.url_tail = url_tail
        self.model = model
        self.chat = chat
        self._kept: list[bytes] | None = []  # None: past MAX_KEPT
        self._size = 0
        self.resumed = False
        self._done = False  # the continuation's [DONE] came
        self.no_replica = False  # a continuation was wanted, but no replica could take it
        self.on: Endpoint | None = None  # the replica continuing it
        self.streamed = 0  # completion tokens streamed before: one an event with text
        self.ident: Any = None  # the first engine's `id`, `created` and `model`
        self.created: Any = None
        self.name: Any = None

    def pass_on(self, events: bytes) -> bytes:
        """Whole SSE events on their way to the client: kept from the first
        engine, rewritten from the continuation."""
        if self.resumed:
            # find, not in: on bytes, `in` first tries its operand as an
            # integer, and makes and drops a TypeError each time.
            self._done = self._done or events.find(_DONE_EVENT) >= 0
            return self._rewrite(events)
        if self._kept is not None:
            # Whether the first engine's [DONE] came is asked of what was
            # kept once it failed (`_ended`), not of every chunk.
            self._size += len(events)
            if self._size > MAX_KEPT:
                self._kept = None
            else:
                self._kept.append(events)
        return events

    def _ended(self) -> bool:
        """Whether the first engine's [DONE] is among the events kept."""
        return any(events.find(_DONE_EVENT) >= 0 for events in self._kept or ())

    def outcome(self, why: Why | None) -> str:
        """What became of the continuation (`resumed`), `why` the watch ended
        the request if it did."""
        if self.no_replica:
            return NO_REPLICA
        if self._done:
            return COMPLETED
        return CLIENT_GONE if why is Why.CLIENT_GONE else FAILED

    def cut_short(self) -> bool:
        """Whether the stream so far ended with no `[DONE]` (and could be resumed)."""
        if self.resumed:
            return not self._done
        return self._kept is not None and not self._ended()

    def request(self) -> dict[str, Any] | None:
        """The continuation's request body, or None when what the client got
        cannot be continued: an event not understood, a second choice, a
        choice already finished, a tool call, reasoning, or no tokens left."""
        if self._kept is None or self._ended():
            return None
        parts: list[str] = []
        for data in _datas(b"".join(self._kept)):
            try:
                obj = json.loads(data)
            except (ValueError, UnicodeDecodeError):
                return None
            if not isinstance(obj, dict) or "error" in obj:
                return None
            if self.ident is None:
                self.ident, self.created, self.name = (obj.get("id"), obj.get("created"),
                                                       obj.get("model"))
            for choice in obj.get("choices") or ():
                text = self._text(choice)
                if text is None:
                    return None
                if text:
                    parts.append(text)
                    self.streamed += 1
        return self._body("".join(parts))

    def _text(self, choice: Any) -> str | None:
        """A choice's new text ("" if none); None if it bars continuing."""
        if not isinstance(choice, dict) or choice.get("index", 0) != 0:
            return None
        if choice.get("finish_reason") is not None:
            return None
        if not self.chat:
            text = choice.get("text")
            return text if isinstance(text, str) else ""
        delta = choice.get("delta")
        if not isinstance(delta, dict):
            return ""
        if any(delta.get(k) for k in ("tool_calls", "function_call", "reasoning_content",
                                      "reasoning")):
            return None
        content = delta.get("content")
        return content if isinstance(content, str) else ""

    def _body(self, text: str) -> dict[str, Any] | None:
        body = dict(self.body)
        if self.chat and text:
            body["messages"] = [*body["messages"], {"role": "assistant", "content": text}]
            body["continue_final_message"] = True
            body["add_generation_prompt"] = False
        elif not self.chat:
            prompt = body["prompt"]
            body["prompt"] = prompt + text if isinstance(prompt, str) else [prompt[0] + text]
            if body.get("max_tokens") is None:
                body["max_tokens"] = _COMPLETION_DEFAULT_MAX
        for name in ("max_tokens", "max_completion_tokens"):
            limit = body.get(name)
            if isinstance(limit, int):
                if limit - self.streamed < 1:
                    return None
                body[name] = limit - self.streamed
        return body

    def _rewrite(self, events: bytes) -> bytes:
        out: list[bytes] = []
        for event, end in sse.events(events):
            data = sse.data_of(event)
            try:
                obj = json.loads(data) if data.startswith(b"{") else None
            except (ValueError, UnicodeDecodeError):
                obj = None
            if not isinstance(obj, dict):
                out += [event, end]  # [DONE], comments, what is not understood
                continue
            if self._role_only(obj):
                continue
            if self.ident is not None:
                obj["id"], obj["created"], obj["model"] = self.ident, self.created, self.name
            usage = obj.get("usage")
            if isinstance(usage, dict):
                prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
                if isinstance(prompt, int) and isinstance(completion, int):
                    usage["prompt_tokens"] = max(0, prompt - self.streamed)
                    usage["completion_tokens"] = completion + self.streamed
                    usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
            out += [b"data: " + json.dumps(obj, separators=(",", ":")).encode(), end]
        return b"".join(out)

    def _role_only(self, obj: dict[str, Any]) -> bool:
        """Whether this is the continuation's opening event (its role, no
        text): the client had the first engine's. A role beside text is cut."""
        if not self.chat:
            return False
        choices = obj.get("choices")
        if not isinstance(choices, list) or len(choices) != 1 or not isinstance(choices[0],
                                                                                dict):
            return False
        delta = choices[0].get("delta")
        if not isinstance(delta, dict) or "role" not in delta:
            return False
        del delta["role"]
        return (not delta.get("content") and not delta.get("tool_calls")
                and choices[0].get("finish_reason") is None)


class Resumed(NamedTuple):
    upstream: Response
    ep: Endpoint
    lease: Lease
    first: bytes  # the continuation's first body bytes


async def resume(splice: Splice, table: RouteTable, client: UpstreamClient, watch: Watch,
                 ex: Exchange, dead: Endpoint) -> Resumed | None:
    """Sends `splice`'s continuation to another ready replica and reads its
    first bytes; None (its outcome noted) when it cannot be had. The caller
    closes the answer and releases the lease."""
    if splice.resumed or watch.why is not None or watch.left() < MIN_LEFT:
        return None
    body = splice.request()
    if body is None:
        return None
    splice.resumed = True
    ep = table.choose(splice.model, {dead.replica_id})
    if ep is None or ep.engine != "vllm" or ep.upstream_model:
        splice.no_replica = True
        return None
    splice.on = ep
    lease = table.acquire(ep)
    upstream: Response | None = None
    try:
        watch.expect_first_byte()
        upstream = await client.post(ep.url, splice.url_tail, json.dumps(body).encode(), [
            (b"Authorization", b"Bearer " + ep.key.encode()),
            (b"Content-Type", b"application/json"), (b"Accept-Encoding", b"identity"),
            *ex.forwarded])
        if upstream.status != 200 or upstream.headers.get("content-encoding"):
            raise UpstreamError(f"answered {upstream.status}")
        first = await upstream.readany()
    except UpstreamError as exc:
        logger.warning("continuation of a stream from replica %s on %s failed: %s",
                       dead.replica_id, ep.replica_id, exc or type(exc).__name__)
        if upstream is not None:
            upstream.close()
        lease.release()
        return None
    except BaseException:
        if upstream is not None:
            upstream.close()
        lease.release()
        raise
    logger.info("stream from replica %s (%d tokens streamed) continued on %s",
                dead.replica_id, splice.streamed, ep.replica_id)
    return Resumed(upstream, ep, lease, first)


def _datas(events: bytes) -> list[bytes]:
    """The data of each SSE event with data (comments and [DONE] left out)."""
    return [data for data in sse.datas(events) if data != sse.DONE]
