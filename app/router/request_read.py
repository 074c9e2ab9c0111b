"""A /v1 request's intake before its model is known: headers read, body
read under its cap, JSON parsed (app/router/proxy.py uses them; so does
passthrough.py)."""

from __future__ import annotations

import json
import re
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from app.router.access import Exchange
from app.router.own_answers import error

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]

# Largest request body accepted. Chat requests with long contexts and images
# as data URLs run to a few MiB; more than this is a mistake or an attack.
MAX_BODY = 32 * 1024 * 1024


class ClientGone(Exception):
    """The client disconnected before its request was read."""



def headers_of(scope: Scope, ex: Exchange) -> tuple[str, str | None]:
    """The client's bearer token ("" if none) and the session it names
    (`X-Session-Id`), if any; its request id and trace context go to `ex`.
    Its `Accept-Encoding` is not passed on: the engine is asked for identity
    (relay.py), so that every answer's usage can be read."""
    authorization: bytes | None = None
    session: str | None = None
    rid = traceparent = tracestate = None
    for name, value in scope["headers"]:
        if name == b"authorization":
            if authorization is None:  # the first one counts
                authorization = value
        elif name == b"x-session-id":
            session = value.decode("latin-1")[:256]
        elif name == b"x-request-id":
            rid = value
        elif name == b"traceparent":
            traceparent = value
        elif name == b"tracestate":
            tracestate = value
    ex.take_headers(rid, traceparent, tracestate)
    if authorization is None:
        return "", session
    scheme, _, rest = authorization.decode("latin-1").partition(" ")
    return (rest.strip() if scheme.lower() == "bearer" else ""), session


def has_body(scope: Scope) -> bool:
    for name, value in scope["headers"]:
        if name == b"transfer-encoding" or (name == b"content-length" and value != b"0"):
            return True
    return False


class TooLarge(Exception):
    """The body went past its cap while it was read."""


async def receive_body(receive: Receive, cap: int) -> bytes:
    """The whole body of an ASGI request, read up to `cap` bytes: ClientGone
    when the client left, TooLarge past the cap (also app/api/edge.py's)."""
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientGone
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > cap:
            raise TooLarge
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


async def read_body(receive: Receive) -> bytes:
    try:
        return await receive_body(receive, MAX_BODY)
    except TooLarge:
        raise error(413, f"The request body is larger than {MAX_BODY} bytes.",
                    "invalid_request_error") from None


# The C scanner `json.loads` ends in, called straight: a body that starts
# with `{` and is UTF-8 skips the wrappers' encoding sniff, decode and
# whitespace passes (1.0 against 2.7 us for a small chat request). Anything
# else, and any body the scanner refuses, goes to `json.loads`, whose answer
# (the value, or the error the client is told) is the one kept.
# (The decoder's `scan_once` is set in its __init__, unknown to the stubs.)
_scan: Callable[[str, int], tuple[Any, int]] = json.JSONDecoder().scan_once  # type: ignore[attr-defined]
_space = re.compile(r"[ \t\n\r]*").match


def _loads(raw: bytes) -> Any:
    if raw[:1] == b"{":
        try:
            text = raw.decode("utf-8", "surrogatepass")  # as json.loads decodes UTF-8
            value, end = _scan(text, 0)
        except (ValueError, StopIteration):
            pass  # json.loads says what is wrong
        else:
            if end == len(text) or _space(text, end).end() == len(text):  # type: ignore[union-attr]
                return value
    return json.loads(raw)


def parse_json(raw: bytes) -> dict[str, Any]:
    try:
        body = _loads(raw)
    except RecursionError:  # the C parser's guard: ~1,000 levels of [ or {
        raise error(400, "The request body is nested too deeply.",
                    "invalid_request_error") from None
    except ValueError as exc:
        # Bad JSON, bad UTF-8, or an integer past Python's digit limit
        # (sys.get_int_max_str_digits(), 4,300): all the client's to fix.
        raise error(400, f"The request body is not valid JSON: {exc}",
                    "invalid_request_error") from None
    if not isinstance(body, dict):
        raise error(400, "The request body must be a JSON object.", "invalid_request_error")
    return body

