"""llama-cpp-python's server as the router meets it, stood in: its streams
(a role-only event for a chat, one event a token, a last with the finish
reason, `[DONE]`, never usage; each event ended by a blank line, LF) and
its counts (the prompt tokens route our agent adds,
app/wire/engine_routes.py; `/extras/tokenize/count`). The real engine:
tests/test_llamacpp.py; both against one contract:
tests/test_llamacpp_contract.py."""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web
from aiohttp.test_utils import TestServer

from app.wire.engine_routes import PROMPT_TOKENS
from tests.support.proxy_rig import CHAT

PROMPT = 21  # what the stand-in's count answers


class LlamaCppStandin:
    """llama-cpp-python's stream: a role-only event (chat), one event a token,
    a last with the finish reason, `[DONE]`, never usage; it counts a chat's
    prompt at the route our agent adds (app/wire/engine_routes.py), or, as an
    engine an older agent started (`counts_chats` False: that route 404),
    answers the same chat unstreamed (app/router/usage/prompt_count.py).
    `counts`: whether it answers counts at all (else 500, as a failing engine)."""

    def __init__(self) -> None:
        self.counts = True
        self.counts_chats = True
        self.text_count = PROMPT  # what `/extras/tokenize/count` answers
        self.asked: list[tuple[str, dict[str, Any]]] = []
        app = web.Application()
        app.router.add_post("/{tail:.*}", self._handle)
        self.server = TestServer(app, host="127.0.0.1")

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.asked.append((request.path, body))
        if not body.get("stream"):
            if not self.counts:
                return web.json_response({"error": "busy"}, status=500)
            if request.path == "/extras/tokenize/count":
                return web.json_response({"count": self.text_count})
            if request.path == PROMPT_TOKENS:
                if not self.counts_chats:
                    return web.json_response({"detail": "Not Found"}, status=404)
                return web.json_response({"count": PROMPT})
            return web.json_response({"choices": [], "usage": {
                "prompt_tokens": PROMPT, "completion_tokens": 1, "total_tokens": PROMPT + 1}})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        chat = request.path == CHAT
        head = {"id": "chatcmpl-7" if chat else "cmpl-7", "created": 1700000000,
                "model": body["model"],
                "object": "chat.completion.chunk" if chat else "text_completion"}
        events = ([{"delta": {"role": "assistant"}}] if chat else []) + [
            {"delta": {"content": w}} if chat else {"text": w} for w in "abcd"] + [
            {"delta": {}, "finish_reason": "length"}]
        for e in events:
            await resp.write(b"data: " + json.dumps(head | {"choices": [e]}).encode()
                             + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        return resp
