"""Load for bench/router_overhead.py: wrk for plain requests, an asyncio SSE
client for streams. Both run on the core the proxies are not on.
"""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

PROMPT = "please repeat these words back to me one at a time until you are told to stop"
STAMP = re.compile(rb"@(\d+\.\d+) ")

# wrk's Lua hooks: the request, and one JSON line with exact percentiles (us).
WRK_LUA = """wrk.method = "POST"
wrk.body = {body}
wrk.headers["Content-Type"] = "application/json"
wrk.headers["Authorization"] = {auth}
done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    "WRKJSON {{\\"requests\\":%d,\\"duration_us\\":%d,\\"status\\":%d,\\"socket\\":%d," ..
    "\\"timeout\\":%d,\\"p50\\":%d,\\"p99\\":%d,\\"max\\":%d}}\\n",
    summary.requests, summary.duration, e.status, e.connect + e.read + e.write,
    e.timeout, latency:percentile(50), latency:percentile(99), latency.max))
end
"""


def lua_quote(s: str) -> str:
    return "'" + s.replace("\\", "\\\\").replace("'", "\\'") + "'"


def chat_body(model: str, stream: bool, max_tokens: int) -> dict[str, object]:
    return {"model": model, "messages": [{"role": "user", "content": PROMPT}],
            "max_tokens": max_tokens, "stream": stream}


@dataclass
class WrkResult:
    concurrency: int
    ok_rps: float = 0.0
    p50_ms: float = float("nan")
    p99_ms: float = float("nan")
    max_ms: float = float("nan")
    errors: int = 0  # non-2xx answers, socket errors and timeouts
    requests: int = 0
    proxy_cpu_us: float = float("nan")  # the proxy's CPU time per answered request
    raw: str = ""


def run_wrk(url: str, token: str, model: str, concurrency: int, duration: float,
            timeout: float = 10.0, threads: int = 1) -> WrkResult:
    body = json.dumps(chat_body(model, False, 8))
    with tempfile.NamedTemporaryFile("w", suffix=".lua", delete=False) as f:
        f.write(WRK_LUA.format(body=lua_quote(body), auth=lua_quote(f"Bearer {token}")))
        script = f.name
    try:
        out = subprocess.run(
            ["wrk", f"-t{threads}", f"-c{concurrency}", f"-d{max(1, round(duration))}s",
             f"--timeout={timeout:.0f}s", "-s", script, url + "/v1/chat/completions"],
            capture_output=True, text=True, timeout=duration + timeout + 30)
    finally:
        Path(script).unlink(missing_ok=True)
    res = WrkResult(concurrency, raw=out.stdout[-2000:] + out.stderr[-500:])
    line = next((ln for ln in out.stdout.splitlines() if ln.startswith("WRKJSON ")), None)
    if line is None:
        res.errors = -1
        return res
    d = json.loads(line.removeprefix("WRKJSON "))
    res.requests = int(d["requests"])
    res.errors = int(d["status"]) + int(d["socket"]) + int(d["timeout"])
    ok = max(0, res.requests - int(d["status"]))
    res.ok_rps = ok / (d["duration_us"] / 1e6) if d["duration_us"] else 0.0
    if res.requests:
        res.p50_ms, res.p99_ms, res.max_ms = d["p50"] / 1e3, d["p99"] / 1e3, d["max"] / 1e3
    return res


@dataclass
class StreamStats:
    """One batch of SSE streams, started together."""

    streams: int
    clean: int = 0
    ttft: list[float] = field(default_factory=list)  # seconds to the first body byte
    lateness: list[float] = field(default_factory=list)  # per chunk: arrival - written
    first_error: str = ""

    def fail(self, why: str) -> None:
        if not self.first_error:
            self.first_error = why


async def _one_stream(session: aiohttp.ClientSession, url: str, token: str, payload: bytes,
                      chunks: int, late_s: float, st: StreamStats) -> None:
    t0 = time.perf_counter()
    first: float | None = None
    stamps = 0
    worst = 0.0
    done = False
    pending = b""  # an SSE line not yet complete
    try:
        async with session.post(url + "/v1/chat/completions", data=payload, headers={
                "Authorization": f"Bearer {token}", "Content-Type": "application/json"}) as r:
            status = r.status
            async for data in r.content.iter_any():
                now = time.monotonic()
                if first is None:
                    first = time.perf_counter()
                lines = (pending + data).split(b"\n")
                pending = lines.pop()
                for line in lines:
                    m = STAMP.search(line)
                    if m is not None:
                        late = now - float(m.group(1))
                        st.lateness.append(late)
                        worst = max(worst, late)
                        stamps += 1
                    elif line == b"data: [DONE]":
                        done = True
    except (aiohttp.ClientError, TimeoutError) as exc:
        st.fail(f"{type(exc).__name__}: {exc}")
        return
    if first is not None:
        st.ttft.append(first - t0)
    if status != 200:
        st.fail(f"HTTP {status}")
    elif stamps != chunks or not done:
        st.fail(f"{stamps} of {chunks} chunks, [DONE] {'seen' if done else 'missing'}")
    elif worst > late_s:
        st.fail(f"a chunk {worst * 1000:.0f} ms late")
    else:
        st.clean += 1


async def run_streams(url: str, token: str, model: str, streams: int, chunks: int,
                      late_s: float, timeout: float = 30.0) -> StreamStats:
    """`streams` concurrent SSE streams of `chunks` chunks each, all started at once."""
    payload = json.dumps(chat_body(model, True, chunks)).encode()
    st = StreamStats(streams)
    conn = aiohttp.TCPConnector(limit=0, force_close=True)
    async with aiohttp.ClientSession(connector=conn,
                                     timeout=aiohttp.ClientTimeout(total=timeout)) as s:
        await asyncio.gather(*(_one_stream(s, url, token, payload, chunks, late_s, st)
                               for _ in range(streams)))
    return st


async def run_ttft(url: str, token: str, model: str, duration: float) -> list[float]:
    """One stream at a time (one chunk each) for `duration` s: time to first byte."""
    payload = json.dumps(chat_body(model, True, 1)).encode()
    st = StreamStats(0)
    conn = aiohttp.TCPConnector(limit=1)
    async with aiohttp.ClientSession(connector=conn,
                                     timeout=aiohttp.ClientTimeout(total=10)) as s:
        # Warm-up, untimed: the connection is open before the first sample.
        await _one_stream(s, url, token, payload, 1, 1e9, StreamStats(0))
        end = time.monotonic() + duration
        while time.monotonic() < end:
            await _one_stream(s, url, token, payload, 1, 1e9, st)
            if st.first_error:
                break
    return st.ttft


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]
