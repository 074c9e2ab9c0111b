"""The parts of the vLLM stand-in (fake_vllm.py) outside vLLM's ``/v1``: the
routes vLLM serves without its key, and its ``--middleware`` option.

What was checked against vLLM's own source and docs (search tool):

* Unguarded routes: vLLM's ``--api-key`` guards paths under ``/v1`` only
  (docs/usage/security.md "API Key Authentication Limitations"; issues
  vllm-project/vllm#18892, #58144): ``/invocations`` (SageMaker; dispatches a
  chat, completion or embedding body to the same handlers as ``/v1``),
  ``/tokenize``, ``/detokenize``, ``/pooling``, ``/classify``, ``/score``,
  ``/rerank`` answer anyone. Their bodies here are small deterministic
  stand-ins, not vLLM's full schemas: what matters is who gets an answer.
* ``--middleware IMPORT.PATH`` (``vllm/entrypoints/openai/api_server.py``
  ``build_app``): repeatable (argparse ``append``); each is imported
  (``module.rsplit(".", 1)``); a class is added with ``app.add_middleware(cls)``
  (Starlette builds ``cls(app)``), a coroutine function with
  ``app.middleware("http")`` (Starlette's BaseHTTPMiddleware), anything else
  is ``ValueError("Invalid middleware ...")`` and the server does not start.
  They are added after vLLM's own key check, so each wraps it, the last
  given outermost.

The stand-in is aiohttp, not ASGI: each request is handed to the middleware
stack as an ASGI ``http`` scope whose innermost app answers a marked empty
response; a request that comes out with the mark continues into the aiohttp
routes, anything else is what the middleware answered. So a middleware that
passes requests on or answers them itself behaves as in vLLM; one that
rewrites the response the routes give does not (none of ours does).
Lifespan and WebSocket scopes are not driven here (tests/test_engine_guard.py
drives the guard with them in-process).
"""

from __future__ import annotations

import asyncio
import hashlib
import importlib
import inspect
import json
from collections.abc import Callable, Sequence
from typing import Any

from aiohttp import web

_PASSED = b"x-fake-vllm-passed"


FRAMING = 0  # the stand-in's one token around each chat message (no word hashes to it)


def _token_ids(text: str) -> list[int]:
    return [int.from_bytes(hashlib.sha256(w.encode()).digest()[:2], "big") or 1
            for w in text.split()]


def add_unguarded_routes(app: web.Application, fake: Any,
                         embed: Callable[[str, str], list[float]]) -> None:
    """vLLM's routes outside /v1, which its own key does not guard; `embed`
    is the stand-in's fake_embedding."""

    async def body_of(request: web.Request) -> dict[str, Any] | None:
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            return None
        return body if isinstance(body, dict) else None

    async def invocations(request: web.Request) -> web.StreamResponse:
        body = await body_of(request) or {}
        if "messages" in body:
            return await fake.chat_completions(request)  # type: ignore[no-any-return]
        if "prompt" in body:
            return await fake.completions(request)  # type: ignore[no-any-return]
        if "input" in body:
            return await fake.embeddings(request)  # type: ignore[no-any-return]
        return web.json_response({"error": {"message": "Cannot determine the request type",
                                            "type": "BadRequestError", "param": None,
                                            "code": 400}}, status=400)

    words: dict[int, str] = {}  # token id -> the word it was made from

    async def tokenize(request: web.Request) -> web.Response:
        body = await body_of(request) or {}
        if isinstance(body.get("prompt"), str):
            texts, framing = [body["prompt"]], 0
        else:
            # A chat is counted as the stand-in's chat completions count its
            # prompt: each message's words and one token framing it.
            texts = [str(m.get("content", "")) for m in body.get("messages") or []
                     if isinstance(m, dict)]
            framing = 1
        tokens = []
        for text in texts:
            ids = _token_ids(text)
            tokens += ids + [FRAMING] * framing
            if len(words) < 100_000:
                words.update(zip(ids, text.split(), strict=True))
        return web.json_response({"count": len(tokens), "tokens": tokens, "token_strs": None,
                                  "max_model_len": fake.args.max_model_len})

    async def detokenize(request: web.Request) -> web.Response:
        body = await body_of(request) or {}
        tokens = body.get("tokens") or []
        # The words it tokenized come back (vLLM's round trip,
        # tests/test_vllm_contract.py); an id it never gave, as `<id>`.
        return web.json_response({"prompt": " ".join(
            words.get(t, f"<{t}>") if isinstance(t, int) else f"<{t}>" for t in tokens
            if t != FRAMING)})

    async def pooled(request: web.Request) -> web.Response:
        body = await body_of(request) or {}
        given = body.get("input", body.get("text_1", ""))
        texts = given if isinstance(given, list) else [given]
        data = [{"index": i, "data": embed(fake.names[0], str(t))}
                for i, t in enumerate(texts)]
        return web.json_response({"object": "list", "model": fake.names[0], "data": data})

    app.router.add_post("/invocations", invocations)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/detokenize", detokenize)
    for path in ("/pooling", "/classify"):  # /score, /rerank: fake_vllm_responses.py
        app.router.add_post(path, pooled)


async def _passed(scope: Any, receive: Any, send: Any) -> None:
    """The innermost ASGI app: marks a request the middlewares let through."""
    await send({"type": "http.response.start", "status": 200, "headers": [(_PASSED, b"1")]})
    await send({"type": "http.response.body", "body": b""})


def middleware_stack(paths: Sequence[str]) -> Any:
    """The ASGI middlewares `--middleware` names, stacked as vLLM's build_app
    does (the last given outermost); raises as vLLM does on a bad one."""
    app: Any = _passed
    for path in paths:
        module_path, name = path.rsplit(".", 1)
        imported = getattr(importlib.import_module(module_path), name)
        if inspect.isclass(imported):
            app = imported(app)
        elif inspect.iscoroutinefunction(imported):
            from starlette.middleware.base import BaseHTTPMiddleware

            app = BaseHTTPMiddleware(app, dispatch=imported)
        else:
            raise ValueError(f"Invalid middleware {path}. Must be a function or a class.")
    return app


def asgi_bridge(stack: Any) -> Any:
    """An aiohttp middleware running each request through the ASGI `stack`."""

    @web.middleware
    async def bridge(request: web.Request, handler: Any) -> web.StreamResponse:
        body = await request.read()  # kept by aiohttp: the route reads it again
        given = False

        async def receive() -> dict[str, Any]:
            nonlocal given
            if not given:
                given = True
                return {"type": "http.request", "body": body, "more_body": False}
            await asyncio.Future()  # the client stays connected
            raise AssertionError("unreachable")

        sent: list[dict[str, Any]] = []

        async def send(message: dict[str, Any]) -> None:
            sent.append(message)

        path, _, query = request.raw_path.partition("?")
        peer = request.transport.get_extra_info("peername") if request.transport else None
        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
                 "method": request.method, "scheme": "http", "path": request.path,
                 "raw_path": path.encode(), "query_string": query.encode(), "root_path": "",
                 "headers": [(k.lower(), v) for k, v in request.raw_headers],
                 "client": tuple(peer[:2]) if peer else None, "server": None, "state": {}}
        await stack(scope, receive, send)
        start = next(m for m in sent if m["type"] == "http.response.start")
        headers = [(bytes(k).lower(), bytes(v)) for k, v in start.get("headers", [])]
        if (_PASSED, b"1") in headers:
            resp: web.StreamResponse = await handler(request)
            return resp
        out = web.Response(status=start["status"], body=b"".join(
            m.get("body", b"") for m in sent if m["type"] == "http.response.body"))
        for k, v in headers:
            if k not in (b"content-length", b"content-type"):
                out.headers.add(k.decode("latin-1"), v.decode("latin-1"))
            elif k == b"content-type":
                out.headers["Content-Type"] = v.decode("latin-1")
        return out

    return bridge


async def refuse_marked(request: Any, call_next: Any) -> Any:
    """A function middleware for tests: refuses requests marked
    ``x-refuse: 1`` with 418, passes the others on."""
    from starlette.responses import JSONResponse

    if request.headers.get("x-refuse") == "1":
        return JSONResponse({"refused": request.url.path}, status_code=418)
    return await call_next(request)


not_a_middleware = 42  # for tests: neither a class nor a coroutine function
