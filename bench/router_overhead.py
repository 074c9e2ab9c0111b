#!/usr/bin/env python3
"""What llmgw's router costs, beside the Python floor, nginx, LiteLLM's proxy
and vllm-router, all in front of one fast vLLM stand-in, in one run.

Not a test (pytest never collects bench/). From the repository root:

    python bench/router_overhead.py                    # about 5 minutes
    python bench/router_overhead.py --profile          # then py-spy on llmgw at c=256
    python bench/router_overhead.py --duration 3 --targets direct,llmgw,floor

Layout on two cores: each proxy pinned to core 0; the stand-in, etcd, the
agent, wrk and the SSE client (this process) on core 1. llmgw runs for real:
etcd, `llmgw serve` in cluster mode, `llmgw agent`, which starts the stand-in
(bench/standin.py) as its vLLM engine; client key in, engine key out. Every
other proxy forwards to that same stand-in, started one at a time for its own
measurements. Per target: c=1, c=64, c=256 with wrk (plain requests), first
chunk latency one stream at a time, then batches of concurrent SSE streams
(32, 64, 128, 256; it stops at the first batch with a broken or late chunk).
Writes its section of bench/RESULTS.md (bench/sections.py), whose last line
(also printed last) is the summary.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import uvloop

ROOT = Path(__file__).resolve().parents[1]
for p in (str(ROOT), str(ROOT / "bench")):
    if p not in sys.path:
        sys.path.insert(0, p)

import load  # noqa: E402
import peers  # noqa: E402
import report  # noqa: E402
import sections  # noqa: E402
from loop_seen import between, scrape  # noqa: E402
from peers import MODEL, Peer, Unavailable  # noqa: E402
from report import Figures  # noqa: E402

TARGETS = ("direct", "llmgw", "llmgw-granian", "floor", "nginx", "litellm", "vllm-router")
CLK_TCK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pids: list[int]) -> float:
    return sum(cpu_split(pids))


def cpu_split(pids: list[int]) -> tuple[float, float]:
    """The processes' CPU seconds so far: in user space, in the kernel."""
    user = kernel = 0.0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        user += int(fields[11]) / CLK_TCK
        kernel += int(fields[12]) / CLK_TCK
    return user, kernel


def group(pgid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[2]) == pgid:
                        out.append(int(entry))
            except OSError:
                continue
    return out


GC_PROBE = ROOT / "bench" / "gcprobe"


def gc_stats(pid: int, out: Path) -> dict[int, tuple[int, float, float]]:
    """Asks a probed proxy (bench/gcprobe) for its GC totals: generation ->
    (collections, seconds, longest pause since the last ask)."""
    before = out.read_text() if out.exists() else ""
    os.kill(pid, signal.SIGUSR2)
    deadline = time.monotonic() + 3
    while time.monotonic() < deadline:
        text = out.read_text() if out.exists() else ""
        if len(text) > len(before) and text.endswith("\n"):
            line = text.splitlines()[-1]
            got = {}
            for part in line.split()[1:]:
                name, _, vals = part.partition("=")
                if name.startswith("gen"):
                    n, secs, mx = vals.split(",")
                    got[int(name[3:])] = (int(n), float(secs), float(mx))
            return got
        time.sleep(0.02)
    return {}


def gateway_added(url: str) -> tuple[float, float]:
    """llmgw's /metrics: its `llmgw_gateway_added_seconds` (sum, count), all
    models together."""
    got = scrape(url, ("llmgw_gateway_added_seconds_",))
    return (sum(v for (name, _), v in got.items() if name.endswith("_sum")),
            sum(v for (name, _), v in got.items() if name.endswith("_count")))


def measure(peer: Peer, pids: list[int], args: argparse.Namespace,
            gc_out: Path | None = None) -> Figures:
    fig = Figures(peer.name, peer.note)
    load.run_wrk(peer.url, peer.token, MODEL, 64, 1)  # warm-up, untimed
    for c in (1, 64, 256):
        probed = gc_out is not None and c == 256 and bool(pids)
        g0 = gc_stats(pids[0], gc_out) if probed and gc_out else {}
        ours = peer.name.startswith("llmgw")
        seen = scrape(peer.url) if ours and c == 256 else None
        told = gateway_added(peer.url) if ours and c == 1 else None
        c0 = cpu_seconds(pids)
        r = load.run_wrk(peer.url, peer.token, MODEL, c, args.duration)
        used = cpu_seconds(pids) - c0
        if told is not None:
            now = gateway_added(peer.url)
            if now[1] > told[1]:
                fig.gateway_c1 = (now[0] - told[0]) / (now[1] - told[1]) * 1e3
        if seen is not None:
            fig.loop256 = between(seen, scrape(peer.url))
            print(f"  {peer.name:<12} c=256 event loop: {fig.loop256.line()}", flush=True)
        if probed and gc_out and g0:
            g1 = gc_stats(pids[0], gc_out)
            fig.gc256 = {g: (g1[g][0] - g0[g][0], g1[g][1] - g0[g][1], g1[g][2])
                         for g in g1 if g in g0}
        ok = r.requests - (r.errors if r.errors > 0 else 0)
        r.proxy_cpu_us = used / ok * 1e6 if pids and ok > 0 else float("nan")
        fig.wrk[c] = r
        print(f"  {peer.name:<12} c={c:<4} {r.ok_rps:8.0f} req/s  p50 {r.p50_ms:7.2f} ms  "
              f"p99 {r.p99_ms:8.2f} ms  errors {r.errors}  CPU/req {r.proxy_cpu_us:6.0f} us  "
              # Its share of its core: on a shared machine req/s is this
              # share over CPU/req, and the share moves from minute to minute.
              f"CPU share {used / args.duration:4.2f}",
              flush=True)
        if r.errors < 0:
            print(r.raw, flush=True)
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        fig.ttft = runner.run(load.run_ttft(peer.url, peer.token, MODEL, args.ttft_duration))
        print(f"  {peer.name:<12} first chunk, one at a time: {len(fig.ttft)} streams, "
              f"p50 {load.pct(fig.ttft, .5) * 1e3:.2f} ms p99 "
              f"{load.pct(fig.ttft, .99) * 1e3:.2f} ms", flush=True)
        for n in args.streams:
            st = runner.run(load.run_streams(peer.url, peer.token, MODEL, n, args.chunks,
                                             args.late_ms / 1e3))
            fig.streams.append(st)
            print(f"  {peer.name:<12} {n} streams: {st.clean} clean; chunk lateness p99 "
                  f"{load.pct(st.lateness, .99) * 1e3:.1f} ms max "
                  f"{max(st.lateness, default=float('nan')) * 1e3:.1f} ms"
                  + (f"; first problem: {st.first_error}" if st.first_error else ""),
                  flush=True)
            if st.clean < n:
                break
            time.sleep(0.5)
    return fig


def profile(gw: peers.Llmgw, args: argparse.Namespace, tmp: Path) -> str:
    """py-spy on the gateway under wrk at c=256: a summary of the stacks, and dumps."""
    import flame

    spy = peers.py_spy()
    seconds = max(3, round(args.duration))
    out = tmp / "profile-llmgw-c256.txt"  # collapsed stacks, for a flame graph (--keep)
    wrk = [sys.executable, "-c", "import sys, load; r = load.run_wrk(*sys.argv[1:4], 256, "
           f"{seconds + 4}); print(r.ok_rps, r.p99_ms, r.errors)",
           gw.url, gw.client_key, MODEL]
    driver = peers.Process("wrk-profile", wrk, tmp / "wrk-profile.log",
                           dict(os.environ) | {"PYTHONPATH": str(ROOT / "bench")}).start()
    try:
        time.sleep(1.5)
        cmd = [spy, "record", "--pid", str(gw.gateway.pid), "--duration", str(seconds),
               "--rate", "250", "--format", "raw", "--output", str(out), "--threads"]
        if args.profile_native:
            cmd.append("--native")
        rec = peers.Process("py-spy", cmd, tmp / "py-spy.log").start()
        assert rec.popen is not None
        dumps = []
        for _ in range(3):
            time.sleep(seconds / 4)
            d = subprocess_out([spy, "dump", "--pid", str(gw.gateway.pid), "--nonblocking"])
            dumps.append(d)
        with contextlib.suppress(Exception):
            rec.popen.wait(seconds + 30)
        assert driver.popen is not None
        driver.popen.wait(seconds + 30)
    finally:
        driver.stop()
    wrk_line = (tmp / "wrk-profile.log").read_text(errors="replace").strip()
    text = out.read_text() if out.exists() else ""
    summary = flame.summarize(text) if text else "py-spy wrote nothing:\n" + rec.tail()
    return (f"wrk at c=256 under the profiler: req/s, p99 ms, errors = {wrk_line}\n\n"
            + summary + "\n\npy-spy dump of the event-loop thread, three times under load:\n\n"
            + "\n---\n".join(first_thread(d) for d in dumps))


def subprocess_out(cmd: list[str]) -> str:
    import subprocess

    r = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    return r.stdout + r.stderr


def first_thread(dump: str, lines: int = 24) -> str:
    """The first thread's stack (the main one, which runs the event loop)."""
    out, seen = [], 0
    for line in dump.splitlines():
        if line.startswith("Thread "):
            seen += 1
            if seen > 1:
                break
        if seen == 1:
            out.append(line)
    return "\n".join(out[:lines])


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--duration", type=float, default=10, help="seconds per wrk point")
    p.add_argument("--ttft-duration", type=float, default=5,
                   help="seconds of one-at-a-time streams for first-chunk latency")
    p.add_argument("--targets", default=",".join(TARGETS))
    p.add_argument("--streams", default="32,64,128,256", help="concurrent stream batches")
    p.add_argument("--chunks", type=int, default=20, help="chunks per stream")
    p.add_argument("--chunk-ms", type=float, default=50, help="the stand-in's chunk interval")
    p.add_argument("--late-ms", type=float, default=50,
                   help="a chunk later than this after the stand-in wrote it is not on time")
    p.add_argument("--litellm-venv", type=Path, default=Path("/tmp/bench-litellm"))
    p.add_argument("--vllm-router-venv", type=Path, default=Path("/tmp/bench-vrouter"))
    p.add_argument("--gc-probe", action="store_true",
                   help="time the GC pauses of llmgw's gateway and the floor at c=256")
    p.add_argument("--gc-tune", default="", metavar="T0,T1,T2",
                   help="what-if, llmgw only: these gc thresholds, gc.freeze() after setup")
    p.add_argument("--profile", action="store_true", help="py-spy llmgw at c=256 afterwards")
    p.add_argument("--gateway-env", action="append", default=[], metavar="NAME=VALUE",
                   type=lambda kv: tuple(kv.split("=", 1)),
                   help="a setting of llmgw's gateway for this run (repeatable), e.g. "
                        "LLMGW_GC_THRESHOLD=70000: a what-if, said in RESULTS.md")
    p.add_argument("--profile-native", action="store_true", help="py-spy --native")
    p.add_argument("--results", type=Path, default=ROOT / "bench" / "RESULTS.md")
    p.add_argument("--keep", action="store_true", help="keep the temp dir (logs)")
    args = p.parse_args(argv)
    args.targets = [t for t in args.targets.split(",") if t]
    args.streams = [int(n) for n in args.streams.split(",") if n]
    unknown = set(args.targets) - set(TARGETS)
    if unknown or ("llmgw" not in args.targets and "direct" not in args.targets):
        p.error(f"--targets: unknown {sorted(unknown)}" if unknown else "--targets: none")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    for tool in ("wrk", "taskset"):
        if shutil.which(tool) is None:
            raise SystemExit(f"{tool} not found (apt-get install {tool})")
    two = len(os.sched_getaffinity(0)) >= 2
    proxy_core, other_core = (0, 1) if two else (None, None)
    if other_core is not None:
        os.sched_setaffinity(0, {other_core})  # wrk and the SSE client inherit it
    os.environ["STANDIN_CHUNK_MS"] = str(args.chunk_ms)
    started, load_before = time.monotonic(), os.getloadavg()
    tmp = Path(tempfile.mkdtemp(prefix="llmgw-overhead-"))
    probe_env: dict[str, str] = {}
    if args.gc_probe or args.gc_tune:
        probe_env = {"PYTHONPATH": str(GC_PROBE)}
    gw_env = ({**probe_env, "BENCH_GC_PROBE": str(tmp / "gc-llmgw.log")} if probe_env else {})
    if args.gc_tune:
        gw_env["BENCH_GC_TUNE"] = args.gc_tune
    gw_env.update(dict(args.gateway_env))
    gw = peers.Llmgw(tmp, proxy_core, other_core, gw_env)
    figures: list[Figures] = []
    prof = ""
    with peers.running(gw, tmp, args.keep):
        gw.start()
        print(f"llmgw at {gw.url}, stand-in at {gw.engine_url} (pid {gw.engine_pid}); "
              f"setup {time.monotonic() - started:.1f} s; load {load_before[0]:.2f}",
              flush=True)
        if args.gc_tune:  # the what-if: freeze what startup left, as the app would
            os.kill(gw.gateway.pid, signal.SIGUSR1)
            time.sleep(0.5)
        up, key = gw.engine_url, gw.engine_key
        floor_env = ({**probe_env, "BENCH_GC_PROBE": str(tmp / "gc-floor.log")}
                     if probe_env else None)
        starters: dict[str, Callable[[], Peer]] = {
            "direct": lambda: Peer("direct", up, key, None, "the stand-in itself"),
            "llmgw": lambda: Peer("llmgw", gw.url, gw.client_key, None,
                                  "main, cluster mode (etcd), through the agent's engine"),
            "llmgw-granian": gw.start_granian,
            "floor": lambda: peers.start_floor(tmp, proxy_core, up, key, floor_env),
            "nginx": lambda: peers.start_nginx(tmp, proxy_core, up, key),
            "litellm": lambda: peers.start_litellm(tmp, proxy_core, up, key,
                                                   args.litellm_venv),
            "vllm-router": lambda: peers.start_vllm_router(tmp, proxy_core, up, key,
                                                           args.vllm_router_venv),
        }
        for name in TARGETS:
            if name not in args.targets:
                continue
            try:
                peer = starters[name]()
            except Unavailable as exc:
                print(f"  {name}: not measured: {exc}", flush=True)
                figures.append(Figures(name, skipped=str(exc)))
                continue
            try:
                pids = ([gw.gateway.pid] if name == "llmgw" else
                        group(peer.proc.pid) if peer.proc is not None else [])
                probed = probe_env and name in ("llmgw", "floor")
                figures.append(measure(peer, pids, args,
                                       tmp / f"gc-{name}.log" if probed else None))
            finally:
                peer.stop()
        if args.profile and "llmgw" in args.targets:
            prof = profile(gw, args, tmp)
    text = report.render(figures, args, load_before, os.getloadavg(),
                         time.monotonic() - started, prof)
    sections.replace_section(args.results, "router_overhead", text)
    print()
    if prof:  # the profile is in the file; the summary line stays last
        print(text.split("\n## Profile")[0].rstrip())
        print(text.rstrip().splitlines()[-1])
    else:
        print(text.rstrip())
    return 0


if __name__ == "__main__":
    sys.exit(main())
