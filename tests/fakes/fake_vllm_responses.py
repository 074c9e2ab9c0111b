"""The vLLM stand-in's Responses API, reranking, scoring and speech to text
(fake_vllm.py registers them with `add_routes`).

What was checked against vLLM's source (search tool, vllm-project/vllm,
vllm/entrypoints/openai/responses/{api_router,serving,protocol}.py,
pooling/score/protocol.py, speech_to_text protocol):

* Responses: ``POST /v1/responses``, ``GET /v1/responses/{response_id}``
  (``?stream=true``: its events again, the last, ``response.completed``,
  with the whole response and its usage; vLLM replays a background
  response's events so), ``POST /v1/responses/{response_id}/cancel`` (no
  DELETE). The response's
  id is the request's ``request_id`` field (vLLM's extension, default
  ``resp_<uuid hex>``). Responses are kept in the process's memory, and only
  when the server runs with ``VLLM_ENABLE_RESPONSES_API_STORE=1``: else
  ``store`` is silently off and every later lookup fails. An unknown
  ``previous_response_id`` or id: 404 ``Response with id '<id>' not found.``,
  type ``invalid_request_error``, param ``response_id``. Cancelling a
  response that is not queued or in progress: 400 ``Cannot cancel a
  synchronous response.`` Usage: ``input_tokens``, ``output_tokens``,
  ``total_tokens`` and their details. A stream is named SSE events
  (``event: <type>`` then ``data: <json>``), from ``response.created`` to
  ``response.completed`` (which carries the whole response and its usage),
  each with a ``sequence_number``, and no ``[DONE]``.
* Rerank (``/rerank``, ``/v1/rerank``, ``/v2/rerank``): ``query``, ``documents``,
  ``top_n`` (0: all) -> ``{id: rerank-…, model, usage: {total_tokens}, results:
  [{index, document: {text}, relevance_score}]}``, best first.
* Score (``/score``, ``/v1/score``): ``text_1``, ``text_2`` (a string or a list)
  -> ``{id: score-…, object: list, created, model, data: [{index, object:
  score, score}], usage}``.
* Transcriptions and translations: a multipart form, ``file`` and ``model``
  (``response_format`` json or text, ``stream``) -> ``{text, usage: {type:
  duration, seconds}}``; a stream is ``transcription.chunk`` events and
  ``data: [DONE]``. The form is read by Starlette's ``Request.form()``, as
  vLLM's FastAPI ``Form()`` model reads it (a name given twice: its last value).

The text is deterministic: a response echoes its input (``fake-vllm <model>
echo: <text>``, one word per delta), and says how many earlier turns its
stored conversation had (``turn N``), so a test sees a continuation found
its state.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
import uuid
from typing import Any

from aiohttp import web
from starlette.datastructures import FormData, UploadFile
from starlette.formparsers import MultiPartException
from starlette.requests import Request


def _err(status: int, message: str, param: str | None = None) -> web.Response:
    kind = "invalid_request_error" if status < 500 else "InternalServerError"
    return web.json_response({"error": {"message": message, "type": kind, "param": param,
                                        "code": status}}, status=status)


def _text_of(item: Any) -> str:
    if isinstance(item, str):
        return item
    if isinstance(item, dict):
        content = item.get("content", item.get("text", ""))
        if isinstance(content, list):
            return " ".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
        return str(content)
    return ""


async def starlette_form(raw: bytes, content_type: str) -> FormData:
    """`raw` read by Starlette's `Request.form()`, as vLLM's FastAPI reads a
    form (python-multipart underneath); raises MultiPartException where it
    cannot parse it. The caller closes the form. (tests/test_forms.py reads
    forms as the engine does with it too.)"""
    scope = {"type": "http", "method": "POST", "path": "/", "query_string": b"",
             "headers": [(b"content-type", content_type.encode("latin-1"))]}

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": raw, "more_body": False}

    return await Request(scope, receive).form()


async def _form(raw: bytes, content_type: str
                ) -> tuple[dict[str, str], dict[str, tuple[str, bytes]]] | web.Response:
    """A multipart form read as vLLM reads it (`starlette_form`), a name
    given twice taking its last value (`FormData.get`, which FastAPI's
    `Form()` model reads); a form it cannot parse is a 400, as FastAPI
    answers. (The middleware stack has read the body already, so aiohttp's
    `post()` cannot.)"""
    try:
        form = await starlette_form(raw, content_type)
    except MultiPartException as e:
        return _err(400, e.message)
    fields: dict[str, str] = {}
    files: dict[str, tuple[str, bytes]] = {}
    for name in form:
        value = form[name]  # the last of its name, as FastAPI reads it
        if isinstance(value, UploadFile):
            files[name] = (value.filename or "", await value.read())
        else:
            fields[name] = value
    await form.close()
    return fields, files


def _score(a: str, b: str) -> float:
    """A relevance in [0, 1): shared words, then a hash for ties."""
    shared = len(set(a.lower().split()) & set(b.lower().split()))
    tie = int.from_bytes(hashlib.sha256(f"{a}\0{b}".encode()).digest()[:2], "big") / 65536
    return round((shared + tie) / (shared + 2), 6)


class Responses:
    def __init__(self, fake: Any) -> None:
        self.fake = fake
        self.store_on = os.environ.get("VLLM_ENABLE_RESPONSES_API_STORE", "") in ("1", "true")
        self.store: dict[str, dict[str, Any]] = {}
        self.messages: dict[str, list[str]] = {}  # the conversation up to each response

    def add_routes(self, app: web.Application) -> None:
        app.router.add_post("/v1/responses", self.create)
        app.router.add_get("/v1/responses/{response_id}", self.retrieve)
        app.router.add_post("/v1/responses/{response_id}/cancel", self.cancel)
        for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
            app.router.add_post(path, self.rerank)
        for path in ("/score", "/v1/score"):
            app.router.add_post(path, self.score)
        app.router.add_post("/v1/audio/transcriptions", self.transcribe)
        app.router.add_post("/v1/audio/translations", self.transcribe)

    async def create(self, request: web.Request) -> web.StreamResponse:
        body, err = await self.fake._parse(request)
        if err is not None:
            return err
        assert body is not None
        prev = body.get("previous_response_id")
        history: list[str] = []
        if prev is not None:
            if prev not in self.store:
                return _err(404, f"Response with id '{prev}' not found.", "response_id")
            history = self.messages[prev]
        given = body.get("input")
        if not isinstance(given, (str, list)):
            return _err(400, "input must be a string or a list of items.", "input")
        turn = [given] if isinstance(given, str) else [_text_of(i) for i in given]
        asked = turn[-1] if turn else ""
        conversation = [*history, *turn]
        model = body["model"]
        words = f"fake-vllm {model} echo: {asked} (turn {len(history) // 2 + 1})".split()
        limit = body.get("max_output_tokens")
        status = "completed"
        if isinstance(limit, int) and 0 < limit < len(words):
            words, status = words[:limit], "incomplete"
        rid = str(body.get("request_id") or f"resp_{uuid.uuid4().hex}")
        prompt_tokens = sum(len(t.split()) + 1 for t in conversation)
        response = self._response(rid, body, words, status, prompt_tokens)
        store = body.get("store", True) is not False and self.store_on
        if store:
            self.store[rid] = response
            self.messages[rid] = [*conversation, " ".join(words)]
        if not body.get("stream"):
            async for _ in self.fake._generate(words, prompt_tokens):
                pass
            return web.json_response(response)
        return await self._stream(request, response, words, prompt_tokens)

    def _response(self, rid: str, body: dict[str, Any], words: list[str], status: str,
                  prompt_tokens: int) -> dict[str, Any]:
        text = " ".join(words)
        return {
            "id": rid, "created_at": int(time.time()), "incomplete_details": None,
            "instructions": body.get("instructions"), "metadata": body.get("metadata"),
            "model": body["model"], "object": "response",
            "output": [{"id": f"msg_{uuid.uuid4().hex}", "type": "message",
                        "role": "assistant", "status": "completed",
                        "content": [{"type": "output_text", "text": text,
                                     "annotations": [], "logprobs": None}]}],
            "parallel_tool_calls": True, "temperature": 1.0, "tool_choice": "auto",
            "tools": [], "top_p": 1.0, "background": False,
            "max_output_tokens": body.get("max_output_tokens") or 4096,
            "max_tool_calls": None, "previous_response_id": body.get("previous_response_id"),
            "prompt": None, "reasoning": None, "service_tier": "auto", "status": status,
            "text": None, "top_logprobs": None, "truncation": "disabled",
            "usage": {"input_tokens": prompt_tokens,
                      "input_tokens_details": {"cached_tokens": 0},
                      "output_tokens": len(words),
                      "output_tokens_details": {"reasoning_tokens": 0},
                      "total_tokens": prompt_tokens + len(words)},
            "user": None,
        }

    async def _stream(self, request: web.Request, response: dict[str, Any], words: list[str],
                      prompt_tokens: int) -> web.StreamResponse:
        resp = web.StreamResponse(status=200, headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        seq = 0

        async def event(kind: str, **fields: Any) -> None:
            nonlocal seq
            data = json.dumps({"type": kind, "sequence_number": seq, **fields},
                              separators=(",", ":"))
            seq += 1
            await resp.write(f"event: {kind}\ndata: {data}\n\n".encode())

        item = response["output"][0]
        opening = response | {"status": "in_progress", "output": [], "usage": None}
        await event("response.created", response=opening)
        await event("response.in_progress", response=opening)
        await event("response.output_item.added", output_index=0,
                    item=item | {"status": "in_progress", "content": []})
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": None}
        await event("response.content_part.added", item_id=item["id"], output_index=0,
                    content_index=0, part=part)
        async for delta in self.fake._generate(words, prompt_tokens):
            await event("response.output_text.delta", item_id=item["id"], output_index=0,
                        content_index=0, delta=delta, logprobs=[])
        text = item["content"][0]["text"]
        await event("response.output_text.done", item_id=item["id"], output_index=0,
                    content_index=0, text=text, logprobs=[])
        await event("response.content_part.done", item_id=item["id"], output_index=0,
                    content_index=0, part=part | {"text": text})
        await event("response.output_item.done", output_index=0, item=item)
        await event("response.completed", response=response)
        await resp.write_eof()
        return resp

    async def retrieve(self, request: web.Request) -> web.StreamResponse:
        rid = request.match_info["response_id"]
        if rid not in self.store:
            return _err(404, f"Response with id '{rid}' not found.", "response_id")
        if request.query.get("stream") != "true":
            return web.json_response(self.store[rid])
        # Its events again, from the first: the last one carries the whole
        # response, its usage included.
        resp = web.StreamResponse(status=200, headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        stored = self.store[rid]
        opening = stored | {"status": "in_progress", "output": [], "usage": None}
        for seq, (kind, response) in enumerate((("response.created", opening),
                                                 ("response.completed", stored))):
            data = json.dumps({"type": kind, "sequence_number": seq, "response": response},
                              separators=(",", ":"))
            await resp.write(f"event: {kind}\ndata: {data}\n\n".encode())
        await resp.write_eof()
        return resp

    async def cancel(self, request: web.Request) -> web.Response:
        rid = request.match_info["response_id"]
        if rid not in self.store:
            return _err(404, f"Response with id '{rid}' not found.", "response_id")
        if self.store[rid]["status"] not in ("queued", "in_progress"):
            return _err(400, "Cannot cancel a synchronous response.", "response_id")
        self.store[rid]["status"] = "cancelled"
        return web.json_response(self.store[rid])

    async def rerank(self, request: web.Request) -> web.Response:
        body, err = await self.fake._parse(request)
        if err is not None:
            return err
        assert body is not None
        query, docs = body.get("query"), body.get("documents")
        if not isinstance(query, str) or not isinstance(docs, list) or not all(
                isinstance(d, str) for d in docs):
            return _err(400, "query must be a string and documents a list of strings.")
        ranked = sorted(({"index": i, "document": {"text": d},
                          "relevance_score": _score(query, d)} for i, d in enumerate(docs)),
                        key=lambda r: -r["relevance_score"])
        top = body.get("top_n") or 0
        tokens = sum(len(query.split()) + len(d.split()) for d in docs)
        return web.json_response({"id": f"rerank-{uuid.uuid4().hex}", "model": body["model"],
                                  "usage": {"total_tokens": tokens},
                                  "results": ranked[:top] if top > 0 else ranked})

    async def score(self, request: web.Request) -> web.Response:
        body, err = await self.fake._parse(request)
        if err is not None:
            return err
        assert body is not None
        one, two = body.get("text_1"), body.get("text_2")
        firsts = [one] if isinstance(one, str) else one
        seconds = [two] if isinstance(two, str) else two
        if not (isinstance(firsts, list) and isinstance(seconds, list) and firsts and seconds):
            return _err(400, "text_1 and text_2 must be strings or lists of strings.")
        if len(firsts) == 1:
            firsts = firsts * len(seconds)
        pairs = list(zip(firsts, seconds, strict=False))
        tokens = sum(len(str(a).split()) + len(str(b).split()) for a, b in pairs)
        return web.json_response({
            "id": f"score-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
            "model": body["model"],
            "data": [{"index": i, "object": "score", "score": _score(str(a), str(b))}
                     for i, (a, b) in enumerate(pairs)],
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0,
                      "prompt_tokens_details": None}})

    async def transcribe(self, request: web.Request) -> web.StreamResponse:
        parsed = await _form(await request.read(), request.headers.get("Content-Type", ""))
        if isinstance(parsed, web.Response):
            return parsed
        form, files = parsed
        model = form.get("model") or self.fake.names[0]
        if model not in self.fake.names:
            return _err(404, f"The model `{model}` does not exist.", "model")
        if "file" not in files:
            return _err(400, "file is required.", "file")
        filename, data = files["file"]
        seconds = max(1, round(len(data) / 32000))  # 16 kHz, 16 bits, mono
        text = f"fake-vllm {model} heard {len(data)} bytes of {filename}"
        if form.get("stream") == "true":
            resp = web.StreamResponse(status=200, headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            created = int(time.time())
            for i, word in enumerate(text.split()):
                chunk = {"id": f"trsc-{uuid.uuid4().hex}", "object": "transcription.chunk",
                         "created": created, "model": model,
                         "choices": [{"delta": {"content": word if i == 0 else " " + word}}]}
                await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
            return resp
        if form.get("response_format") == "text":
            return web.Response(text=text, content_type="text/plain")
        return web.json_response({"text": text, "usage": {"type": "duration",
                                                          "seconds": seconds}})
