#!/usr/bin/env python3
"""What the gateway adds on the request path, as ratios against the engine alone.

Not a test (pytest never collects it). Run from the repository root:

    python bench/proxy.py                      # about a minute
    python bench/proxy.py --duration 3 --rounds 3 --concurrency 1,16,64,128

Setup, all real processes on loopback: one all-in-one `python -m app.cli serve`
(embedded store in a temporary data dir, one declared GPU, the fake vLLM of
tests/fakes as its engine). One model is PUT, one client key created, and once
the replica is ready the load generator (this process, asyncio + aiohttp, apart
from both servers) drives, for each scenario, the engine directly with its
engine key (baseline, "A") and then the gateway with the client key ("B"),
A B A B over the rounds, so drift on a small machine shows up in the spread.

Each run is bounded by --duration seconds or --requests requests, whichever
comes first, after an untimed warm-up of one request per connection. CPU time
of the gateway and engine processes is read from /proc around each run, which
gives the gateway's own cost per request even when the machine is saturated.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import secrets
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

ROOT = Path(__file__).resolve().parents[1]
for _p in (str(ROOT), str(ROOT / "bench")):
    if _p not in sys.path:
        sys.path.insert(0, _p)

from peers import http, signals_raise  # noqa: E402

from app.control.keys import engine_key  # noqa: E402
from app.ports import free_port  # noqa: E402

FAKE_VLLM = ROOT / "tests" / "fakes" / "bin" / "vllm"
MODEL = "bench-chat"
PROMPT = "please repeat these words back to me one at a time until you are told to stop"
CLK_TCK = os.sysconf("SC_CLK_TCK")


# ------------------------------------------------------------------ processes


def cpu_seconds(pid: int) -> float:
    """utime + stime of one process (all its threads), from /proc."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def group_members(pgid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid:
            out.append(int(entry))
    return out


class Gateway:
    """One `llmgw serve` in its own session; its engines share its process group."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.secret = "bench-secret-" + secrets.token_hex(16)
        self.admin_token = "bench-admin-" + secrets.token_hex(16)
        self.log = workdir / "gateway.log"
        self.popen: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("LLMGW_")}
        env.update({
            "LLMGW_DATA_DIR": str(self.workdir / "data"),
            "LLMGW_SECRET": self.secret,
            "LLMGW_ADMIN_TOKEN": self.admin_token,
            "LLMGW_LOCAL_GPUS": "1",
            "LLMGW_VLLM_BIN": str(FAKE_VLLM),
            "LLMGW_PORT": str(self.port), "LLMGW_WORKERS": "1",
            "LLMGW_LOG_LEVEL": "warning",
            "FAKE_VLLM_PYTHON": sys.executable,
            "PYTHONUNBUFFERED": "1",
        })
        with open(self.log, "ab") as out:
            self.popen = subprocess.Popen(
                [sys.executable, "-m", "app.cli", "serve"], cwd=ROOT, env=env,
                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True,
            )

    @property
    def pid(self) -> int:
        assert self.popen is not None
        return self.popen.pid

    def engine_pid(self) -> int | None:
        """The fake engine's python process (the deepest member of our group)."""
        others = [p for p in group_members(self.pid) if p != self.pid]
        return max(others, key=cpu_seconds, default=None) if others else None

    def stop(self) -> None:
        if self.popen is None:
            return
        with contextlib.suppress(ProcessLookupError):
            self.popen.send_signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(8)
        # Whatever is left (the engine included) goes with the group.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(5)
        self.popen = None

    # --- admin over plain HTTP -------------------------------------------------

    def call(self, method: str, path: str, body: Any = None, admin: bool = True,
             timeout: float = 5.0) -> tuple[int, Any]:
        return http(method, self.url + path, body, self.admin_token if admin else "", timeout)


def wait_for(pred: Callable[[], Any], timeout: float, what: str, gw: Gateway) -> Any:
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        if gw.popen is not None and gw.popen.poll() is not None:
            raise SystemExit(f"gateway exited ({gw.popen.returncode}); log:\n"
                             + gw.log.read_text(errors="replace")[-3000:])
        try:
            last = pred()
            if last:
                return last
        except (OSError, ValueError) as exc:
            last = exc
        time.sleep(0.05)
    raise SystemExit(f"timed out after {timeout} s waiting for {what} (last: {last!r})")


@dataclass
class Target:
    name: str
    url: str
    key: str


def set_up(gw: Gateway) -> tuple[Target, Target]:
    wait_for(lambda: gw.call("GET", "/readyz", admin=False)[0] == 200, 30, "/readyz", gw)
    spec = {"model": "bench/fake-chat", "engine": "vllm", "gpus": 1,
            "replicas": {"min": 1, "max": 1}}
    status, body = gw.call("PUT", f"/admin/models/{MODEL}", spec)
    if status not in (200, 201):
        raise SystemExit(f"PUT /admin/models/{MODEL}: {status} {body}")
    status, body = gw.call("POST", "/admin/keys", {"name": "bench"})
    if status != 201:
        raise SystemExit(f"POST /admin/keys: {status} {body}")
    client_key = str(body["key"])

    def ready() -> dict[str, Any] | None:
        status, reps = gw.call("GET", "/admin/replicas")
        if status != 200:
            return None
        for r in reps:
            if r.get("model") == MODEL and r.get("phase") == "ready" and r.get("url"):
                return dict(r)
        return None

    rep = wait_for(ready, 60, "a ready replica", gw)
    base = Target("engine", rep["url"], engine_key(gw.secret, rep["id"]))
    through = Target("gateway", gw.url, client_key)

    def routes() -> bool:
        req = urllib.request.Request(
            gw.url + "/v1/chat/completions", method="POST",
            data=json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                             "max_tokens": 2}).encode(),
            headers={"Authorization": f"Bearer {client_key}",
                     "Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=5) as resp:
                return bool(resp.status == 200)
        except urllib.error.HTTPError:
            return False

    wait_for(routes, 15, "the gateway routing to the replica", gw)
    return base, through


# ------------------------------------------------------------------ reference


class Reference:
    def __init__(self, upstream: Target) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        # The Python floor of bench/router_overhead.py (bench/floor.py): a
        # bare ASGI + aiohttp proxy, no framework, no auth, no routing.
        self.popen = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve().parent / "floor.py"),
             str(self.port), upstream.url],
            env={**os.environ, "FLOOR_ENGINE_KEY": upstream.key}, cwd=ROOT,
            stdin=subprocess.DEVNULL, start_new_session=True)

    def wait_ready(self, gw: Gateway) -> None:
        def up() -> bool:
            with socket.socket() as s:
                s.settimeout(0.5)
                return s.connect_ex(("127.0.0.1", self.port)) == 0

        wait_for(up, 15, "the reference proxy", gw)

    def stop(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.popen.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(5)


# ------------------------------------------------------------------ load


@dataclass
class RunResult:
    ok: int = 0
    errors: int = 0
    elapsed: float = 0.0
    total: list[float] = field(default_factory=list)  # seconds, request to last byte
    ttfb: list[float] = field(default_factory=list)   # seconds, request to first body byte
    gw_cpu: float = 0.0
    engine_cpu: float = 0.0
    client_cpu: float = 0.0
    first_error: str = ""

    @property
    def rps(self) -> float:
        return self.ok / self.elapsed if self.elapsed > 0 else 0.0


async def run_load(target: Target, concurrency: int, stream: bool, duration: float,
                   max_requests: int, max_tokens: int,
                   cpu_pids: tuple[int, int | None]) -> RunResult:
    payload = json.dumps({
        "model": MODEL, "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": max_tokens, "stream": stream,
    }).encode()
    headers = {"Authorization": f"Bearer {target.key}", "Content-Type": "application/json"}
    url = target.url + "/v1/chat/completions"
    res = RunResult()
    connector = aiohttp.TCPConnector(limit=concurrency, force_close=False)
    timeout = aiohttp.ClientTimeout(total=30)

    async def one(session: aiohttp.ClientSession, record: bool) -> None:
        t0 = time.perf_counter()
        first: float | None = None
        try:
            async with session.post(url, data=payload, headers=headers) as resp:
                if stream:
                    tail = b""
                    async for chunk in resp.content.iter_any():
                        if first is None:
                            first = time.perf_counter()
                        tail = (tail + chunk)[-64:]
                    good = resp.status == 200 and b"[DONE]" in tail
                else:
                    body = await resp.read()
                    first = time.perf_counter()
                    good = resp.status == 200 and b'"choices"' in body
                if not good and not res.first_error:
                    res.first_error = f"HTTP {resp.status}"
        except (aiohttp.ClientError, TimeoutError) as exc:
            good = False
            if not res.first_error:
                res.first_error = f"{type(exc).__name__}: {exc}"
        t1 = time.perf_counter()
        if not record:
            return
        if good:
            res.ok += 1
            res.total.append(t1 - t0)
            res.ttfb.append((first or t1) - t0)
        else:
            res.errors += 1

    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        # Warm-up: open every connection (and let both servers see them) untimed.
        await asyncio.gather(*(one(session, False) for _ in range(concurrency)))
        issued = 0
        loop = asyncio.get_running_loop()
        start = loop.time()
        deadline = start + duration

        async def worker() -> None:
            nonlocal issued
            while issued < max_requests and loop.time() < deadline:
                issued += 1
                await one(session, True)

        gw_pid, eng_pid = cpu_pids
        g0 = cpu_seconds(gw_pid)
        e0 = cpu_seconds(eng_pid) if eng_pid else 0.0
        c0 = time.process_time()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        res.elapsed = loop.time() - start
        res.gw_cpu = cpu_seconds(gw_pid) - g0
        res.engine_cpu = (cpu_seconds(eng_pid) - e0) if eng_pid else 0.0
        res.client_cpu = time.process_time() - c0
    return res


def new_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvicorn[standard] brings it
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


# ------------------------------------------------------------------ report


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


def ms(v: float) -> str:
    return f"{v * 1000:7.2f}"


@dataclass
class Scenario:
    stream: bool
    concurrency: int
    runs: dict[str, list[RunResult]] = field(
        default_factory=lambda: {"engine": [], "gateway": [], "bare": []})

    @property
    def label(self) -> str:
        return f"{'stream' if self.stream else 'plain '} c={self.concurrency}"


def pooled(runs: list[RunResult], attr: str) -> list[float]:
    out: list[float] = []
    for r in runs:
        out.extend(getattr(r, attr))
    return out


def per_req_us(runs: list[RunResult], attr: str) -> float:
    ok = sum(r.ok for r in runs)
    return sum(getattr(r, attr) for r in runs) / ok * 1e6 if ok else float("nan")


def report(scenarios: list[Scenario]) -> str:
    bare = any(sc.runs["bare"] for sc in scenarios)
    lines = []
    head = (f"{'scenario':<20}{'engine r/s':>11}{'gw r/s':>8}{'ratio':>6}  "
            f"{'p50 eng':>7} {'p50 gw':>7} {'p99 eng':>7} {'p99 gw':>7} {'+p50 ms':>7}"
            f"{'gw CPU/req':>11}")
    if bare:
        head += f"{'bare r/s':>9}{'ratio':>6}{'+p50 ms':>8}{'bare CPU':>9}"
    lines.append(head)
    lines.append("-" * len(head))
    for sc in scenarios:
        eng, gw, br = sc.runs["engine"], sc.runs["gateway"], sc.runs["bare"]
        e_rps = statistics.median(r.rps for r in eng)
        g_rps = statistics.median(r.rps for r in gw)
        metrics = [("total", "")] if not sc.stream else [("ttfb", " first"), ("total", " last")]
        for i, (attr, what) in enumerate(metrics):
            e_lat, g_lat = pooled(eng, attr), pooled(gw, attr)
            rates = (f"{e_rps:>11.0f}{g_rps:>8.0f}{g_rps / e_rps:>6.2f}" if i == 0
                     else " " * 25)
            cpu = f"{per_req_us(gw, 'gw_cpu'):>9.0f}us" if i == 0 else " " * 11
            line = (f"{sc.label + what:<20}{rates}  {ms(pct(e_lat, .5))} {ms(pct(g_lat, .5))} "
                    f"{ms(pct(e_lat, .99))} {ms(pct(g_lat, .99))} "
                    f"{(pct(g_lat, .5) - pct(e_lat, .5)) * 1000:>7.2f}{cpu}")
            if br:
                b_lat = pooled(br, attr)
                b_rps = statistics.median(r.rps for r in br)
                line += (f"{b_rps:>9.0f}{b_rps / e_rps:>6.2f}" if i == 0 else " " * 15)
                line += f"{(pct(b_lat, .5) - pct(e_lat, .5)) * 1000:>8.2f}"
                line += f"{per_req_us(br, 'gw_cpu'):>7.0f}us" if i == 0 else ""
            lines.append(line)
    lines.append("")
    lines.append("spread over rounds: req/s min-max, gateway/engine ratio per round, errors;"
                 " engine CPU per request")
    for sc in scenarios:
        parts = []
        for who in ("engine", "gateway", "bare"):
            runs = sc.runs[who]
            if not runs:
                continue
            rs = [r.rps for r in runs]
            errs = sum(r.errors for r in runs)
            first = next((r.first_error for r in runs if r.first_error), "")
            parts.append(f"{who} {min(rs):.0f}-{max(rs):.0f}"
                         + (f" ({errs} errors: {first})" if errs else "")
                         + f" eng {per_req_us(runs, 'engine_cpu'):.0f}us")
        ratios = " ".join(f"{g.rps / e.rps:.2f}" if e.rps else "nan"
                          for e, g in zip(sc.runs["engine"], sc.runs["gateway"], strict=True))
        lines.append(f"  {sc.label:<11} ratios {ratios} | " + "; ".join(parts))
    return "\n".join(lines)


# ------------------------------------------------------------------ main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--duration", type=float, default=1.5,
                   help="seconds per run (after warm-up); default 1.5")
    p.add_argument("--requests", type=int, default=20000,
                   help="most requests per run; default 20000")
    p.add_argument("--concurrency", default="1,16,64",
                   help="comma-separated concurrencies; default 1,16,64")
    p.add_argument("--rounds", type=int, default=2, help="A/B rounds; default 2")
    p.add_argument("--modes", default="plain,stream",
                   help="comma-separated: plain (non-streamed), stream; default both")
    p.add_argument("--max-tokens", type=int, default=8, help="max_tokens per request")
    p.add_argument("--json", type=Path, default=None, help="also write raw figures here")
    p.add_argument("--keep", action="store_true", help="keep the temp dir (gateway log)")
    p.add_argument("--bare", action="store_true",
                   help="also run a bare ASGI+aiohttp proxy (no framework) as a third target")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    concs = [int(c) for c in args.concurrency.split(",") if c.strip()]
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not concs or any(c < 1 for c in concs) or not set(modes) <= {"plain", "stream"}:
        raise SystemExit("bad --concurrency or --modes")
    scenarios = [Scenario(m == "stream", c) for m in modes for c in concs]

    t_start = time.monotonic()
    tmp = Path(tempfile.mkdtemp(prefix="llmgw-bench-"))
    gw = Gateway(tmp)
    ref: Reference | None = None
    load_before = os.getloadavg()
    with signals_raise():
        try:
            gw.start()
            base, through = set_up(gw)
            eng_pid = gw.engine_pid()
            targets = [(base, gw.pid), (through, gw.pid)]
            if args.bare:
                ref = Reference(base)
                ref.wait_ready(gw)
                targets.append((Target("bare", ref.url, "-"), ref.popen.pid))
            c0 = cpu_seconds(gw.pid)
            time.sleep(1.0)
            idle = cpu_seconds(gw.pid) - c0
            print(f"gateway pid {gw.pid} at {gw.url}; engine pid {eng_pid} at {base.url}; "
                  f"setup {time.monotonic() - t_start:.1f} s; nproc {os.cpu_count()}; "
                  f"load {load_before[0]:.2f}; gateway idle CPU {idle * 100:.1f}%", flush=True)
            with asyncio.Runner(loop_factory=new_loop) as runner:
                for rnd in range(args.rounds):
                    for sc in scenarios:
                        for target, proxy_pid in targets:
                            r = runner.run(run_load(
                                target, sc.concurrency, sc.stream, args.duration,
                                args.requests, args.max_tokens, (proxy_pid, eng_pid)))
                            sc.runs[target.name].append(r)
                            print(f"  round {rnd + 1} {sc.label:<10} {target.name:<8} "
                                  f"{r.rps:8.0f} req/s  p50 {ms(pct(r.total, .5))} ms"
                                  f"  errors {r.errors}", flush=True)
                            time.sleep(0.2)
        except KeyboardInterrupt:
            print("interrupted; stopping the gateway", file=sys.stderr)
            return 130
        finally:
            if ref is not None:
                ref.stop()
            gw.stop()
            if args.keep:
                print(f"kept {tmp}", file=sys.stderr)
            else:
                shutil.rmtree(tmp, ignore_errors=True)
    load_after = os.getloadavg()
    print()
    print(f"nproc {os.cpu_count()}, load average before {load_before[0]:.2f} after "
          f"{load_after[0]:.2f}; {args.rounds} rounds x {args.duration} s per run; "
          f"max_tokens {args.max_tokens}; latencies in ms; CPU/req = the proxy process's "
          f"CPU time (user+sys) per request")
    print(report(scenarios))
    print(f"\ntotal wall time {time.monotonic() - t_start:.1f} s")
    if args.json is not None:
        args.json.write_text(json.dumps({
            "nproc": os.cpu_count(), "load_before": load_before, "load_after": load_after,
            "args": {k: str(v) for k, v in vars(args).items()},
            "scenarios": [{
                "stream": sc.stream, "concurrency": sc.concurrency,
                "runs": {who: [{"ok": r.ok, "errors": r.errors, "rps": r.rps,
                                "p50": pct(r.total, .5), "p99": pct(r.total, .99),
                                "ttfb_p50": pct(r.ttfb, .5), "gw_cpu": r.gw_cpu,
                                "engine_cpu": r.engine_cpu, "client_cpu": r.client_cpu}
                               for r in runs] for who, runs in sc.runs.items()},
            } for sc in scenarios],
        }, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
