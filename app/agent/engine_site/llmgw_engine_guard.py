"""The engine key on every path of a vLLM engine's port
(docs/design/security.md, "The engine's port").

vLLM's own `--api-key` (VLLM_API_KEY) guards paths under `/v1` only, while
the same port serves inference and control elsewhere (`/invocations`,
`/pooling`, `/score`, `/tokenize`, `/start_profile`, `/sleep`...) to anyone
on the fleet's network. The agent starts vLLM with
`--middleware llmgw_engine_guard.EngineKeyMiddleware`: vLLM imports that
class and adds it with `app.add_middleware`, so it sees every request
before any route does, and answers 401 to one without the key.

Deny by default: only `OPEN_PATHS` answer without the key, matched exactly
(not as prefixes), so a route vLLM adds in a later version is guarded
without a change here. Standard library only: this module is imported by
the engine's Python, which does not have llmgw (app/agent/engine_site).
"""

from __future__ import annotations

import hmac
import os
import sys
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

# The paths that answer without the key. The agent's liveness probe asks
# /health and the gateways' load poll /metrics (it sends the key, but an
# operator's Prometheus may not); /ping is vLLM's SageMaker health check,
# the same answer as /health. Neither runs the model nor changes anything.
# /version (a version number helps an attacker pick an exploit) and
# /docs, /openapi.json are guarded: nothing of llmgw needs them.
OPEN_PATHS = frozenset({"/health", "/metrics", "/ping"})

_UNAUTHORIZED = b'{"error": "Unauthorized"}'  # vLLM's own /v1 answer, same shape
# WebSocket close code "policy violation": a server closing before accepting
# answers the handshake with HTTP 403.
_WS_POLICY_VIOLATION = 1008


class EngineKeyMiddleware:
    """A pure ASGI middleware: an HTTP request or WebSocket handshake on any
    path but `OPEN_PATHS` must carry `Authorization: Bearer <key>`, the key
    being VLLM_API_KEY from the engine's environment (read once, when vLLM
    builds its app). Without a key in the environment every guarded path is
    refused: a missing key never opens the engine. Lifespan events pass.
    """

    def __init__(self, app: ASGIApp, key: str | None = None) -> None:
        self.app = app
        given = os.environ.get("VLLM_API_KEY", "") if key is None else key
        self._key = given.encode()
        if not self._key:
            print("llmgw_engine_guard: VLLM_API_KEY is not set: every path but "
                  f"{', '.join(sorted(OPEN_PATHS))} is refused", file=sys.stderr, flush=True)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind == "lifespan" or scope.get("path") in OPEN_PATHS or self.allowed(scope):
            await self.app(scope, receive, send)
        elif kind == "http":
            await send({"type": "http.response.start", "status": 401, "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(_UNAUTHORIZED)).encode()),
                (b"www-authenticate", b"Bearer")]})
            await send({"type": "http.response.body", "body": _UNAUTHORIZED})
        elif kind == "websocket":
            await receive()  # websocket.connect, before the handshake is refused
            await send({"type": "websocket.close", "code": _WS_POLICY_VIOLATION})
        else:  # a kind of connection this guard does not know: never let it through
            raise RuntimeError(f"llmgw_engine_guard: unexpected ASGI scope type {kind!r}")

    def allowed(self, scope: Scope) -> bool:
        """Whether `scope` (http or websocket) carries exactly one
        Authorization header, `Bearer <the key>` (scheme in any case),
        compared in constant time."""
        if scope["type"] not in ("http", "websocket") or not self._key:
            return False
        values = [v for k, v in scope.get("headers", ()) if k.lower() == b"authorization"]
        if len(values) != 1:
            return False
        scheme, _, token = bytes(values[0]).partition(b" ")
        return scheme.lower() == b"bearer" and hmac.compare_digest(token, self._key)
