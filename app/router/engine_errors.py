"""An engine's 500 that the client's parameters caused, told from a failure.

llama-cpp-python's server (0.3.36) answers *every* exception raised while it
serves a request as `500 {"error": {"message": str(exc), "type":
"internal_server_error", "param": null, "code": null}}`
(llama_cpp/server/errors.py), including those the request itself caused:

* a field its request model does not take, e.g. OpenAI's
  `response_format: {"type": "json_schema", ...}` (it knows "text" and
  "json_object" only) or `"temperature": "hot"`: FastAPI's validation error,
  whose text is `N validation error(s):` then each error's repr (`'loc'`,
  `'msg'`, the client's `'input'`), then the server's source file and line
  (`File "/.../llama_cpp/server/app.py", line 376`);
* a `tool_choice` naming no tool of `tools`: `Tool choice 'NAME' not found
  in tools.`;
* embeddings of a model its server did not start for them (the
  quickstart's SmolLM2): answered 404 `unsupported_endpoint`, as a route it
  does not serve is.

Those are answered 400 `invalid_request_error`, the field named where the
engine named it, and nothing else of the engine's text (no file paths, no
echo of the input); they are not retried on another replica (it would fail
the same way) nor count as a server error (the metric's code is 400) nor
cool the replica down. Any other 500 is the engine's failure and passes as
the engine wrote it. vLLM needs none of this: it answers 400 for what
it refuses. docs/design/errors.md.

Its server serves chat and text completions, embeddings and its
`/extras/` only: any other route (the Responses API, reranking, scoring,
speech to text) is FastAPI's bare `404 {"detail": "Not Found"}`, which
says nothing to an OpenAI client. That is answered 404 in OpenAI's shape,
naming the model, its engine and the API it does not serve (`not_served`).
"""

from __future__ import annotations

import json
import re
from typing import NamedTuple

from app.router.own_answers import Reply, error
from app.router.upstream import Response

# The most of an engine's error answer read: its errors are a few hundred bytes.
MAX_ERROR_ANSWER = 64 * 1024
# How long a message taken from the engine may be (a pydantic `msg`, a tool name).
_MAX_TOLD = 300

_VALIDATION = re.compile(r"\d+ validation errors?:")
_LOC = re.compile(r"'loc': \(([^)]*)\)")
_LOC_PART = re.compile(r"'([^'\\]*)'|(\d+)")
_MSG = re.compile(r"""'msg': (?:'((?:[^'\\]|\\.)*)'|"((?:[^"\\]|\\.)*)")""")
_TOOL_CHOICE = re.compile(r"Tool choice '(.{0,200})' not found in tools\.")
# /v1/embeddings of a model its server did not start with `--embedding true`.
_NOT_AN_EMBEDDER = "Llama model must be created with embedding=True to call this method"


class Fault(NamedTuple):
    """The client's fault: what it is told, as a Reply, and in words."""

    reply: Reply
    message: str


async def read_capped(upstream: Response) -> bytes | None:
    """The error answer whole, or None past `MAX_ERROR_ANSWER` bytes."""
    raw = b""
    while chunk := await upstream.readany():
        raw += chunk
        if len(raw) > MAX_ERROR_ANSWER:
            return None
    return raw


def client_fault(answer: bytes | None, model: str) -> Fault | None:
    """The 4xx to answer instead of llama-cpp-python's 500 `answer` for a
    request for `model`, when the request caused it; None for an engine
    failure."""
    if answer is None:
        return None
    try:
        parsed = json.loads(answer)
    except (ValueError, UnicodeDecodeError):
        return None
    err = parsed.get("error") if isinstance(parsed, dict) else None
    if not isinstance(err, dict) or err.get("type") != "internal_server_error":
        return None
    text = err.get("message")
    if not isinstance(text, str):
        return None
    if _VALIDATION.match(text):
        return _invalid(*_first_error(text))
    tool = _TOOL_CHOICE.fullmatch(text)
    if tool is not None:
        return _invalid("tool_choice", f"no tool named '{tool.group(1)}' in 'tools'")
    if text == _NOT_AN_EMBEDDER:
        message = (f"The model '{model}' is served by llama.cpp as a text generator, not "
                   "started for embeddings (its server's --embedding): use "
                   "/v1/chat/completions or /v1/completions with it, or an embedding model.")
        return Fault(error(404, message, "invalid_request_error", "unsupported_endpoint",
                           "model"), message)
    return None


# What a client calls the routes the gateway passes on (passthrough.py).
_APIS = (("/v1/responses", "the Responses API"), ("/v1/audio/", "speech to text"),
         ("/v1/rerank", "reranking"), ("/rerank", "reranking"), ("/v2/rerank", "reranking"),
         ("/v1/score", "scoring"), ("/score", "scoring"))


def not_served(target: str, model: str) -> Reply:
    """The 404 to answer instead of llama-cpp-python's bare one for
    `target` (the path and query asked of it). Its server raises no 404 of
    its own (llama_cpp/server/app.py): a 404 is FastAPI's, for a path it
    has no route for, so its body need not be read."""
    path = target.partition("?")[0]
    api = next((name for prefix, name in _APIS if path.startswith(prefix)), path)
    return error(404, f"The model '{model}' is served by llama.cpp (llama-cpp-python's "
                 f"server), which does not serve {api}: use /v1/chat/completions or "
                 "/v1/completions with it.", "invalid_request_error", "unsupported_endpoint",
                 "model")


def _first_error(text: str) -> tuple[str | None, str]:
    """(the field, what is wrong with it) of a validation error's first entry."""
    loc = _LOC.search(text)
    param: str | None = None
    if loc is not None:
        parts = [a or b for a, b in _LOC_PART.findall(loc.group(1))]
        if parts and parts[0] == "body":
            parts = parts[1:]
        param = ".".join(parts) or None
    found = _MSG.search(text)
    what = (found.group(1) or found.group(2)) if found is not None else ""
    return param, what[:_MAX_TOLD] or "a value the engine does not take"


def _invalid(param: str | None, what: str) -> Fault:
    message = (f"Invalid '{param}': {what}." if param
               else f"Invalid request: {what}.")
    message = "The engine serving this model refused a parameter. " + message
    return Fault(error(400, message, "invalid_request_error", "invalid_parameter", param),
                 message)
