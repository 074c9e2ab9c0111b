"""The `usage` of a whole JSON answer, read without decoding the answer.

A whole (not streamed) answer is read for its usage only: its text, often
kilobytes, is passed on as it came. Decoding it all costs about 4 us a
kilobyte; finding its top-level `"usage"` member and decoding only that and
what follows it costs a few us whatever the answer's length. The member is
taken only when that is provably the answer's own (top-level) usage: the
key is a key (after `{` or `,`), its value decodes, and the rest after it
decodes as the members of one object that closes at the answer's end, so
the object holding the usage is the answer itself. Anything else (no usage
there, a nested `usage` last, a tail longer than the answer's first half,
bytes that do not decode) falls back to decoding the whole answer. What
comes before the member is not checked beyond its first byte: an answer
malformed there still has its usage counted, as its engine reported it.
docs/design/client-keys.md, "Usage".
"""

from __future__ import annotations

import json
from typing import Any

_KEY = b'"usage"'
_SPACE = b" \t\r\n"
_DECODER = json.JSONDecoder()


def _tail_usage(body: bytes) -> tuple[bool, Any]:
    """(True, the top-level usage) when found without the whole decode."""
    at = body.rfind(_KEY)
    if at <= 0 or not body.lstrip(_SPACE).startswith(b"{"):
        return False, None
    before = body[:at].rstrip(_SPACE)
    if not before.endswith((b"{", b",")):
        return False, None  # not a key: inside a value, or an escaped quote
    rest = body[at + len(_KEY):].lstrip(_SPACE)
    if not rest.startswith(b":") or len(rest) * 2 > len(body):
        return False, None
    try:
        text = rest[1:].decode().lstrip()
        usage, end = _DECODER.raw_decode(text)
    except (ValueError, UnicodeDecodeError):
        return False, None
    after = text[end:].strip()
    if after == "}":
        return True, usage
    if not after.startswith(",") or not after[1:].lstrip().startswith('"'):
        return False, None
    try:  # the rest must be members of the same object, closing at the end
        rest_members = json.loads("{" + after[1:])
    except ValueError:
        return False, None
    return (True, usage) if isinstance(rest_members, dict) else (False, None)


def answer_usage(body: bytes) -> Any:
    """The answer's top-level `usage` value; None when it has none or is
    not a JSON object."""
    found, usage = _tail_usage(body)
    if found:
        return usage
    try:
        answer = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return None
    return answer.get("usage") if isinstance(answer, dict) else None
