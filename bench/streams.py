#!/usr/bin/env python3
"""Concurrent SSE streams per core: llmgw beside vllm-router, nginx, the
Python floor and a byte relay, in front of one stand-in, stepping up the
number of streams.

Not a test (pytest never collects bench/). From the repository root:

    python bench/streams.py                         # 256..4096 streams, ~5 min
    python bench/streams.py --steps 256,512 --targets direct,llmgw --profile 512

Layout as bench/router_overhead.py: each proxy pinned to core 0 (taskset);
the stand-in (bench/standin.py, a chunk every `--chunk-ms` ms, 20: 50 chunks
a second), etcd, llmgw's agent and this process, the client, on core 1. Every
proxy is started before the first step and measured side by side, step by
step: at each step (256, 512, 1,024, 2,048, 4,096 streams) `direct` (the
stand-in alone: what the load side itself adds) and then every target still
clean. Stream starts are spread over `--ramp` s; each stream lasts
`--ramp + --steady` s. Only chunks written while every stream of the step
was running count (the steady window): a chunk's delay is the client's
monotonic time on reading it minus the stand-in's stamp in it (written at
its send; CLOCK_MONOTONIC is system-wide). The added delay is a target's p99
minus `direct`'s p99 in the same step. A step is clean when every stream got
HTTP 200, every chunk and `[DONE]`, and the added p99 is at most
`--limit-ms` (10); a target stops at its first step that is not.

The client is raw asyncio protocols on uvloop (an aiohttp client costs more
CPU per chunk than some proxies do). Beside each figure: the proxy's CPU
share of its core, the stand-in's and the client's, over the step's wall
time; when the load side's two (on one core) pass 0.9, the step measures the
load side, and the row says so. The proxy's CPU a chunk is split into user
space (its own code and its runtime's) and the kernel (the reads and writes
every proxy makes): the kernel's share is much the same for all, so the
user figure is what a proxy's design decides. `relay` (bench/tcp_relay.py)
is the least any Python proxy on uvloop can spend a chunk: bytes from one
socket written to the other, nothing parsed.

Writes its section of bench/RESULTS.md (bench/sections.py); the last line
(also printed last):
`streams: llmgw_clean=N vllmrouter_clean=N nginx_clean=N floor_clean=N relay_clean=N
direct_clean=N` and each target's streams per core.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import os
import re
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httptools
import uvloop

ROOT = Path(__file__).resolve().parents[1]
for p in (str(ROOT), str(ROOT / "bench")):
    if p not in sys.path:
        sys.path.insert(0, p)

import load  # noqa: E402
import peers  # noqa: E402
import sections  # noqa: E402
from loop_seen import LoopSeen, between, scrape  # noqa: E402
from peers import MODEL, Peer, Unavailable  # noqa: E402
from router_overhead import cpu_seconds, cpu_split, group  # noqa: E402

# In this order each round (reversed every other one): llmgw and
# vllm-router, whose ratio is the goal, measured back to back, so that what
# drifts on a shared machine over a round weighs least on their pairs.
TARGETS = ("direct", "llmgw", "vllm-router", "llmgw-granian", "nginx", "floor", "relay")
STAMP = re.compile(rb"@(\d+\.\d+) ")
LOAD_SIDE_BUSY = 0.9


@dataclass
class Step:
    target: str
    streams: int
    clean: int = 0  # streams read whole
    round: int = 0  # which of the step's rounds (--rounds), from 0
    delays: list[float] = field(default_factory=list)  # seconds, steady window only
    first_error: str = ""
    wall: float = 0.0
    proxy_util: float = float("nan")
    proxy_user_util: float = float("nan")  # of proxy_util, what ran in user space
    standin_util: float = 0.0
    client_util: float = 0.0
    added_p99_ms: float = float("nan")
    limit_ms: float = 10.0
    chunks: int = 0  # chunks read, every stream and all its chunks
    loop: LoopSeen | None = None  # llmgw's own /metrics over the step

    def cpu_per_chunk_us(self) -> float:
        """The proxy's CPU per chunk relayed, its streams' setup included:
        steadier than delays on a shared machine, where the proxy gets a
        share of its core that moves from minute to minute."""
        return self.proxy_util * self.wall / self.chunks * 1e6 if self.chunks else float("nan")

    def user_kernel_per_chunk_us(self) -> tuple[float, float]:
        """CPU per chunk split: in the proxy's own code (and its runtime's),
        in the kernel (the system calls every proxy makes)."""
        whole = self.cpu_per_chunk_us()
        user = whole * self.proxy_user_util / self.proxy_util if self.proxy_util else float("nan")
        return user, whole - user

    def per_core(self, chunk_s: float) -> float:
        """Streams one whole core would carry at this CPU per chunk (a
        projection, not a measured clean count)."""
        return 1e6 / (self.cpu_per_chunk_us() / chunk_s)

    def p99_ms(self) -> float:
        return load.pct(self.delays, .99) * 1e3

    def fail(self, why: str) -> None:
        if not self.first_error:
            self.first_error = why


class _Stream(asyncio.Protocol):
    """One SSE stream: sends its request, reads stamps as they come (the
    body de-chunked by httptools: a proxy may cut chunks anywhere, a stamp
    included)."""

    def __init__(self, request: bytes, step: Step, window: tuple[float, float],
                 done: asyncio.Future[None]) -> None:
        self.request, self.step, self.window, self.done = request, step, window, done
        self.parser = httptools.HttpResponseParser(self)
        self.buf = b""
        self.status = 0
        self.error_body = b""
        self.stamps = 0
        self.finished = False
        self.now = 0.0
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        transport.write(self.request)  # type: ignore[attr-defined]

    def data_received(self, data: bytes) -> None:
        self.now = time.monotonic()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._end(f"not HTTP: {exc}")

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()

    def on_body(self, body: bytes) -> None:
        if self.status != 200:
            self.error_body += body
            return
        buf = self.buf + body
        cut = buf.rfind(b"\n\n")
        if cut < 0:
            self.buf = buf
            return
        whole, self.buf = buf[:cut], buf[cut + 2:]
        lo, hi = self.window
        delays, now = self.step.delays, self.now
        for m in STAMP.finditer(whole):
            self.stamps += 1
            written = float(m.group(1))
            if lo <= written <= hi:
                delays.append(now - written)
        if b"data: [DONE]" in whole:
            self.finished = True

    def on_message_complete(self) -> None:
        if self.status != 200:
            self._end(f"HTTP {self.status} {self.error_body[:300].decode(errors='replace')}")
        else:
            self._end("" if self.finished else "the stream ended without [DONE]")

    def connection_lost(self, exc: Exception | None) -> None:
        self._end(f"connection closed after {self.stamps} chunks" + (f" ({exc})" if exc else ""))

    def _end(self, why: str) -> None:
        if self.done.done():
            return
        if why:
            self.step.fail(why)
        self.done.set_result(None)
        if self.transport is not None:
            self.transport.close()


async def run_step(peer: Peer, n: int, chunks: int, chunk_s: float, ramp: float,
                   steady: float, step: Step) -> None:
    loop = asyncio.get_running_loop()
    host, port = peer.url.removeprefix("http://").rsplit(":", 1)
    body = (b'{"model": "' + MODEL.encode() + b'", "stream": true, "max_tokens": '
            + str(chunks).encode() + b', "messages": [{"role": "user", "content": "'
            + load.PROMPT.encode() + b'"}]}')
    request = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: " + host.encode()
               + b"\r\nAuthorization: Bearer " + peer.token.encode()
               + b"\r\nContent-Type: application/json\r\nContent-Length: "
               + str(len(body)).encode() + b"\r\n\r\n" + body)
    t0 = time.monotonic()
    window = (t0 + ramp + 0.1, t0 + ramp + steady - 0.1)
    futures: list[asyncio.Future[None]] = []
    streams: list[_Stream] = []

    async def start(i: int) -> None:
        await asyncio.sleep(ramp * i / n)
        fut = loop.create_future()
        futures.append(fut)
        proto = _Stream(request, step, window, fut)
        streams.append(proto)
        try:
            await loop.create_connection(lambda: proto, host, int(port))
        except OSError as exc:
            step.fail(f"connect: {exc}")
            fut.set_result(None)

    await asyncio.gather(*(start(i) for i in range(n)))
    deadline = ramp + steady + chunks * chunk_s + 30
    _, pending = await asyncio.wait(futures, timeout=deadline)
    for f in pending:
        f.cancel()
    if pending:
        step.fail(f"{len(pending)} streams unfinished after {deadline:.0f} s")
    step.chunks = sum(s.stamps for s in streams)
    for s in streams:
        if s.transport is not None:
            s.transport.close()
        if s.finished and s.stamps == chunks:
            step.clean += 1
        elif s.finished:
            step.fail(f"{s.stamps} of {chunks} chunks")
    await asyncio.sleep(0)


def measure(runner: asyncio.Runner, peer: Peer, n: int, pids: list[int], standin: int,
            args: argparse.Namespace) -> Step:
    step = Step(peer.name, n, limit_ms=args.limit_ms)
    steady = args.steady
    chunks = round((args.ramp + steady) / (args.chunk_ms / 1e3))
    p0, s0, c0, t0 = cpu_split(pids), cpu_seconds([standin]), sum(os.times()[:2]), \
        time.monotonic()
    runner.run(run_step(peer, n, chunks, args.chunk_ms / 1e3, args.ramp, steady, step))
    step.wall = time.monotonic() - t0
    if pids:
        p1 = cpu_split(pids)
        step.proxy_util = (sum(p1) - sum(p0)) / step.wall
        step.proxy_user_util = (p1[0] - p0[0]) / step.wall
    step.standin_util = (cpu_seconds([standin]) - s0) / step.wall
    step.client_util = (sum(os.times()[:2]) - c0) / step.wall
    return step


def profile_llmgw(gw: peers.Llmgw, seconds: float, out: Path, tmp: Path) -> peers.Process:
    return peers.Process("py-spy", [peers.py_spy(), "record", "--pid", str(gw.gateway.pid),
                                    "--duration", str(max(1, round(seconds))), "--rate", "250",
                                    "--format", "raw", "--output", str(out), "--threads"],
                         tmp / "py-spy.log").start()


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--targets", default=",".join(TARGETS))
    p.add_argument("--steps", default="256,512,1024,2048,4096")
    p.add_argument("--chunk-ms", type=float, default=20)
    p.add_argument("--ramp", type=float, default=2.0, help="seconds over which streams start")
    p.add_argument("--steady", type=float, default=3.0,
                   help="seconds every stream of a step runs together (delays counted)")
    p.add_argument("--limit-ms", type=float, default=10.0, help="most added p99 delay")
    p.add_argument("--rounds", type=int, default=1,
                   help="each step measured this many times, the targets alternated "
                        "within each round; the goal compares the medians")
    p.add_argument("--vllm-router-venv", type=Path, default=Path("/tmp/bench-vrouter"))
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="py-spy llmgw's gateway in a repeat of its step of N streams")
    p.add_argument("--results", type=Path, default=ROOT / "bench" / "RESULTS.md")
    args = p.parse_args(argv)
    args.targets = [t for t in args.targets.split(",") if t]
    args.steps = [int(n) for n in args.steps.split(",") if n]
    if set(args.targets) - set(TARGETS) or "direct" not in args.targets:
        p.error(f"--targets: some of {TARGETS}, direct included")
    return args


def render(steps: list[Step], args: argparse.Namespace, notes: dict[str, str],
           load_before: tuple[float, ...], load_after: tuple[float, ...], wall: float,
           prof: str) -> str:
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    out = [
        "## Streams per core: llmgw beside other proxies, one run (bench/streams.py)", "",
        f"Written by `python bench/streams.py` on {now}: nproc {os.cpu_count()}, Python "
        f"proxies on {peers.interpreter()}, load average "
        f"{load_before[0]:.2f} before, {load_after[0]:.2f} after, {wall:.0f} s in all; a chunk "
        f"every {args.chunk_ms:g} ms, starts spread over {args.ramp:g} s, delays counted over "
        f"{args.steady:g} s with every stream running; clean = every stream whole and the "
        f"added p99 within {args.limit_ms:g} ms.",
        "Each proxy pinned to core 0; the stand-in, etcd, llmgw's agent and the client on "
        "core 1. CPU columns: share of one core over the step. A row whose stand-in + client "
        f"pass {LOAD_SIDE_BUSY} measured the load side, not the proxy.", "",
        "| target | streams | clean | delay p50/p99 ms | added p99 ms | proxy CPU "
        "| stand-in CPU | client CPU | proxy CPU/chunk us | of which user/kernel us "
        "| streams/core at that CPU | first problem |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for s in steps:
        busy = s.standin_util + s.client_util > LOAD_SIDE_BUSY
        user, kernel = s.user_kernel_per_chunk_us()
        out.append(
            f"| {s.target} | {s.streams}{f' ({s.round + 1})' if args.rounds > 1 else ''} | "
            f"{s.clean} | "
            f"{load.pct(s.delays, .5) * 1e3:.1f}/{s.p99_ms():.1f} | {s.added_p99_ms:.1f} | "
            f"{s.proxy_util:.2f} | {s.standin_util:.2f} | {s.client_util:.2f}"
            f"{' (load side busy)' if busy else ''} | {s.cpu_per_chunk_us():.1f} | "
            f"{user:.1f}/{kernel:.1f} | "
            f"{s.per_core(args.chunk_ms / 1e3):.0f} | {s.first_error or '-'} |")
    out += ["", "Targets: " + "; ".join(f"{k}: {v}" for k, v in notes.items()), ""]
    seen = [s for s in steps if s.loop is not None]
    if seen:
        out += ["llmgw's event loop over each step, as its /metrics says "
                "(`llmgw_event_loop_lag_seconds`, a tick every 0.1 s, and "
                "`llmgw_gc_pause_seconds`):", ""]
        out += [f"- {s.streams} streams: {s.loop.line()}" for s in seen if s.loop is not None]
        out.append("")
    out += goals(steps, args)
    if prof:
        out += ["### Profile of llmgw's gateway (py-spy)", "", "```", prof.rstrip(), "```", ""]
    out.append(summary(steps, args))
    return "\n".join(out) + "\n"


def ok(s: Step) -> bool:
    """Every stream whole, and the added p99 within the limit (direct: whole only)."""
    return (s.clean == s.streams and not s.first_error
            and (s.target == "direct" or not s.added_p99_ms > s.limit_ms))


def largest_clean(steps: list[Step], target: str) -> int:
    best = 0
    for s in steps:
        if s.target == target:
            if not ok(s):
                break
            best = s.streams
    return best


def goals(steps: list[Step], args: argparse.Namespace) -> list[str]:
    """The streams goal (issue 28), checked on this run: llmgw's streams per
    core at or above vllm-router's, on the way to nginx's. Compared in pairs,
    a step's round of llmgw beside the same round of the other (measured
    within seconds of each other), over the steps where both carried every
    stream clean (a projection from a proxy that fell behind is not a
    capacity): the median of the pairs' ratios, and of each one's figure.
    Then the most streams each carried clean on its one core."""
    by = {(s.target, s.streams, s.round): s for s in steps}
    chunk_s = args.chunk_ms / 1e3
    out: list[str] = []
    for peer, label, goal in (("vllm-router", "vllm-router's", 1.0), ("nginx", "nginx's", None)):
        pairs = sorted((n, r) for (t, n, r), s in by.items() if t == "llmgw" and ok(s)
                       and (peer, n, r) in by and ok(by[peer, n, r]))
        if not pairs:
            continue
        ratios = [by["llmgw", n, r].per_core(chunk_s) / by[peer, n, r].per_core(chunk_s)
                  for n, r in pairs]
        ours = statistics.median(by["llmgw", n, r].per_core(chunk_s) for n, r in pairs)
        theirs = statistics.median(by[peer, n, r].per_core(chunk_s) for n, r in pairs)
        ratio = statistics.median(ratios)
        by_step: dict[int, list[str]] = {}
        for (n, _), x in zip(pairs, ratios, strict=True):
            by_step.setdefault(n, []).append(f"{x:.2f}x")
        said = "; ".join(f"{n}: {', '.join(xs)}" for n, xs in by_step.items())
        mark = "-" if goal is None else ("- [x]" if ratio >= goal else "- [ ]")
        out.append(f"{mark} streams per core {'>= ' if goal else 'against '}{label}: "
                   f"{ours:,.0f} vs {theirs:,.0f} ({ratio:.2f}x, the median of {len(pairs)} "
                   f"pairs over the steps both carried clean; by step {said})")
    if out:
        most = {t: largest_clean(steps, t) for t in ("llmgw", "vllm-router", "nginx")
                if any(s.target == t for s in steps)}
        out.append("- most streams carried clean on one core: "
                   + ", ".join(f"{t} {n}" for t, n in most.items()))
        out = ["The streams goal, checked on this run:", "", *out, ""]
    return out


def summary(steps: list[Step], args: argparse.Namespace) -> str:
    names = {"llmgw": "llmgw", "llmgw-granian": "granian", "vllm-router": "vllmrouter",
             "nginx": "nginx", "floor": "floor", "relay": "relay", "direct": "direct"}
    # Each target's first step, the median over its rounds.
    first_n: dict[str, int] = {}
    for s in steps:
        first_n.setdefault(s.target, s.streams)
    first = {t: [s for s in steps if s.target == t and s.streams == n]
             for t, n in first_n.items()}
    per_core = " ".join(
        f"{names[t]}_per_core="
        f"{statistics.median(s.per_core(args.chunk_ms / 1e3) for s in first[t]):.0f}"
        for t in ("llmgw", "llmgw-granian", "vllm-router", "nginx", "floor", "relay")
        if t in first)
    return "streams: " + " ".join(f"{names[t]}_clean={largest_clean(steps, t)}"
                                  for t in ("llmgw", "llmgw-granian", "vllm-router", "nginx",
                                            "floor", "relay", "direct")) \
        + (" " + per_core if per_core else "")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    two = len(os.sched_getaffinity(0)) >= 2
    proxy_core, other_core = (0, 1) if two else (None, None)
    if other_core is not None:
        os.sched_setaffinity(0, {other_core})
    os.environ["STANDIN_CHUNK_MS"] = str(args.chunk_ms)
    started, load_before = time.monotonic(), os.getloadavg()
    tmp = Path(tempfile.mkdtemp(prefix="llmgw-streams-"))
    gw = peers.Llmgw(tmp, proxy_core, other_core)
    live: dict[str, Peer] = {}
    notes: dict[str, str] = {}
    steps: list[Step] = []
    prof = ""
    with peers.running(gw, tmp, others=lambda: live.values()):
        gw.start()
        assert gw.engine_pid is not None
        up, key = gw.engine_url, gw.engine_key
        starters: dict[str, Callable[[], Peer]] = {
            "direct": lambda: Peer("direct", up, key, None, "the stand-in itself"),
            "llmgw": lambda: Peer("llmgw", gw.url, gw.client_key, None,
                                  "cluster mode (etcd), through the agent's engine"),
            "llmgw-granian": gw.start_granian,
            "floor": lambda: peers.start_floor(tmp, proxy_core, up, key),
            "relay": lambda: peers.start_tcp_relay(tmp, proxy_core, up, key),
            "nginx": lambda: peers.start_nginx(tmp, proxy_core, up, key),
            "vllm-router": lambda: peers.start_vllm_router(tmp, proxy_core, up, key,
                                                           args.vllm_router_venv),
        }
        for name in args.targets:
            try:
                live[name] = starters[name]()
                notes[name] = live[name].note
            except Unavailable as exc:
                notes[name] = f"not measured: {exc}"
        print(f"setup {time.monotonic() - started:.1f} s; load {load_before[0]:.2f}; "
              f"targets {list(live)}", flush=True)
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            for n, r in [(n, r) for n in args.steps for r in range(args.rounds)]:
                base: Step | None = None
                # The order flipped every other round: no proxy always
                # right after another (the stand-in's and kernel's state).
                others = [t for t in args.targets if t in live and t != "direct"]
                for name in ["direct", *(others if r % 2 == 0 else others[::-1])]:
                    peer = live[name]
                    pids = ([gw.gateway.pid] if name == "llmgw" else
                            group(peer.proc.pid) if peer.proc is not None else [])
                    seen = scrape(gw.url) if name == "llmgw" else None
                    s = measure(runner, peer, n, pids, gw.engine_pid, args)
                    s.round = r
                    if seen is not None:
                        s.loop = between(seen, scrape(gw.url))
                    if name == "llmgw" and n == args.profile and r == 0:
                        # The step again, under py-spy, its figures not kept:
                        # py-spy stops the process for each sample.
                        time.sleep(1.0)
                        rec = profile_llmgw(gw, args.ramp + args.steady,
                                            tmp / "profile.txt", tmp)
                        measure(runner, peer, n, pids, gw.engine_pid, args)
                        if rec.popen is not None:
                            rec.popen.wait(30)
                        import flame
                        text = (tmp / "profile.txt").read_text() \
                            if (tmp / "profile.txt").exists() else ""
                        prof = (f"llmgw at {n} streams (a repeat of the step, under "
                                "py-spy; its figures not kept)\n\n" + flame.summarize(text)
                                if text else "py-spy wrote nothing:\n" + rec.tail())
                    if name == "direct":
                        base = s
                        s.added_p99_ms = 0.0
                    elif base is not None:
                        s.added_p99_ms = s.p99_ms() - base.p99_ms()
                    steps.append(s)
                    good = ok(s)
                    said = f" (round {r + 1})" if args.rounds > 1 else ""
                    print(f"  {name:<12} {n:5} streams{said}: {s.clean} clean, delay p99 "
                          f"{s.p99_ms():.1f} ms (added {s.added_p99_ms:+.1f}); CPU proxy "
                          f"{s.proxy_util:.2f} stand-in {s.standin_util:.2f} client "
                          f"{s.client_util:.2f}; {s.cpu_per_chunk_us():.1f} us a chunk"
                          + (f"; {s.first_error}" if s.first_error else ""), flush=True)
                    if s.loop is not None:
                        print(f"  {'':<12} loop: {s.loop.line()}", flush=True)
                    if not good and name != "direct":
                        live.pop(name).stop()
                    time.sleep(1.0)
                if len(live) <= 1 and "direct" in live:
                    break
    text = render(steps, args, notes, load_before, os.getloadavg(),
                  time.monotonic() - started, prof)
    sections.replace_section(args.results, "streams", text)
    print()
    print(text.split("\n### Profile")[0].rstrip() if prof else text.rstrip())
    if prof:
        print(text.rstrip().splitlines()[-1])
    return 0


if __name__ == "__main__":
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    sys.exit(main())
