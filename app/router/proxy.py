"""The OpenAI-compatible surface (`/v1`): a plain ASGI app, the hot path.

Per request: check the client key, resolve the model name or alias, choose
a replica (`RouteTable.choose`), forward with that replica's engine key, and
send the answer back: whole for a plain request, chunk by chunk for a
streamed one (SSE passes through unbuffered). No step waits on the store.

Why plain ASGI rather than FastAPI routes: measured with bench/proxy.py,
FastAPI's request objects, routing and per-response task groups cost the
gateway about 0.9 ms of CPU per plain request, against about 0.5 ms for a
bare proxy. The admin API, where that does not matter, stays on FastAPI.

aiohttp is the upstream client: side by side on one core here, a proxy with
httpx as its client gave 410-460 req/s at 64 concurrent requests and broke
SSE streams under load, against 6,000-8,000 with aiohttp (FINDINGS.md).

A request is retried on another replica only when nothing has reached the
client yet: the connection failed, the engine answered 502/503, or (plain
requests) the engine broke off mid-answer. After the first byte of a stream
the client sees the failure, since replaying a half-sent generation would
duplicate output.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any, Protocol

import aiohttp

from app.router.table import Endpoint, KeyGrant, RouteTable

logger = logging.getLogger(__name__)

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

# Upstream statuses that mean "this replica cannot take it now, try another".
_RETRY_STATUSES = {502, 503}
_MAX_ATTEMPTS = 3
# Largest request body accepted. Chat requests with long contexts and images
# as data URLs run to a few MiB; more than this is a mistake or an attack.
MAX_BODY = 32 * 1024 * 1024
_FORWARDED = {"/v1/chat/completions", "/v1/completions", "/v1/embeddings"}


SessionFactory = Callable[[aiohttp.ClientTimeout], aiohttp.ClientSession]


def default_session(timeout: aiohttp.ClientTimeout) -> aiohttp.ClientSession:
    """The upstream session a gateway uses: its own pool, our timeouts."""
    # limit=0: the engines, not this pool, bound concurrency.
    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=30)
    return aiohttp.ClientSession(connector=connector, timeout=timeout, auto_decompress=False)


class _Retry(Exception):
    """This replica cannot take the request now; another may."""


class RequestObserver(Protocol):
    """Told how each forwarded request ended. Metrics implement it; the
    router never imports them (it declares what it needs, here)."""

    def observe(self, model: str, status: int, seconds: float) -> None: ...


# The model label of a request whose model is unknown: client-chosen strings
# must not become label values (one time series per typo).
UNKNOWN_MODEL = "(unknown)"


class _ClientGone(Exception):
    """The client disconnected before its request was read."""


class _Reply(Exception):
    """Ends a request early with an error answer."""

    def __init__(self, status: int, body: bytes) -> None:
        self.status = status
        self.body = body


def openai_error_body(
    message: str, type_: str, code: str | None = None, param: str | None = None
) -> bytes:
    """An error in OpenAI's shape, which its client libraries parse."""
    return json.dumps(
        {"error": {"message": message, "type": type_, "param": param, "code": code}}
    ).encode()


def _error(status: int, message: str, type_: str, code: str | None = None,
           param: str | None = None) -> _Reply:
    return _Reply(status, openai_error_body(message, type_, code, param))


async def _send_json(send: Send, status: int, body: bytes,
                     extra: list[tuple[bytes, bytes]] | None = None) -> None:
    headers = [(b"content-type", b"application/json"),
               (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status,
                "headers": headers + (extra or [])})
    await send({"type": "http.response.body", "body": body})


class Proxy:
    """The ASGI app mounted at /v1 (see `main.create_app`).

    `session_factory` builds the upstream session in `start()` (given the
    timeouts) and is called once: a test passes its own (tracing, a custom
    connector) while the request path stays the same aiohttp client code.
    The proxy closes the session in `stop()` either way.
    """

    def __init__(
        self,
        table: RouteTable,
        hash_key: Callable[[str], str],
        connect_timeout: float,
        request_timeout: float,
        observer: RequestObserver | None = None,
        session_factory: SessionFactory = default_session,
    ) -> None:
        self._table = table
        self._session_factory = session_factory
        self._hash_key = hash_key
        self._observer = observer
        self._timeout = aiohttp.ClientTimeout(total=request_timeout,
                                              sock_connect=connect_timeout)
        self._session: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        self._session = self._session_factory(self._timeout)

    async def stop(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    # --- ASGI -------------------------------------------------------------------

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path, method = scope["path"], scope["method"]
        started = time.perf_counter()
        outcome = _Outcome()
        try:
            grant = self._authenticate(scope)
            if path == "/v1/models" or path.startswith("/v1/models/"):
                if method != "GET":
                    raise _error(405, f"{method} is not allowed on {path}.",
                                 "invalid_request_error")
                ident = path[len("/v1/models/"):]
                await _send_json(send, 200, self._model(grant, ident) if ident
                                 else self._models(grant))
                return
            if path not in _FORWARDED:
                raise _error(404, f"Unknown path {path}.", "invalid_request_error",
                             "unknown_url")
            if method != "POST":
                raise _error(405, f"{method} is not allowed on {path}.",
                             "invalid_request_error")
            await self._forward(grant, path, receive, send, outcome)
        except _Reply as r:
            outcome.status = r.status
            extra = [(b"www-authenticate", b"Bearer")] if r.status == 401 else []
            await _send_json(send, r.status, r.body, extra)
        except _ClientGone:
            outcome.status = 499  # nginx's "client closed request"
        except Exception:
            logger.exception("unhandled error on %s %s", method, path)
            outcome.status = 500
            body = openai_error_body("Internal error in the gateway.", "server_error")
            try:
                await _send_json(send, 500, body)
            except RuntimeError:
                pass  # the response had started (a stream): the client sees it cut
        finally:
            if self._observer is not None and path in _FORWARDED:
                self._observer.observe(outcome.model, outcome.status,
                                       time.perf_counter() - started)

    def _authenticate(self, scope: Scope) -> KeyGrant:
        token = ""
        for name, value in scope["headers"]:
            if name == b"authorization":
                scheme, _, rest = value.decode("latin-1").partition(" ")
                if scheme.lower() == "bearer":
                    token = rest.strip()
                break
        if not token:
            raise _error(401, "Missing API key: send 'Authorization: Bearer <key>'.",
                         "invalid_request_error", "invalid_api_key")
        grant = self._table.grant(self._hash_key(token))
        if grant is None:
            raise _error(401, "Incorrect API key provided.", "invalid_request_error",
                         "invalid_api_key")
        return grant

    def _listed(self, grant: KeyGrant) -> list[dict[str, Any]]:
        return [
            {"id": ident, "object": "model", "created": entry.created,
             "owned_by": "llmgw", "root": entry.name}
            for entry in self._table.catalog() if grant.allows(entry.name)
            for ident in (entry.name, *entry.aliases)
        ]

    def _models(self, grant: KeyGrant) -> bytes:
        return json.dumps({"object": "list", "data": self._listed(grant)}).encode()

    def _model(self, grant: KeyGrant, ident: str) -> bytes:
        for entry in self._listed(grant):
            if entry["id"] == ident:
                return json.dumps(entry).encode()
        raise _error(404, f"The model '{ident}' does not exist or you do not have access to it.",
                     "invalid_request_error", "model_not_found", "model")

    async def _forward(self, grant: KeyGrant, path: str, receive: Receive,
                       send: Send, outcome: _Outcome) -> None:
        body = _parse(await _read_body(receive))
        requested = body.get("model")
        if not isinstance(requested, str) or not requested:
            raise _error(400, "You must provide a model parameter.",
                         "invalid_request_error", param="model")
        name = self._table.resolve(requested)
        if name is None or not grant.allows(name):
            raise _error(
                404, f"The model '{requested}' does not exist or you do not have access to it.",
                "invalid_request_error", "model_not_found", "model",
            )
        outcome.model = name
        body["model"] = name  # engines serve the catalog name, not the alias
        payload = json.dumps(body).encode()
        outcome.status = await self._send(name, path, payload, body.get("stream") is True,
                                          receive, send)

    async def _send(self, model: str, path: str, payload: bytes, stream: bool,
                    receive: Receive, send: Send) -> int:
        """Forwards to a replica; returns the status the client got."""
        assert self._session is not None, "Proxy.start() was not awaited"
        tried: set[str] = set()
        last_error = ""
        for _ in range(_MAX_ATTEMPTS):
            ep = self._table.choose(model, tried)
            if ep is None:
                break
            tried.add(ep.replica_id)
            lease = self._table.acquire(ep)
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
                    raise _error(502, f"replica {ep.replica_id} refused the gateway",
                                 "server_error", "upstream_auth")
                if stream:
                    await _relay(upstream, ep, receive, send)
                    return upstream.status
                # Read whole: nothing has reached the client yet, so a failure
                # here is still retried, and the answer keeps its length.
                answer = await upstream.read()
                await _send_json(send, upstream.status, answer,
                                 [(b"x-llmgw-replica", ep.replica_id.encode())])
                return upstream.status
            except (aiohttp.ClientError, TimeoutError, _Retry) as exc:
                last_error = f"replica {ep.replica_id} failed ({exc or type(exc).__name__})"
                logger.warning("%s; trying another", last_error)
            finally:
                lease.release()  # also when the client left (cancellation)
        if tried:
            message = f"No replica of '{model}' can take the request now: {last_error}."
        else:  # none routable: say why when the control plane told the table
            why = self._table.unavailable(model)
            message = f"No replica of '{model}' is ready" + (f": {why}" if why else ".")
        raise _error(503, message, "service_unavailable", "no_ready_replica")


class _Outcome:
    """How one request ended, for the observer."""

    __slots__ = ("model", "status")

    def __init__(self) -> None:
        self.model = UNKNOWN_MODEL
        self.status = 500


async def _read_body(receive: Receive) -> bytes:
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise _ClientGone
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > MAX_BODY:
            raise _error(413, f"The request body is larger than {MAX_BODY} bytes.",
                         "invalid_request_error")
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


def _parse(raw: bytes) -> dict[str, Any]:
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise _error(400, f"The request body is not valid JSON: {exc}",
                     "invalid_request_error") from None
    if not isinstance(body, dict):
        raise _error(400, "The request body must be a JSON object.", "invalid_request_error")
    return body


async def _relay(upstream: aiohttp.ClientResponse, ep: Endpoint, receive: Receive,
                 send: Send) -> None:
    """Streams the engine's bytes as they come, until it ends or the client leaves."""
    disconnected = asyncio.ensure_future(_disconnect(receive))
    # The client leaving closes the engine's connection at once, so the read
    # below ends even while the engine is silent (a long prefill, a stall)
    # instead of holding the lease until its next chunk or the timeout.
    def on_leave(f: asyncio.Future[None]) -> None:
        if not f.cancelled():
            upstream.close()

    disconnected.add_done_callback(on_leave)
    try:
        await send({"type": "http.response.start", "status": upstream.status, "headers": [
            (b"content-type", upstream.headers.get("Content-Type", "text/event-stream").encode()),
            (b"cache-control", b"no-cache"),
            (b"x-llmgw-replica", ep.replica_id.encode()),
        ]})
        try:
            async for chunk in upstream.content.iter_any():
                if disconnected.done():
                    return  # the engine's connection is closed: it stops generating
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        except (aiohttp.ClientError, TimeoutError) as exc:
            if disconnected.done():
                return  # our own close, above
            # Bytes already reached the client: nothing to retry; end the stream.
            logger.warning("replica %s broke off mid-response: %s", ep.replica_id, exc)
        if not disconnected.done():
            await send({"type": "http.response.body", "body": b"", "more_body": False})
    finally:
        if not disconnected.done():
            disconnected.cancel()
            upstream.release()


async def _disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


def openapi_paths() -> dict[str, Any]:
    """OpenAPI entries for /v1, which FastAPI does not route (see `main`)."""
    def op(summary: str, method: str) -> dict[str, Any]:
        entry: dict[str, Any] = {
            "tags": ["OpenAI API"], "summary": summary,
            "security": [{"HTTPBearer": []}],
            "responses": {"200": {"description": "the engine's answer, as OpenAI's API"},
                          "401": {"description": "missing or wrong client key"},
                          "404": {"description": "unknown model"},
                          "503": {"description": "no ready replica"}},
        }
        if method == "post":
            entry["requestBody"] = {"required": True, "content": {"application/json": {
                "schema": {"type": "object", "required": ["model"],
                           "properties": {"model": {"type": "string"},
                                          "stream": {"type": "boolean"}}}}}}
        return {method: entry}

    return {
        "/v1/models": op("List the models this key may use", "get"),
        "/v1/models/{model}": op("One model, by name or alias", "get"),
        "/v1/chat/completions": op("Chat completion, forwarded to a replica", "post"),
        "/v1/completions": op("Text completion, forwarded to a replica", "post"),
        "/v1/embeddings": op("Embeddings, forwarded to a replica", "post"),
    }
