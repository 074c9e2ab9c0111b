"""An overflow's answer under the model's own name (docs/architecture.md,
Catalog, *Spill-over*): the provider names its model in every answer and
stream chunk (`"model": "gpt-4o-mini-2024-07-18"`); a spilled request's
client gets the catalog name instead, as our engines answer it. Only spilled
answers are parsed for this; others pass untouched."""

from __future__ import annotations

import json
import re
from typing import Any

_EVENT_SPLIT = re.compile(rb"(\r\n\r\n|\n\n|\r\r)")


def renamed_answer(answer: Any, body: bytes, name: str) -> bytes:
    """`body` (whose JSON is `answer`) with its top-level `model` set to `name`."""
    if not isinstance(answer, dict) or answer.get("model", name) == name:
        return body
    return json.dumps(answer | {"model": name}).encode()


def renamed_events(chunk: bytes, name: str) -> bytes:
    """Whole SSE events with each data object's `model` set to `name`."""
    if b'"model"' not in chunk:
        return chunk
    parts = _EVENT_SPLIT.split(chunk)
    out: list[bytes] = []
    for event, end in zip(parts[0::2], [*parts[1::2], b""], strict=True):
        lines = event.splitlines()
        data = [line for line in lines if line.startswith(b"data:")]
        if len(data) == 1 and b'"model"' in data[0]:
            try:
                obj = json.loads(data[0][5:])
            except (ValueError, UnicodeDecodeError):
                obj = None
            if isinstance(obj, dict) and obj.get("model", name) != name:
                fixed = b"data: " + json.dumps(obj | {"model": name}).encode()
                event = b"\n".join(fixed if line is data[0] else line for line in lines)
        out += [event, end]
    return b"".join(out)
