"""Prompt affinity behind a load balancer: do three gateways agree on each
conversation's replica, and what is that worth in time to first token?

One etcd, gateways in cluster mode, one agent running 4 replicas of the
vLLM stand-in (tests/fakes/bin/vllm, `--max-num-seqs` = `--capacity`),
whose prefix cache makes a prompt's cached messages free and charges
`--prefill-ms` per uncached token before the first token (as vLLM's
automatic prefix caching does), and whose answers take `--token-ms` a word.
Three gateways route with affinity, three more (same etcd, same replicas)
without, for the comparison. Every turn of a conversation goes to the next
gateway of its three, as a round-robin load balancer would send it.

Agreement: the fraction of `--conversations` conversations (`--turns` turns
each, half keyed by an X-Session-Id, half by their first messages) whose
every turn landed on one replica (the `x-llmgw-replica` header):
- idle: nothing else runs;
- half: each replica kept at half its capacity by long streams of its own
  (sessions whose ring home it is) while the conversations run;
- after kill: each conversation's first half of its turns before one
  affinity gateway is SIGKILLed, its second half through the two left,
  within 5 s of the kill (the time it took is printed).
TTFT: `--sessions` chats of `--ttft-turns` turns with `--system-words`-word
system prompts, all at once; time to first token from the second turn on,
through the affinity gateways and through the others.

    .venv/bin/python bench/affinity.py [--conversations 100 --turns 4]

Figures, not a test; the last line: `affinity: agree_idle=<x> agree_half=<x>
agree_after_kill=<x> ttft_gain=<mean TTFT without / mean with>`
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import aiohttp

ROOT = Path(__file__).resolve().parents[1]
for p in (str(ROOT), str(ROOT / "bench")):
    if p not in sys.path:
        sys.path.insert(0, p)

from fleet import MODEL, Fleet, http  # noqa: E402

from app.router.choice import ring_order  # noqa: E402

Messages = list[dict[str, str]]


async def turn(session: aiohttp.ClientSession, url: str, key: str, messages: Messages,
               sid: str | None, max_tokens: int) -> tuple[str, float, str]:
    """One streamed turn: (the replica that served it, ms to the first
    content, the answer)."""
    headers = {"Authorization": f"Bearer {key}"} | ({"X-Session-Id": sid} if sid else {})
    started = time.perf_counter()
    first: float | None = None
    text = []
    async with session.post(url + "/v1/chat/completions", headers=headers, json={
            "model": MODEL, "messages": messages, "stream": True,
            "max_tokens": max_tokens}) as resp:
        resp.raise_for_status()
        replica = resp.headers.get("x-llmgw-replica", "?")
        async for raw in resp.content:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            delta = json.loads(line[6:])["choices"][0]["delta"].get("content")
            if delta:
                first = first if first is not None else time.perf_counter() - started
                text.append(delta)
    if first is None:
        raise RuntimeError("no content streamed")
    return replica, first * 1000, "".join(text)


class Chat:
    """One conversation: its history, and where each turn landed."""

    def __init__(self, n: int, tag: str, system_words: int, keyed_by_session: bool) -> None:
        system = " ".join(f"rule{tag}{n}-{i}" for i in range(system_words))
        self.n = n
        self.messages: Messages = [{"role": "system", "content": system}]
        self.sid = f"{tag}-user-{n}" if keyed_by_session else None
        self.replicas: set[str] = set()
        self.ttfts: list[float] = []  # from the second turn on
        self.turns = 0

    async def next(self, session: aiohttp.ClientSession, url: str, key: str,
                   max_tokens: int) -> None:
        self.messages.append({"role": "user", "content": f"turn {self.turns} of {self.n}"})
        replica, ms, answer = await turn(session, url, key, self.messages, self.sid, max_tokens)
        self.messages.append({"role": "assistant", "content": answer})
        self.replicas.add(replica)
        if self.turns:
            self.ttfts.append(ms)
        self.turns += 1


async def gathered(jobs: Sequence[Callable[[], Awaitable[None]]], at_once: int) -> None:
    gate = asyncio.Semaphore(at_once)

    async def one(job: Callable[[], Awaitable[None]]) -> None:
        async with gate:
            await job()

    await asyncio.gather(*(one(j) for j in jobs))


async def converse(session: aiohttp.ClientSession, urls: Sequence[str], key: str,
                   chats: Sequence[Chat], turns: int, max_tokens: int, at_once: int) -> None:
    """`turns` more turns of each chat, each through the next of `urls`."""
    async def run(c: Chat) -> None:
        for _ in range(turns):
            await c.next(session, urls[(c.n + c.turns) % len(urls)], key, max_tokens)

    await gathered([lambda c=c: run(c) for c in chats], at_once)  # type: ignore[misc]


def chats(tag: str, n: int, system_words: int = 8) -> list[Chat]:
    return [Chat(i, tag, system_words, keyed_by_session=i % 2 == 1) for i in range(n)]


def agreed(cs: Sequence[Chat]) -> int:
    return sum(len(c.replicas) == 1 for c in cs)


async def background(session: aiohttp.ClientSession, urls: Sequence[str], key: str,
                     replicas: Sequence[str], per_replica: int, stop: asyncio.Event,
                     max_tokens: int) -> None:
    """Keeps `per_replica` long streams on each replica: sessions whose
    home on the affinity ring it is, restarted as each ends."""
    sids: list[str] = []
    for rid in replicas:
        found = (f"bg-{i}" for i in range(10_000) if ring_order(replicas, f"s:bg-{i}")[0] == rid)
        sids += [next(found) for _ in range(per_replica)]

    async def loop(i: int, sid: str) -> None:
        # The stand-in echoes the prompt: as many words asked as answered.
        msgs = [{"role": "user", "content": " ".join([sid] * max_tokens)}]
        while not stop.is_set():
            await turn(session, urls[i % len(urls)], key, msgs, sid, max_tokens)

    await asyncio.gather(*(loop(i, sid) for i, sid in enumerate(sids)))


async def sample(fleet: Fleet, into: list[dict[str, float]]) -> None:
    """Each replica's running requests as gw-a scraped them, every 0.5 s."""
    url = f"{fleet.gateways[0].url}/admin/routes?model={MODEL}"
    while True:
        status, body = await asyncio.to_thread(http, "GET", url, None, fleet.admin)
        if status == 200:
            into.append({r["replica"]: r["engine"]["running"] for r in body["endpoints"]
                         if r.get("engine")})
        await asyncio.sleep(0.5)


async def measure(fleet: Fleet, replicas: list[str], args: argparse.Namespace
                  ) -> dict[str, Any]:
    on = [g.url for g in fleet.gateways[:3]]
    off = [g.url for g in fleet.gateways[3:]]
    key, n, turns, mt = fleet.key, args.conversations, args.turns, args.answer_words
    out: dict[str, Any] = {}
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(timeout=timeout,
                                     connector=aiohttp.TCPConnector(limit=0)) as s:
        if "idle" in args.phases:
            idle = chats("idle", n)
            await converse(s, on, key, idle, turns, mt, args.at_once)
            out["idle"] = agreed(idle)
            print(f"idle fleet: {out['idle']}/{n} conversations on one replica", flush=True)
        if "half" in args.phases:
            await half_capacity(s, fleet, replicas, args, out)
        if "ttft" in args.phases:
            out["ttft"] = await ttfts(s, on, off, key, args)
        if "kill" in args.phases:
            await after_kill(s, fleet, args, out)
    return out


async def half_capacity(s: aiohttp.ClientSession, fleet: Fleet, replicas: list[str],
                        args: argparse.Namespace, out: dict[str, Any]) -> None:
    """The chats while each replica runs half its capacity of long streams."""
    on = [g.url for g in fleet.gateways[:3]]
    key, n, turns, mt = fleet.key, args.conversations, args.turns, args.answer_words
    stop = asyncio.Event()
    bg = asyncio.create_task(background(s, on, key, replicas, args.capacity // 2, stop,
                                        args.background_words))
    await asyncio.sleep(3)  # the streams running, and scraped
    samples: list[dict[str, float]] = []
    watch = asyncio.create_task(sample(fleet, samples))
    half = chats("half", n)
    await converse(s, on, key, half, turns, mt, args.at_once)
    stop.set()
    watch.cancel()
    await bg
    out["half"] = agreed(half)
    mean = {rid: statistics.mean(x.get(rid, 0.0) for x in samples) for rid in replicas}
    print(f"half capacity ({args.capacity // 2} streams of {args.capacity} per replica; "
          f"engines' running, mean of {len(samples)} scrapes: "
          f"{' '.join(f'{v:.1f}' for v in mean.values())}): "
          f"{out['half']}/{n} on one replica", flush=True)


async def ttfts(s: aiohttp.ClientSession, on: list[str], off: list[str], key: str,
                args: argparse.Namespace) -> dict[str, list[float]]:
    ttft: dict[str, list[float]] = {}
    for name, urls in (("on", on), ("off", off)):
        cs = chats(f"ttft-{name}", args.sessions, args.system_words)
        await converse(s, urls, key, cs, args.ttft_turns, 8, args.sessions)
        ttft[name] = [ms for c in cs for ms in c.ttfts]
        homes = collections.Counter(r for c in cs for r in c.replicas)
        print(f"ttft affinity {name:3s}, turns 2+: n={len(ttft[name])} "
              f"p50 {pct(ttft[name], 50):.0f} ms, p90 {pct(ttft[name], 90):.0f} ms, "
              f"mean {statistics.mean(ttft[name]):.0f} ms; chats per replica "
              f"{sorted(homes.values())}", flush=True)
    return ttft


async def after_kill(s: aiohttp.ClientSession, fleet: Fleet, args: argparse.Namespace,
                     out: dict[str, Any]) -> None:
    """Half of each chat's turns through all three affinity gateways, then
    one SIGKILLed, the rest through the two left, as fast as they go (twice
    as many chats at once as elsewhere: within the 5 s, short of saturating)."""
    on = [g.url for g in fleet.gateways[:3]]
    n, turns = args.conversations, args.turns
    killed = chats("kill", n)
    first = turns // 2
    await converse(s, on, fleet.key, killed, first, args.answer_words, args.at_once)
    fleet.gateways[2].proc.kill()
    at = time.monotonic()
    await converse(s, on[:2], fleet.key, killed, turns - first, args.answer_words,
                   2 * args.at_once)
    took = time.monotonic() - at
    out["kill"] = agreed(killed)
    print(f"after killing {fleet.gateways[2].name}: {out['kill']}/{n} on one replica; "
          f"their last {turns - first} turns took {took:.1f} s after the kill"
          + ("" if took <= 5 else " (more than 5 s: a loaded machine)"), flush=True)


def pct(values: list[float], q: int) -> float:
    return statistics.quantiles(values, n=100)[q - 1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--conversations", type=int, default=100)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--at-once", type=int, default=8, help="conversations at once")
    p.add_argument("--capacity", type=int, default=8, help="each replica's --max-num-seqs")
    p.add_argument("--answer-words", type=int, default=5)
    p.add_argument("--token-ms", type=float, default=10.0, help="per answer word")
    p.add_argument("--background-words", type=int, default=300)
    p.add_argument("--sessions", type=int, default=16)
    p.add_argument("--ttft-turns", type=int, default=6)
    p.add_argument("--system-words", type=int, default=1500)
    p.add_argument("--prefill-ms", type=float, default=0.5, help="per uncached token")
    p.add_argument("--phases", default="idle,half,ttft,kill",
                   help="which of idle,half,ttft,kill to run (the last line needs all)")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="llmgw-affinity-") as tmp:
        fleet = Fleet(Path(tmp), {"FAKE_VLLM_PREFILL_DELAY": str(args.prefill_ms / 1000),
                                  "FAKE_VLLM_TOKEN_DELAY": str(args.token_ms / 1000)})
        try:
            fleet.start_etcd()
            for i, name in enumerate(("gw-a", "gw-b", "gw-c", "gw-x", "gw-y", "gw-z")):
                fleet.start_gateway(name, affinity=i < 3)
            fleet.start_agent()
            replicas = fleet.serve_model(args.capacity)
            out = asyncio.run(measure(fleet, replicas, args))
        finally:
            fleet.stop()
    n = args.conversations
    agree = {k: f"{out[k] / n:.2f}" if k in out else "-" for k in ("idle", "half", "kill")}
    # Mean, not p50: without affinity about half the turns pay the whole
    # prefill and half almost none, so the median sits on that edge.
    gain = (f"{statistics.mean(out['ttft']['off']) / statistics.mean(out['ttft']['on']):.2f}"
            if "ttft" in out else "-")
    print(f"affinity: agree_idle={agree['idle']} agree_half={agree['half']} "
          f"agree_after_kill={agree['kill']} ttft_gain={gain}")


if __name__ == "__main__":
    main()
