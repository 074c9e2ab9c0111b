"""Answers the router writes itself: errors in OpenAI's shape, whole bodies,
the error event that ends a broken stream, the cutting of a stream into
whole events."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from app.router import sse
from app.router.direct_body import DirectBody

Message = MutableMapping[str, Any]
Send = Callable[[Message], Awaitable[None]]

# How an SSE event ends (the spec allows all three line endings; vLLM writes
# "\n\n", sse-starlette, which llama-cpp-python uses, "\r\n\r\n").
class Reply(Exception):
    """Ends a request early with an error answer."""

    def __init__(self, status: int, body: bytes,
                 headers: list[tuple[bytes, bytes]] | None = None) -> None:
        self.status = status
        self.body = body
        self.headers = headers or []


def openai_error_body(
    message: str, type_: str, code: str | None = None, param: str | None = None
) -> bytes:
    """An error in OpenAI's shape, which its client libraries parse."""
    return json.dumps(
        {"error": {"message": message, "type": type_, "param": param, "code": code}}
    ).encode()


def error(status: int, message: str, type_: str, code: str | None = None,
          param: str | None = None, retry_after: int | None = None) -> Reply:
    headers = [(b"retry-after", str(retry_after).encode())] if retry_after else None
    return Reply(status, openai_error_body(message, type_, code, param), headers)


async def send_whole(send: Send, status: int, body: bytes,
                     extra: list[tuple[bytes, bytes]] | None = None,
                     content_type: bytes = b"application/json",
                     direct: DirectBody | None = None) -> None:
    """A whole answer with its length (`extra`: more headers, lower-case).
    With the server's `direct` (and `send` its own), it is written in one
    write without its two ASGI messages (DirectBody.answer), or else its
    head and body are gathered into one write (DirectBody.gather)."""
    headers = [(b"content-type", content_type), (b"content-length", str(len(body)).encode())]
    if extra:
        headers += extra
    if direct is not None:
        if direct.answer(status, headers, body):
            return
        direct.gather()
    try:
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})
    finally:
        if direct is not None:
            direct.flush()


def error_event(message: str, code: str) -> bytes:
    """The last event of a stream that did not end well, and no `[DONE]`.

    OpenAI's Python SDK raises `APIError` on an event whose data has an
    "error" key (openai/_streaming.py), where a stream that merely stopped
    would read as a short but complete answer.
    """
    return sse.event(openai_error_body(message, "server_error", code))


async def end_badly(send: Send, framed: bool, message: str, code: str) -> None:
    if framed:
        await send({"type": "http.response.body", "body": error_event(message, code),
                    "more_body": False})
    # Else (a compressed or non-SSE body) the response is left incomplete:
    # the server closes the connection without the final chunk, which every
    # HTTP client reports as an error rather than a short answer.


async def keep_alive(send: Send, model: str, every: float = 5.0) -> None:
    """SSE comments (ignored by every SSE client) while a stream is held."""
    while True:
        await send({"type": "http.response.body", "more_body": True,
                    "body": f": waiting for a replica of {model} to start\n\n".encode()})
        await asyncio.sleep(every)


# What a request still open at the end of the gateway's grace period is told
# (docs/design/stopping.md): another gateway can take it again.
STOPPING = "The gateway stopped before the answer was complete; retry."


def stopping() -> Reply:
    return error(503, STOPPING, "service_unavailable", "gateway_stopping", retry_after=1)
