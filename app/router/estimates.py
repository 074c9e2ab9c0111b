"""Usage a stream did not report: asked of the engine, or estimated.

Split from app/router/limits.py (which re-exports both), where the
accounting they feed lives (docs/architecture.md, "Client keys": Usage).
"""

from __future__ import annotations

from typing import Any

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
