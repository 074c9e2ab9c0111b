"""A uvicorn server in the test's own event loop, on a free loopback port:
for tests of what the gateway's HTTP/1.1 protocol does with raw clients
(tests/test_http1.py, test_keep_alive.py, test_direct_body.py)."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import uvicorn


@dataclass
class Served:
    port: int
    server: uvicorn.Server
    task: asyncio.Task[None]


@contextlib.asynccontextmanager
async def serving(app: Any, bind: str = "127.0.0.1", **config: Any) -> AsyncIterator[Served]:
    """`app` served by uvicorn with `config` (no lifespan, no log config) on
    a free port of `bind`, until the block ends; then stopped as a signal
    stops it, within 5 s."""
    sock = socket.socket(socket.AF_INET6 if ":" in bind else socket.AF_INET)
    sock.bind((bind, 0))
    srv = uvicorn.Server(uvicorn.Config(app, log_config=None, lifespan="off", **config))
    task = asyncio.create_task(srv.serve(sockets=[sock]))
    for _ in range(500):  # uvicorn says it started with a flag only
        if srv.started or task.done():
            break
        await asyncio.sleep(0.01)
    assert srv.started, task.exception() if task.done() else "not started in 5 s"
    try:
        yield Served(sock.getsockname()[1], srv, task)
    finally:
        srv.should_exit = True
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(task, 5)
