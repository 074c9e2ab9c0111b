"""Time to first token over multi-turn chats: prompt affinity against power
of two choices alone, side by side.

One all-in-one gateway (embedded store) runs 4 replicas of the vLLM
stand-in, whose prefix cache makes a prompt's cached messages free and
charges `--prefill-ms` per uncached token before the first token (as vLLM's
automatic prefix caching does with KV blocks). Conversations share nothing
but their turns: each has its own long system prompt, and each turn resends
the whole history. With affinity, a conversation stays on the replica that
holds its prefix; without, each turn lands wherever two random draws say.

    .venv/bin/python bench/affinity.py [--sessions 16 --turns 6]

Figures, not a test; the last line: `affinity: ttft_p50_ms_on=<x>
ttft_p50_ms_off=<x> ttft_p90_ms_on=<x> ttft_p90_ms_off=<x> ratio_p50=<x>`
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parents[1]
FAKE_VLLM = ROOT / "tests" / "fakes" / "bin" / "vllm"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def wait_ok(session: aiohttp.ClientSession, url: str, headers: dict[str, str],
                  pred: object = None, timeout: float = 60) -> object:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            async with session.get(url, headers=headers) as r:
                if r.status == 200:
                    body = await r.json()
                    if pred is None or pred(body):  # type: ignore[operator]
                        return body
        except aiohttp.ClientError:
            pass
        await asyncio.sleep(0.2)
    raise TimeoutError(url)


async def first_token_ms(session: aiohttp.ClientSession, url: str, key: str,
                         messages: list[dict[str, str]]) -> tuple[float, str]:
    """Sends one streamed turn; returns (ms to the first content, the answer)."""
    started = time.perf_counter()
    first: float | None = None
    text = []
    async with session.post(url + "/v1/chat/completions",
                            headers={"Authorization": f"Bearer {key}"},
                            json={"model": "chat", "messages": messages, "stream": True,
                                  "max_tokens": 8}) as resp:
        resp.raise_for_status()
        async for raw in resp.content:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            delta = json.loads(line[6:])["choices"][0]["delta"].get("content")
            if delta:
                first = first if first is not None else time.perf_counter() - started
                text.append(delta)
    assert first is not None, "no content streamed"
    return first * 1000, "".join(text)


async def conversation(session: aiohttp.ClientSession, url: str, key: str, n: int,
                       turns: int, system_words: int) -> list[float]:
    system = " ".join(f"rule{n}-{i}" for i in range(system_words))
    messages = [{"role": "system", "content": system}]
    out = []
    for t in range(turns):
        messages.append({"role": "user", "content": f"turn {t} of chat {n}"})
        ms, answer = await first_token_ms(session, url, key, messages)
        if t > 0:  # the first turn prefills everything either way
            out.append(ms)
        messages.append({"role": "assistant", "content": answer})
    return out


async def run_once(affinity: bool, args: argparse.Namespace) -> list[float]:
    port = free_port()
    data = Path(tempfile.mkdtemp(prefix="llmgw-affinity-"))
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLMGW_")} | {
        "LLMGW_PORT": str(port), "LLMGW_DATA_DIR": str(data), "LLMGW_LOCAL_GPUS": "4",
        "LLMGW_VLLM_BIN": str(FAKE_VLLM), "LLMGW_STOP_ENGINES_ON_EXIT": "true",
        "LLMGW_ROUTER_AFFINITY": "true" if affinity else "false",
        "FAKE_VLLM_PYTHON": sys.executable,
        "FAKE_VLLM_PREFILL_DELAY": str(args.prefill_ms / 1000)}
    # Started once per run, before anything is timed: blocking is harmless.
    proc = subprocess.Popen(  # noqa: ASYNC220
        [sys.executable, "-m", "app.cli", "--log-level", "warning", "serve"],
        cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        async with aiohttp.ClientSession() as session:
            await wait_ok(session, url + "/readyz", {})
            admin = {"Authorization": f"Bearer {(data / 'admin-token').read_text().strip()}"}
            async with session.put(url + "/admin/models/chat", headers=admin, json={
                    "model": "acme/chat", "gpus": 1, "replicas": {"min": 4, "max": 4}}) as r:
                r.raise_for_status()
            async with session.post(url + "/admin/keys", headers=admin,
                                    json={"name": "bench"}) as r:
                key = (await r.json())["key"]
            await wait_ok(session, url + "/admin/replicas", admin,
                          lambda reps: sum(x["phase"] == "ready" for x in reps) == 4)
            await asyncio.sleep(2)  # every router has all four
            results = await asyncio.gather(*(
                conversation(session, url, key, n, args.turns, args.system_words)
                for n in range(args.sessions)))
        return [ms for chat in results for ms in chat]
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(30)


def pct(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100)[int(q) - 1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sessions", type=int, default=16)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--system-words", type=int, default=1500)
    p.add_argument("--prefill-ms", type=float, default=0.5, help="per uncached token")
    args = p.parse_args()
    on = asyncio.run(run_once(True, args))
    off = asyncio.run(run_once(False, args))
    for name, vals in (("affinity", on), ("p2c only", off)):
        print(f"{name:9s} turns 2+: n={len(vals)} ttft p50 {pct(vals, 50):.0f} ms, "
              f"p90 {pct(vals, 90):.0f} ms")
    print(f"affinity: ttft_p50_ms_on={pct(on, 50):.1f} ttft_p50_ms_off={pct(off, 50):.1f} "
          f"ttft_p90_ms_on={pct(on, 90):.1f} ttft_p90_ms_off={pct(off, 90):.1f} "
          f"ratio_p50={pct(on, 50) / pct(off, 50):.3f}")


if __name__ == "__main__":
    main()
