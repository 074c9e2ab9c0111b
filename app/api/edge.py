"""What every request outside `/v1` passes before FastAPI sees it
(docs/design/security.md, "Before a client is authenticated").

FastAPI reads and parses a route's whole body before its dependencies run,
so the bearer checks in `auth.py` and `agent.py` came after a client had
made the gateway hold (and parse) whatever it sent: one unauthenticated
100 MB POST grew a gateway by half a GB. Here, at the ASGI level:

1. the token, from the headers alone: the admin token for `/admin`, the
   node's token for `/agent/v1/nodes/{node}` (401 otherwise, nothing read);
2. the body, read to its cap (`Content-Length` over it: 413 at once; a
   chunked body: 413 as soon as it passes), then handed to FastAPI.

The routes' own checks still run after these (they also answer what this
does not decide, such as a gateway whose state has not loaded).
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from app.api.errors import problem
from app.control.keys import SecretRing
from app.router.request_read import ClientGone, TooLarge, receive_body

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

_AGENT = "/agent/v1/nodes/"


class Edge:
    """The checks above, for one gateway's tokens and caps."""

    def __init__(self, admin_token: str, secrets: SecretRing, admin_max_body: int,
                 agent_max_body: int) -> None:
        self._admin_token = admin_token.encode()
        # During a rotation a node's token of the previous secret is taken too
        # (Security, "Rotating the shared secret").
        self._secrets = secrets
        self._admin_max = admin_max_body
        self._agent_max = agent_max_body

    async def admit(self, scope: Scope, receive: Receive, send: Send) -> Receive | None:
        """A `receive` that replays the body read, or None when this has
        answered the request itself (401, 413, or the client left)."""
        path: str = scope["path"]
        token = _bearer(scope)
        cap = self._admin_max
        refused = ""
        if path == "/admin" or path.startswith("/admin/"):
            if not token:
                refused = "send 'Authorization: Bearer <admin token>'"
            elif not hmac.compare_digest(token.encode(), self._admin_token):
                refused = "wrong admin token"
        elif path.startswith(_AGENT):
            cap = self._agent_max
            node = path[len(_AGENT):].split("/", 1)[0]
            if self._secrets.check_node_token(node, token) is None:
                refused = f"not a valid agent token for node {node!r}"
        if refused:
            await _answer(scope, receive, send, 401, "Unauthorized", refused)
            return None
        declared = _content_length(scope)
        if declared is not None and declared > cap:
            await _answer(scope, receive, send, 413, "Request body too large",
                          f"{declared} bytes; this route takes at most {cap}")
            return None
        try:
            body = await receive_body(receive, cap)
        except ClientGone:
            return None
        except TooLarge:
            await _answer(scope, receive, send, 413, "Request body too large",
                          f"over {cap} bytes, the most this route takes")
            return None
        return _replay(body, receive)


def _replay(body: bytes, receive: Receive) -> Receive:
    """The body once, then the client's own `receive` (for its disconnect)."""
    sent = False

    async def replayed() -> Message:
        nonlocal sent
        if sent:
            return await receive()
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    return replayed


def _bearer(scope: Scope) -> str:
    """The first Authorization header's bearer token, "" if none."""
    for name, value in scope["headers"]:
        if name == b"authorization":
            scheme, _, rest = value.decode("latin-1").partition(" ")
            return rest.strip() if scheme.lower() == "bearer" else ""
    return ""


def _content_length(scope: Scope) -> int | None:
    for name, value in scope["headers"]:
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None  # the server's parser refuses such a request anyway
    return None


async def _answer(scope: Scope, receive: Receive, send: Send, status: int, title: str,
                  detail: str) -> None:
    """Problem JSON, and `Connection: close`: the body left unread is not
    read to reach a next request on the connection; it is dropped with it."""
    response = problem(status, title, detail)
    response.headers["connection"] = "close"
    await response(scope, receive, send)
