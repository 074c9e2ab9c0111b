#!/usr/bin/env python3
"""How many streams survive their engine: the measure issue 18 asks for
(docs/design/stream-continuation.md).

    python bench/continuation.py                 # 100 streams, 3 engines
    python bench/continuation.py --streams 20 --engines 2 --token-delay 0.02

What runs, on loopback: `--engines` vLLM stand-ins (tests/fakes/fake_vllm.py
as programs, `--token-delay` s a word), the router (app/router/proxy.py, the
gateway's own /v1 app) served by uvicorn in this process over a route table
filled by hand, and the official `openai` client streaming through it over
HTTP. No etcd and no agent: an agent gives up on an engine that dies three
times in a few minutes (app/agent/health.py), and this kills one a stream.

Each stream asks for the stand-in's 33-word answer; after a random number of
its words (0 to 31, uniform) the engine serving it (the `x-llmgw-replica`
header) is SIGKILLed; the client reads on. A stream counts as read to the
end when the client raised nothing and its text is exactly the unbroken
answer (every word once, in order); anything else is an error. The killed
engine is then started again on a new port and the table updated, so each
stream has the others ready. Also printed: the longest and the median gap
the client saw between the last word before the kill and the next.

The last line is the figure: `continuation: streams=N read_to_end=N errors=N ...`.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import os
import random
import signal
import statistics
import sys
import time
from pathlib import Path

import httpx
import openai
import uvicorn

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from app.ports import free_port  # noqa: E402
from app.router.proxy import Proxy, ProxyOptions  # noqa: E402
from app.router.published import CatalogEntry, Endpoint, KeyGrant  # noqa: E402
from app.router.table import RouteTable  # noqa: E402
from app.router.timeouts import Timeouts  # noqa: E402

FAKE = ROOT / "tests" / "fakes" / "fake_vllm.py"
ENGINE_KEY = "bench-engine-key"
CLIENT_KEY = "sk-bench-client-key"
ASKED = " ".join(f"w{i}" for i in range(30))
WHOLE = f"fake-vllm m echo: {ASKED}"  # 33 words


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


class Engine:
    def __init__(self, rid: str, token_delay: float) -> None:
        self.rid, self.token_delay = rid, token_delay
        self.proc: asyncio.subprocess.Process | None = None
        self.url = ""

    async def start(self) -> None:
        if self.proc is not None:
            await self.proc.wait()  # killed
        port = free_port()
        env = os.environ | {"FAKE_VLLM_TOKEN_DELAY": str(self.token_delay)}
        self.proc = await asyncio.create_subprocess_exec(
            sys.executable, str(FAKE), "serve", "org/m", "--served-model-name", "m",
            "--host", "127.0.0.1", "--port", str(port), "--api-key", ENGINE_KEY,
            env=env, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL)
        self.url = f"http://127.0.0.1:{port}"
        async with httpx.AsyncClient() as c:
            for _ in range(200):
                try:
                    if (await c.get(self.url + "/health", timeout=1)).status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
                await asyncio.sleep(0.05)
        raise RuntimeError(f"engine {self.rid} did not start")

    def kill(self) -> None:
        if self.proc is not None and self.proc.returncode is None:
            os.kill(self.proc.pid, signal.SIGKILL)


def route(table: RouteTable, engines: dict[str, Engine]) -> None:
    table.set_endpoints({"m": [Endpoint(e.rid, e.url, ENGINE_KEY, engine="vllm")
                               for e in engines.values()]})


async def one_stream(client: openai.AsyncOpenAI, engines: dict[str, Engine],
                     kill_at: int) -> tuple[bool, float | None, str]:
    """(read to the end, the gap around the kill in seconds, the replica killed)."""
    raw = await client.chat.completions.with_raw_response.create(
        model="m", messages=[{"role": "user", "content": ASKED}], stream=True,
        stream_options={"include_usage": True})
    rid = raw.headers["x-llmgw-replica"]
    stream = raw.parse()
    words: list[str] = []
    killed_at: float | None = None
    gap: float | None = None
    try:
        if kill_at == 0:
            engines[rid].kill()
            killed_at = time.monotonic()
        async for chunk in stream:
            if not chunk.choices or not chunk.choices[0].delta.content:
                continue
            words.append(chunk.choices[0].delta.content)
            if killed_at is not None and gap is None:
                gap = time.monotonic() - killed_at
            if len(words) == kill_at:
                engines[rid].kill()
                killed_at = time.monotonic()
    except openai.APIError as exc:
        print(f"  kill after {kill_at} words: {exc}", flush=True)
        return False, gap, rid
    ok = "".join(words) == WHOLE
    if not ok:
        print(f"  kill after {kill_at} words: text differs: {''.join(words)!r}", flush=True)
    return ok, gap, rid


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--streams", type=int, default=100)
    ap.add_argument("--engines", type=int, default=3)
    ap.add_argument("--token-delay", type=float, default=0.02)
    ap.add_argument("--seed", type=int, default=18)
    args = ap.parse_args()
    rand = random.Random(args.seed)

    table = RouteTable()
    table.set_catalog([CatalogEntry("m")])
    table.set_client_keys({hash_key(CLIENT_KEY): KeyGrant("k1", "bench")})
    # The gateway's default timeouts but a short cooldown: each engine here
    # is killed often, and started again at once.
    proxy = Proxy(table, hash_key, Timeouts(cooldown=1.0), options=ProxyOptions(affinity=False))
    engines = {f"r{i}": Engine(f"r{i}", args.token_delay) for i in range(args.engines)}
    await asyncio.gather(*(e.start() for e in engines.values()))
    route(table, engines)
    await proxy.start()
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(proxy, host="127.0.0.1", port=port,
                                           log_level="error", lifespan="off"))
    serving = asyncio.create_task(server.serve())
    for _ in range(500):
        if server.started:
            break
        await asyncio.sleep(0.02)
    client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=CLIENT_KEY,
                                max_retries=0, timeout=60)
    read_to_end = errors = 0
    gaps: list[float] = []
    began = time.monotonic()
    try:
        for i in range(args.streams):
            ok, gap, rid = await one_stream(client, engines, rand.randint(0, 31))
            read_to_end += ok
            errors += not ok
            if gap is not None:
                gaps.append(gap)
            await engines[rid].start()  # again, on a new port
            route(table, engines)
            if (i + 1) % 10 == 0:
                print(f"  {i + 1} streams: {read_to_end} read to the end", flush=True)
    finally:
        await client.close()
        server.should_exit = True
        await serving
        await proxy.stop()
        for e in engines.values():
            e.kill()
            if e.proc is not None:
                await e.proc.wait()
    gap_ms = (f"gap_ms_p50={statistics.median(gaps) * 1000:.0f} "
              f"gap_ms_max={max(gaps) * 1000:.0f}") if gaps else "gap_ms=none"
    print(f"continuation: streams={args.streams} read_to_end={read_to_end} errors={errors} "
          f"engines={args.engines} token_delay_s={args.token_delay} {gap_ms} "
          f"seconds={time.monotonic() - began:.0f}")


if __name__ == "__main__":
    asyncio.run(main())
