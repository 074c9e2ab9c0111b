#!/usr/bin/env python3
"""The Python floor: the least a Python proxy does, to tell llmgw's own cost
from its stack's. A raw ASGI app (no framework, no auth, no model lookup, no
JSON rewrite) on uvicorn with uvloop and httptools, forwarding with one
aiohttp session: the server llmgw uses, and the client it used until it got
its own (app/router/upstream.py; bench/README.md says what that changed).

    FLOOR_ENGINE_KEY=KEY python bench/floor.py PORT UPSTREAM_URL
"""

from __future__ import annotations

import os
import sys
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

import aiohttp

Message = MutableMapping[str, Any]


def floor_app(upstream: str, key: str) -> Callable[..., Awaitable[None]]:
    session: aiohttp.ClientSession | None = None
    headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}

    async def app(scope: Message, receive: Callable[[], Awaitable[Message]],
                  send: Callable[[Message], Awaitable[None]]) -> None:
        nonlocal session
        if scope["type"] == "lifespan":
            while True:
                msg = await receive()
                if msg["type"] == "lifespan.startup":
                    session = aiohttp.ClientSession(
                        connector=aiohttp.TCPConnector(limit=0), auto_decompress=False)
                    await send({"type": "lifespan.startup.complete"})
                elif msg["type"] == "lifespan.shutdown":
                    if session is not None:
                        await session.close()
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        assert session is not None
        chunks = []
        while True:
            msg = await receive()
            chunks.append(msg.get("body", b""))
            if not msg.get("more_body"):
                break
        async with session.post(upstream + scope["path"], data=b"".join(chunks),
                                headers=headers) as up:
            await send({"type": "http.response.start", "status": up.status, "headers": [
                (b"content-type", up.headers.get("Content-Type", "").encode())]})
            async for chunk in up.content.iter_any():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})

    return app


def main() -> None:
    import uvicorn

    port, upstream = int(sys.argv[1]), sys.argv[2]
    uvicorn.run(floor_app(upstream, os.environ["FLOOR_ENGINE_KEY"]), host="127.0.0.1",
                port=port, log_level="warning", access_log=False, loop="uvloop",
                http="httptools")


if __name__ == "__main__":
    main()
