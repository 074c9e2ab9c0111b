"""The OpenAI-compatible surface: `/v1`, forwarded to ready replicas.

Per request: check the client key, resolve the model name or alias, choose
a replica (table.choose), forward with that replica's engine key, stream the
answer back unbuffered. No step waits on the store.

aiohttp is the upstream client: side by side on one core here, a proxy with
httpx as its client gave 410-460 req/s at 64 concurrent requests and broke
SSE streams under load, against 6,000-8,000 with aiohttp (FINDINGS.md).

A request is retried on another replica only when the failure happened
before any byte reached the client (connection refused, reset before the
response, or a 502/503 from the engine); after that, the client sees the
failure, since replaying a half-sent generation would duplicate output.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from app.router.table import Endpoint, KeyGrant, Lease, RouteTable

logger = logging.getLogger(__name__)

# Upstream statuses that mean "this replica cannot take it now, try another".
_RETRY_STATUSES = {502, 503}
_MAX_ATTEMPTS = 3


class _Retry(Exception):
    """This replica cannot take the request now; another may."""


def openai_error(
    status: int, message: str, type_: str, code: str | None = None, param: str | None = None
) -> JSONResponse:
    """An error in OpenAI's shape, which its client libraries parse."""
    return JSONResponse(
        {"error": {"message": message, "type": type_, "param": param, "code": code}},
        status_code=status,
    )


class Proxy:
    def __init__(
        self,
        table: RouteTable,
        hash_key: Any,
        connect_timeout: float,
        request_timeout: float,
    ) -> None:
        self._table = table
        self._hash_key = hash_key
        self._timeout = aiohttp.ClientTimeout(
            total=request_timeout, sock_connect=connect_timeout
        )
        self._session: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        # limit=0: the engines, not this pool, bound concurrency.
        connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=30)
        self._session = aiohttp.ClientSession(
            connector=connector, timeout=self._timeout, auto_decompress=False
        )

    async def stop(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    # --- request handling ----------------------------------------------------------

    def authenticate(self, request: Request) -> KeyGrant | JSONResponse:
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            return openai_error(
                401, "Missing API key: send 'Authorization: Bearer <key>'.",
                "invalid_request_error", "invalid_api_key",
            )
        grant = self._table.grant(self._hash_key(token.strip()))
        if grant is None:
            return openai_error(401, "Incorrect API key provided.",
                                "invalid_request_error", "invalid_api_key")
        return grant

    async def list_models(self, request: Request) -> Response:
        grant = self.authenticate(request)
        if isinstance(grant, JSONResponse):
            return grant
        data = []
        for entry in self._table.catalog():
            if not grant.allows(entry.name):
                continue
            for ident in (entry.name, *entry.aliases):
                data.append({"id": ident, "object": "model", "created": entry.created,
                             "owned_by": "llmgw", "root": entry.name})
        return JSONResponse({"object": "list", "data": data})

    async def forward(self, request: Request, path: str) -> Response:
        grant = self.authenticate(request)
        if isinstance(grant, JSONResponse):
            return grant
        raw = await request.body()
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            return openai_error(400, f"The request body is not valid JSON: {exc}",
                                "invalid_request_error")
        if not isinstance(body, dict):
            return openai_error(400, "The request body must be a JSON object.",
                                "invalid_request_error")
        requested = body.get("model")
        if not isinstance(requested, str) or not requested:
            return openai_error(400, "You must provide a model parameter.",
                                "invalid_request_error", param="model")
        name = self._table.resolve(requested)
        if name is None or not grant.allows(name):
            return openai_error(
                404, f"The model '{requested}' does not exist or you do not have access to it.",
                "invalid_request_error", "model_not_found", "model",
            )
        body["model"] = name  # engines serve the catalog name, not the alias
        payload = json.dumps(body).encode()
        return await self._send(name, path, payload, stream=body.get("stream") is True)

    async def _send(self, model: str, path: str, payload: bytes, stream: bool) -> Response:
        assert self._session is not None, "Proxy.start() was not awaited"
        tried: set[str] = set()
        last_error = "no ready replica"
        for _ in range(_MAX_ATTEMPTS):
            ep = self._table.choose(model, tried)
            if ep is None:
                break
            tried.add(ep.replica_id)
            taken = self._table.acquire(ep)
            lease: Lease | None = taken
            try:
                upstream = await self._session.post(
                    ep.url + path, data=payload,
                    headers={"Authorization": f"Bearer {ep.key}",
                             "Content-Type": "application/json"},
                )
                if upstream.status in _RETRY_STATUSES:
                    upstream.release()
                    raise _Retry(f"answered {upstream.status}")
                if upstream.status == 401:
                    # The engine refused *our* key: a gateway/engine mismatch
                    # (another secret?), not the client's fault.
                    upstream.release()
                    logger.error("replica %s refused the engine key", ep.replica_id)
                    return openai_error(502, f"replica {ep.replica_id} refused the gateway",
                                        "server_error", "upstream_auth")
                if stream:
                    relay, lease = _Relay(upstream, taken, ep), None  # it releases the lease
                    return relay
                # Read whole: nothing has reached the client yet, so a failure
                # here is still retried, and the answer keeps its length.
                body = await upstream.read()
                return Response(body, status_code=upstream.status,
                                media_type=upstream.headers.get("Content-Type"),
                                headers={"X-Llmgw-Replica": ep.replica_id})
            except (aiohttp.ClientError, TimeoutError, _Retry) as exc:
                last_error = f"replica {ep.replica_id} failed ({exc or type(exc).__name__})"
                logger.warning("%s; trying another", last_error)
            finally:
                if lease is not None:  # also on cancellation (the client left)
                    lease.release()
        return openai_error(
            503, f"No replica of '{model}' can take the request now: {last_error}.",
            "service_unavailable", "no_ready_replica",
        )

    def routes(self) -> APIRouter:
        r = APIRouter(prefix="/v1", tags=["OpenAI API"])

        @r.get("/models", summary="List the models this key may use")
        async def models(request: Request) -> Response:
            return await self.list_models(request)

        for path in ("/chat/completions", "/completions", "/embeddings"):
            r.add_api_route(path, self._handler(path), methods=["POST"],
                            summary=f"OpenAI {path[1:]}, forwarded to a replica")
        return r

    def _handler(self, path: str) -> Any:
        async def handler(request: Request) -> Response:
            return await self.forward(request, "/v1" + path)

        return handler


class _Relay(StreamingResponse):
    """Streams the engine's bytes as they come (SSE included).

    The upstream response and the in-flight lease are released when the
    response ends, however it ends: also when the client left before the
    first chunk, where a generator's own `finally` would never run.
    """

    def __init__(self, upstream: aiohttp.ClientResponse, lease: Lease, ep: Endpoint) -> None:
        self._upstream = upstream
        self._lease = lease
        self._ep = ep
        super().__init__(
            self._chunks(),
            status_code=upstream.status,
            media_type=upstream.headers.get("Content-Type", "application/json"),
            headers={"X-Llmgw-Replica": ep.replica_id, "Cache-Control": "no-cache"},
        )

    async def _chunks(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self._upstream.content.iter_any():
                yield chunk
        except (aiohttp.ClientError, TimeoutError) as exc:
            # Bytes already reached the client: nothing to retry; end the stream.
            logger.warning("replica %s broke off mid-response: %s", self._ep.replica_id, exc)

    def _release(self) -> None:
        self._upstream.release()
        self._lease.release()

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._release()
