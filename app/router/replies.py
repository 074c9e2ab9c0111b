"""Answers the router writes itself: errors in OpenAI's shape, whole bodies,
and the error event that ends a broken stream."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

Message = MutableMapping[str, Any]
Send = Callable[[Message], Awaitable[None]]


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
                     content_type: bytes = b"application/json") -> None:
    """A whole answer with its length (`extra`: more headers)."""
    headers = [(b"content-type", content_type), (b"content-length", str(len(body)).encode())]
    if extra:
        headers += extra
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def error_event(message: str, code: str) -> bytes:
    """The last event of a stream that did not end well, and no `[DONE]`.

    OpenAI's Python SDK raises `APIError` on an event whose data has an
    "error" key (openai/_streaming.py), where a stream that merely stopped
    would read as a short but complete answer.
    """
    return b"data: " + openai_error_body(message, "server_error", code) + b"\n\n"
