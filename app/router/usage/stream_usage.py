"""The usage event of a stream whose client asked for it
(`stream_options.include_usage`) and whose engine sends none.

llama-cpp-python's server (0.3.36) ignores the option: its streams end with
no usage event. vLLM and OpenAI end such a stream with a chunk of no
choices and the usage, just before `data: [DONE]`; so does the gateway,
with what the key is charged: the prompt as the engine counts it
(prompt_count.py, asked as the engine's `[DONE]` arrives, which is held back
until then: the stream's one count, made sooner), the completion one token
an event (`counted_completion`). When the count cannot be had in time, the
estimate the key is then charged (`estimate_usage`, counted as estimated).
docs/design/security.md, "A client's fields, counted whatever their form".
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

from app.router.usage.estimates import counted_completion, estimate_usage
from app.router.usage.meter import Meter

_DONE = b"data: [DONE]"
# The streams that carry a usage event (chat and text completions), and the
# fields of theirs the usage event repeats, so that a client parses it as
# one of the stream's chunks.
_OBJECTS = frozenset({"chat.completion.chunk", "text_completion"})
_HEAD = ("id", "object", "created", "model")


def owed(meter: Meter, engine: str) -> bool:
    """Whether this stream's client asked for a usage event its engine
    never sends (a client that did not ask has `strip_usage`)."""
    return engine == "llamacpp" and meter.body is not None and not meter.strip_usage


async def before_done(chunk: bytes, earlier: bytes, meter: Meter,
                      count: Callable[[], Awaitable[int | None]]) -> bytes:
    """`chunk` (whole events, relayed to the client next) with the usage
    event put before its `data: [DONE]`, unless the engine reported usage
    itself or the stream is not a completion's. `earlier`: the events
    relayed before it, for the stream's id when `chunk` holds only
    `[DONE]`. `count()`: the engine's count of the prompt, None if none."""
    at = chunk.find(_DONE)
    if at < 0 or meter.noted or meter.body is None:
        return chunk
    head = _head(chunk[:at]) or _head(earlier)
    if head is None:
        return chunk
    tokens = await count()
    if tokens is None:
        # Charged as a stream without usage is: estimated (limits.py).
        meter.count_at = None
        prompt, completion = estimate_usage(meter.body, meter.events)
    else:
        prompt, completion = tokens, counted_completion(meter.events, meter.chat)
        meter.note({"prompt_tokens": prompt, "completion_tokens": completion})
    event = head | {"choices": [], "usage": {
        "prompt_tokens": prompt, "completion_tokens": completion,
        "total_tokens": prompt + completion}}
    end = b"\r\n\r\n" if chunk.find(b"\r\n") >= 0 else b"\n\n"  # as the engine ends them
    return chunk[:at] + b"data: " + json.dumps(event).encode() + end + chunk[at:]


def _head(events: bytes) -> dict[str, Any] | None:
    """The id, object, created and model of the last completion chunk in
    `events`, None if none (one line of `data:` an event, as the engines write)."""
    for line in reversed(events.splitlines()):
        if not line.startswith(b"data:") or line == _DONE:
            continue
        try:
            obj = json.loads(line[5:])
        except (ValueError, UnicodeDecodeError):
            return None
        if not isinstance(obj, dict) or obj.get("object") not in _OBJECTS:
            return None
        return {k: obj[k] for k in _HEAD if k in obj}
    return None
