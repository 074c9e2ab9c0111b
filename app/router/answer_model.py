"""A provider's answer under the catalog's name
(docs/design/catalog.md, "Spill-over" and "External models"): the provider
names its model
in every answer and stream chunk (`"model": "gpt-4o-mini-2024-07-18"`); the
client of an external model, or of a request spilled to one, gets the
catalog name instead, as our engines answer it (vLLM's
--served-model-name). Only those answers are parsed for this; others pass
untouched."""

from __future__ import annotations

import json
from typing import Any

from app.router import sse
from app.router.published import Endpoint


def answer_name(ep: Endpoint, model: str) -> str | None:
    """The name an answer from `ep` for catalog model `model` must carry
    instead of the one its engine gives: `model`, for an external model's
    provider (it names its own); None for our engines, which name the
    catalog's already, and for a LoRA adapter (asked by its own name)."""
    return model if ep.upstream_model and not ep.adapter else None


def renamed_answer(answer: Any, body: bytes, name: str) -> bytes:
    """`body` (whose JSON is `answer`) with its top-level `model` set to `name`."""
    if not isinstance(answer, dict) or answer.get("model", name) == name:
        return body
    return json.dumps(answer | {"model": name}).encode()


def _renamed(obj: dict[str, Any], name: str) -> dict[str, Any] | None:
    """`obj` (an event's data) naming `name`: at its top (chat and text
    completions), or in its `response` (the Responses API's events); None
    when it names no other model."""
    if obj.get("model", name) != name:
        return obj | {"model": name}
    inner = obj.get("response")
    if isinstance(inner, dict) and inner.get("model", name) != name:
        return obj | {"response": inner | {"model": name}}
    return None


def renamed_events(chunk: bytes, name: str) -> bytes:
    """Whole SSE events with each data object's `model` set to `name` (a
    Responses API event's, in its `response`)."""
    if chunk.find(b'"model"') < 0:  # find, not `in` (sse.whole_events says why)
        return chunk
    out: list[bytes] = []
    for event, end in sse.events(chunk):
        lines = event.splitlines()
        data = [line for line in lines if line.startswith(b"data:")]
        if len(data) == 1 and data[0].find(b'"model"') >= 0:
            try:
                obj = json.loads(data[0][5:])
            except (ValueError, UnicodeDecodeError):
                obj = None
            fixed = _renamed(obj, name) if isinstance(obj, dict) else None
            if fixed is not None:
                said = b"data: " + json.dumps(fixed).encode()
                event = b"\n".join(said if line is data[0] else line for line in lines)
        out += [event, end]
    return b"".join(out)
