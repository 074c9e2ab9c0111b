"""The request fields the gateway acts on, type-checked at the edge.

The gateway decides things from a few fields of the client's body: whether
to relay a stream (`stream`), whether to ask the engine for the stream's
usage (`stream_options.include_usage`), which model (`model`). Engines are
laxer: vLLM's and llama-cpp-python's request models are pydantic in lax
mode, so `"stream": 1` or `"stream": "true"` streams there while the gateway,
which tests `is True`, takes the answer for a plain one and charges its key
nothing. Each field the gateway relies on must therefore have the one form
the gateway reads, or the request is refused before it reaches an engine:
a 400 in OpenAI's shape naming the field (`"param": "stream"`), with
OpenAI's own codes (`invalid_type`, `integer_below_min_value`).
docs/design/security.md, "A client's fields, counted whatever their form".

`null` is accepted wherever OpenAI accepts it (the field then means its
default). A handful of dict lookups and identity tests: under a
microsecond per request (docs/design/security.md gives the measure).
"""

from __future__ import annotations

from typing import Any

from app.router.own_answers import Reply, error

# Fields whose value must be an integer >= 1, or null.
_COUNTS = ("n", "max_tokens", "max_completion_tokens")


def checked_model(body: dict[str, Any]) -> str:
    """The body's `model`, once every field the gateway relies on has the
    type it reads; a 400 Reply naming the first that does not."""
    model = body.get("model")
    if type(model) is not str:
        if model is None:
            raise error(400, "You must provide a model parameter.",
                        "invalid_request_error", param="model")
        raise _wrong_type("model", "a string", model)
    if not model:
        raise error(400, "You must provide a model parameter.",
                    "invalid_request_error", param="model")
    stream = body.get("stream")
    if stream is not None and stream is not True and stream is not False:
        raise _wrong_type("stream", "a boolean", stream)
    for name in _COUNTS:
        value = body.get(name)
        if value is not None:
            if type(value) is not int:  # bool is an int subclass: refused too
                raise _wrong_type(name, "an integer", value)
            if value < 1:
                raise error(400, f"Invalid '{name}': integer below minimum value. Expected "
                            f"a value >= 1, but got {value} instead.",
                            "invalid_request_error", "integer_below_min_value", name)
    if body.get("grammar") is not None:
        # llama-cpp-python's own extension: a malformed grammar makes its
        # server process exit, stopping the replica for every client
        # (docs/design/security.md). Structured output goes through
        # `response_format`.
        raise error(400, "The 'grammar' parameter is not accepted by this gateway; use "
                    "'response_format' for structured output.", "invalid_request_error",
                    "unsupported_parameter", "grammar")
    opts = body.get("stream_options")
    if opts is not None:
        if type(opts) is not dict:
            raise _wrong_type("stream_options", "an object", opts)
        usage = opts.get("include_usage")
        if usage is not None and usage is not True and usage is not False:
            raise _wrong_type("stream_options.include_usage", "a boolean", usage)
    return model


def _wrong_type(param: str, expected: str, value: object) -> Reply:
    return error(400, f"Invalid type for '{param}': expected {expected}, but got "
                 f"{_json_type(value)} instead.", "invalid_request_error", "invalid_type",
                 param)


def _json_type(value: object) -> str:
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a decimal"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    if isinstance(value, dict):
        return "an object"
    return "null"
