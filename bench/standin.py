#!/usr/bin/env python3
"""A fast vLLM stand-in for bench/router_overhead.py: a raw asyncio HTTP/1.1
server (uvloop + httptools, no framework), so that the upstream is not what
bounds the proxies in front of it. tests/fakes/fake_vllm.py (aiohttp, with
vLLM's whole CLI) tops out at 1,500-3,500 req/s on these machines, below
what nginx or a bare Python proxy forwards.

Run as vLLM is (the agent starts it through bench/bin/vllm):

    vllm serve WEIGHTS --host H --port P --served-model-name NAME [ignored flags]

with the engine key in VLLM_API_KEY (checked on /v1 like vLLM does).

Answers: GET /health, /version, /metrics, /v1/models; POST
/v1/chat/completions and /v1/completions. A plain request gets one fixed
completion. A streamed one (`"stream": true`) gets `max_tokens` SSE chunks,
the first at once and then one every STANDIN_CHUNK_MS milliseconds (default
50), then `data: [DONE]`. Each chunk's content is `@<monotonic seconds> `,
the time it was written, so a client on the same machine can tell how late
each chunk reached it through a proxy (CLOCK_MONOTONIC is system-wide).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import sys
import time
from typing import Any, cast

import httptools
import uvloop

CHUNK_S = float(os.environ.get("STANDIN_CHUNK_MS", "50")) / 1000
MAX_CHUNKS = 4096


def _response(status: bytes, body: bytes, ctype: bytes = b"application/json") -> bytes:
    return (b"HTTP/1.1 " + status + b"\r\ncontent-type: " + ctype
            + b"\r\ncontent-length: " + str(len(body)).encode() + b"\r\n\r\n" + body)


def _completion(model: str) -> bytes:
    return json.dumps({
        "id": "chatcmpl-standin", "object": "chat.completion", "created": 1700000000,
        "model": model,
        "choices": [{"index": 0, "finish_reason": "length", "logprobs": None,
                     "message": {"role": "assistant",
                                 "content": "one two three four five six seven eight"}}],
        "usage": {"prompt_tokens": 16, "completion_tokens": 8, "total_tokens": 24},
    }).encode()


def _chunk(model: str, content: str, finish: str | None) -> bytes:
    data = json.dumps({
        "id": "chatcmpl-standin", "object": "chat.completion.chunk", "created": 1700000000,
        "model": model,
        "choices": [{"index": 0, "delta": {"role": "assistant", "content": content},
                     "logprobs": None, "finish_reason": finish}],
    }).encode()
    frame = b"data: " + data + b"\n\n"
    return hex(len(frame))[2:].encode() + b"\r\n" + frame + b"\r\n"


class _Chunks:
    """`_chunk`'s bytes for a stamp, without a JSON encode per chunk: at
    thousands of streams (bench/streams.py) the stand-in's own CPU per chunk
    is what bounds the load side. The content is ASCII that JSON keeps as is."""

    def __init__(self, model: str) -> None:
        self.parts = {finish: _chunk(model, "<stamp>", finish)
                      .split(b"\r\n", 1)[1].split(b"<stamp>")
                      for finish in (None, "length")}

    def __call__(self, content: str, finish: str | None) -> bytes:
        head, tail = self.parts[finish]
        frame = head + content.encode() + tail.removesuffix(b"\r\n")
        return hex(len(frame))[2:].encode() + b"\r\n" + frame + b"\r\n"


_DONE_FRAME = b"data: [DONE]\n\n"
_DONE = hex(len(_DONE_FRAME))[2:].encode() + b"\r\n" + _DONE_FRAME + b"\r\n0\r\n\r\n"
_SSE_HEAD = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
             b"cache-control: no-cache\r\ntransfer-encoding: chunked\r\n\r\n")


class Server:
    def __init__(self, model: str, key: str) -> None:
        self.model = model
        self.chunk = _Chunks(model)
        self.auth = f"Bearer {key}".encode() if key else b""
        self.plain = _response(b"200 OK", _completion(model))
        self.models = _response(b"200 OK", json.dumps({"object": "list", "data": [
            {"id": model, "object": "model", "created": 1700000000, "owned_by": "vllm",
             "root": model, "max_model_len": 8192}]}).encode())
        self.unauthorized = _response(b"401 Unauthorized", b'{"error": "Unauthorized"}')
        self.not_found = _response(b"404 Not Found", b'{"detail": "Not Found"}')
        self.ok = _response(b"200 OK", b"")
        self.version = _response(b"200 OK", b'{"version": "0.0.0-standin"}')
        self.metrics = _response(b"200 OK", b"", b"text/plain; version=0.0.4")


class Conn(asyncio.Protocol):
    def __init__(self, server: Server) -> None:
        self.s = server
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self.url = b""
        self.auth = b""
        self.body: list[bytes] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement asyncio.Transport without subclassing it.
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            if self.transport is not None:
                self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None

    # httptools callbacks
    def on_message_begin(self) -> None:
        self.url, self.auth, self.body = b"", b"", []

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        if name.lower() == b"authorization":
            self.auth = value

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        method = self.parser.get_method()
        path = self.url.split(b"?", 1)[0]
        if path.startswith(b"/v1/") and self.s.auth and self.auth != self.s.auth:
            self._write(self.s.unauthorized)
        elif method == b"POST" and path in (b"/v1/chat/completions", b"/v1/completions"):
            self._complete(b"".join(self.body))
        elif path == b"/health" or path == b"/ping":
            self._write(self.s.ok)
        elif path == b"/v1/models":
            self._write(self.s.models)
        elif path == b"/version":
            self._write(self.s.version)
        elif path == b"/metrics":
            self._write(self.s.metrics)
        else:
            self._write(self.s.not_found)

    def _write(self, data: bytes) -> None:
        if self.transport is not None:
            self.transport.write(data)

    def _complete(self, raw: bytes) -> None:
        try:
            body: Any = json.loads(raw)
        except ValueError:
            body = None
        if not isinstance(body, dict):
            self._write(_response(b"400 Bad Request", b'{"error": "bad json"}'))
            return
        if body.get("stream") is not True:
            self._write(self.s.plain)
            return
        n = body.get("max_tokens")
        chunks = min(MAX_CHUNKS, n if isinstance(n, int) and n > 0 else 16)
        self._write(_SSE_HEAD)
        self._tick(0, chunks, asyncio.get_running_loop().time())

    def _tick(self, i: int, n: int, start: float) -> None:
        if self.transport is None:
            return
        last = i == n - 1
        self._write(self.s.chunk(f"@{time.monotonic():.6f} ", "length" if last else None))
        if last:
            self._write(_DONE)
            return
        # Scheduled against the stream's start, so one late tick does not
        # shift every later chunk.
        due = start + (i + 1) * CHUNK_S
        asyncio.get_running_loop().call_at(due, self._tick, i + 1, n, start)


def parse(argv: list[str]) -> tuple[str, str, int]:
    """(served model name, host, port) from vLLM's command line; the rest is ignored."""
    args = argv[1:] if argv[:1] == ["serve"] else argv
    weights = args[0] if args and not args[0].startswith("-") else "standin"
    opts: dict[str, str] = {}
    for flag, value in itertools.pairwise(args):
        if flag.startswith("--"):
            opts[flag] = value
    name = opts.get("--served-model-name", weights)
    return name, opts.get("--host", "127.0.0.1"), int(opts.get("--port", "8000"))


async def serve(model: str, host: str, port: int, key: str) -> None:
    server = Server(model, key)
    loop = asyncio.get_running_loop()
    srv = await loop.create_server(lambda: Conn(server), host, port, backlog=4096)
    async with srv:
        await srv.serve_forever()


def main() -> None:
    model, host, port = parse(sys.argv[1:])
    uvloop.run(serve(model, host, port, os.environ.get("VLLM_API_KEY", "")))


if __name__ == "__main__":
    main()
