"""What one request's answer says it used: its `Meter`.

The relay hands the meter every answer as it passes (relay.py,
relay_stream.py): a whole JSON answer (`read_answer`) or a stream's whole
SSE events (`read_events`). It notes the engine's `usage`, cuts the
usage-only event the gateway asked for on a client's behalf (`strip_usage`),
counts a stream's events (what an estimate is made from when no usage
comes, estimates.py), and gives the answer the catalog's model name when an
external provider or a spill served it (`rename`, answer_model.py: it parses
the answer once for both). Admission is not its business: the key's
`Ticket` (limits.py) holds one and charges what it noted when released.
"""

from __future__ import annotations

import json
import zlib
from typing import Any

from app.router import sse
from app.router.answer_model import renamed_answer, renamed_events
from app.router.usage.answer_usage import answer_usage


class Meter:
    """One request's usage as its answer reports it."""

    __slots__ = ("body", "chat", "completion_tokens", "count_at", "ended", "events", "noted",
                 "prompt_tokens", "rename", "strip_usage")

    def __init__(self) -> None:
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
        self.rename: str | None = None  # spilled or external: the answer's model, ours

    def note(self, usage: Any) -> None:
        """Takes OpenAI's `usage` object, if one; a later one replaces an earlier (cumulative)."""
        if not isinstance(usage, dict):
            return
        prompt = usage.get("prompt_tokens", usage.get("input_tokens"))  # or the Responses API's
        completion = usage.get("completion_tokens", usage.get("output_tokens", 0))
        if isinstance(prompt, int) and prompt >= 0:
            self.prompt_tokens = prompt
            self.noted = True
        if isinstance(completion, int) and completion >= 0:
            self.completion_tokens = completion

    def read_answer(self, body: bytes, encoding: str | None) -> bytes:
        """Notes the usage of a whole JSON answer (gzip or deflate undone for
        the read); returns what the client gets: `body`, renamed if `rename`."""
        raw = body
        if encoding is not None:
            if encoding.lower() not in ("gzip", "deflate"):
                return raw
            try:
                body = zlib.decompress(body, wbits=47)  # gzip or zlib, by its header
            except zlib.error:
                return raw
        if self.rename is None or encoding is not None:
            self.note(answer_usage(body))  # the usage alone decoded, not the answer
            return raw
        try:
            answer = json.loads(body)
        except (ValueError, UnicodeDecodeError):
            return raw
        self.note(answer.get("usage") if isinstance(answer, dict) else None)
        return renamed_answer(answer, raw, self.rename)

    def read_events(self, chunk: bytes) -> bytes:
        """Notes the usage in `chunk` (whole SSE events) and returns what the
        client gets: `chunk`, less the usage-only event if `strip_usage`,
        renamed if `rename`."""
        if self.rename is not None:
            chunk = renamed_events(chunk, self.rename)
        events = chunk.count(b"data:")
        # One JSON event, the usual chunk: no [DONE] (that would be a second
        # "data:"), and one scan of the chunk fewer.
        if events != 1 or not chunk.startswith(b"data: {"):
            done = chunk.count(b"data: [DONE]")
            if done:
                self.ended = True
            events -= done
        self.events += events
        # Most events: no parse at all. (`find`, not `in`: on bytes, `in`
        # first tries its operand as an integer, and makes and drops a
        # TypeError each time: a stream's chunk pays for it.)
        if chunk.find(b'"usage"') < 0:
            return chunk
        # OpenAI's `"usage": null` on every chunk once asked: counted, not
        # split (a key cannot appear unescaped inside a JSON string).
        if chunk.count(b'"usage"') == (chunk.count(b'"usage":null')
                                       + chunk.count(b'"usage": null')):
            return chunk
        out: list[bytes] = []
        for event, end in sse.events(chunk):
            # OpenAI sends `"usage": null` on every chunk once asked: no parse.
            if (event.find(b'"usage"') >= 0 and event.find(b'"usage":null') < 0
                    and event.find(b'"usage": null') < 0 and self._usage_only(event)):
                continue
            out += [event, end]
        return b"".join(out)

    def _usage_only(self, event: bytes) -> bool:
        """Notes the event's usage; True when it is the usage-only chunk we
        asked for on the client's behalf (no choices), which it must not see."""
        try:
            obj = json.loads(sse.data_of(event))
        except (ValueError, UnicodeDecodeError):
            return False
        if not isinstance(obj, dict):
            return False
        inner = obj.get("response")  # a Responses API event: its usage is its response's
        self.note(inner.get("usage") if isinstance(inner, dict) else obj.get("usage"))
        return self.strip_usage and obj.get("choices") == [] and isinstance(
            obj.get("usage"), dict)
