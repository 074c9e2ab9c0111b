"""Usage a stream did not report: asked of the engine, or estimated.

Split from app/router/usage/limits.py (which re-exports both), where the
accounting they feed lives (docs/design/client-keys.md, "Usage").
"""

from __future__ import annotations

from typing import Any

# Characters per token of a prompt whose count the engine never reported:
# OpenAI's rule of thumb for English text.
_CHARS_PER_TOKEN = 4
# Completion tokens reserved for a spilled request that names no limit of
# its own, when its overflow names none (`external.spill_reserve_tokens`).
DEFAULT_RESERVE = 4096
# The request fields that bound a completion's tokens, in the forms of chat
# and text completions and of the Responses API.
_COMPLETION_LIMITS = ("max_completion_tokens", "max_tokens", "max_output_tokens")
# Most choices one request is reserved for (OpenAI's own cap on `n`).
_MAX_CHOICES = 128


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


def counted_completion(events: int, chat: bool) -> int:
    """The completion tokens of a whole stream from an engine that reports
    none (llama-cpp-python): one an event, less the framing ones (a chat's
    role-only first event, and the last, with the finish reason and no
    text). docs/design/security.md, "A client's fields, counted whatever their form"."""
    return max(0, events - (2 if chat else 1))


def ask_for_usage(body: dict[str, Any]) -> bool:
    """Makes a streamed request ask the engine for its usage; True if the
    client had not asked (its usage event must then be cut). `stream_options`
    is an object or null here, its `include_usage` a boolean or null
    (app/router/body_fields.py refused any other form)."""
    opts = body.get("stream_options")
    if opts is None:
        opts = {}
    if not isinstance(opts, dict) or opts.get("include_usage") is True:
        return False
    body["stream_options"] = opts | {"include_usage": True}
    return True


# What a client's body that names no `stream_options` ends with once it asks
# for usage: a member appended to its JSON object.
_ASK_USAGE = b',"stream_options":{"include_usage":true}}'
_SPACE = b" \t\r\n"  # the whitespace JSON allows between tokens


def usage_asked_in(raw: bytes) -> bytes | None:
    """The client's own bytes asking for the stream's usage as well, for a
    body whose object names no `stream_options` (the caller knows: it
    parsed it): the member appended before its closing brace, the rest of
    the client's bytes sent as they came, with no encode of the whole body
    per stream, which grows with the prompt. None where it cannot append
    (not UTF-8 JSON opened and closed by a brace): the caller encodes."""
    body = raw.rstrip(_SPACE)
    if not (raw.startswith(b"{") and body.endswith(b"}")):
        return None
    inner = body[:-1].rstrip(_SPACE)
    return None if inner == b"{" else inner + _ASK_USAGE


def reservation(body: dict[str, Any], size: int, completion_default: int,
                completes: bool = True) -> int:
    """The most tokens a request can cost a provider: what a spill reserves
    from its key's external budget until its answer says what it cost
    (docs/design/catalog.md, "Spill-over").

    The prompt is bounded by `size`, the body's length in bytes as the
    client sent it (UTF-8 JSON, where an escape is never shorter than the
    character it stands for): a tokenizer's token covers at least one byte
    of text, and the JSON around each message outnumbers the tokens a chat
    template adds to it. An estimate (characters / 4) can fall short of the
    count, and a reservation short of its answer lets a budget be passed by
    the difference on every spill in flight; the bound costs reserving
    more than is spent, given back when the answer ends. Not bounded:
    images and audio, which a provider counts by their pixels and seconds.
    The completion: the request's own limit (the largest given), or
    `completion_default` where it names none, times its choices (`n`,
    `best_of`); none where it `completes` nothing (embeddings)."""
    if not completes:
        return size
    given = [v for k in _COMPLETION_LIMITS if (v := _count(body.get(k))) is not None]
    choices = max(_count(body.get("n")) or 1, _count(body.get("best_of")) or 1)
    return size + min(choices, _MAX_CHOICES) * (max(given) if given else completion_default)


def _count(value: object) -> int | None:
    """An integer field's value when it is one >= 1 (app/router/body_fields.py
    refuses other forms of `n`, `max_tokens`, `max_completion_tokens`)."""
    return value if type(value) is int and value >= 1 else None
