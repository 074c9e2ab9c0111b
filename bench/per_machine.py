#!/usr/bin/env python3
"""Requests per machine: llmgw with `--workers` at the machine's cores beside
vllm-router with its runtime at the machine's cores, in front of one stand-in,
nothing pinned, measured in alternate rounds.

Not a test (pytest never collects bench/). From the repository root:

    python bench/per_machine.py                  # about 4 minutes
    python bench/per_machine.py --rounds 5 --duration 10

`bench/router_overhead.py` gives each proxy one core and measures what a
request costs it; this one asks what an operator who gives the gateway a
whole machine gets from it. Both proxies, the stand-in, etcd, the agent and
wrk share the machine's cores as the scheduler places them, so a proxy that
spends less CPU a request leaves more to the rest and serves more. llmgw
runs as `llmgw serve` in cluster mode with `LLMGW_WORKERS` at the cores (its
default with etcd), and vllm-router with as many Tokio worker threads (its
default). Both are started once; in each round one is measured while the
other idles, so the machine's other load moves both alike. Per point: the
requests a second (wrk, as many threads as cores), p99, the proxy's CPU a
request (every process of it), and the machine's CPU in use. Writes its
section of bench/RESULTS.md (bench/sections.py), its goal's check line last.
"""

from __future__ import annotations

import argparse
import datetime
import os
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for p in (str(ROOT), str(ROOT / "bench")):
    if p not in sys.path:
        sys.path.insert(0, p)

import load  # noqa: E402
import peers  # noqa: E402
import sections  # noqa: E402
from peers import MODEL, Peer, Unavailable  # noqa: E402
from router_overhead import cpu_seconds  # noqa: E402

SECTION = "per_machine"


def descendants(pid: int) -> list[int]:
    """`pid` and every live process under it (llmgw's workers each lead a
    process group of their own, so the group alone would miss them)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except OSError:
                continue
            children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, ()))
    return out


def machine_cpu() -> tuple[float, float]:
    """The machine's CPU seconds so far, busy and in all (/proc/stat)."""
    with open("/proc/stat") as f:
        fields = [int(v) for v in f.readline().split()[1:]]
    tck = os.sysconf("SC_CLK_TCK")
    idle = fields[3] + fields[4]  # idle, iowait
    return (sum(fields) - idle) / tck, sum(fields) / tck


@dataclass
class Point:
    rps: float
    p99_ms: float
    errors: int
    cpu_us: float  # the proxy's CPU a request, all its processes
    machine: float  # the machine's CPU in use over the point, 0..1


@dataclass
class Series:
    name: str
    note: str
    points: dict[int, list[Point]] = field(default_factory=dict)

    def median(self, c: int, what: str) -> float:
        values = [getattr(p, what) for p in self.points.get(c, [])]
        return statistics.median(values) if values else float("nan")


def measure(peer: Peer, root: int, c: int, duration: float, threads: int) -> Point:
    pids = descendants(root)  # a worker restarted is counted too
    c0, (m0, t0) = cpu_seconds(pids), machine_cpu()
    r = load.run_wrk(peer.url, peer.token, MODEL, c, duration, threads=threads)
    used, (m1, t1) = cpu_seconds(pids) - c0, machine_cpu()
    ok = r.requests - max(r.errors, 0)
    return Point(r.ok_rps, r.p99_ms, r.errors, used / ok * 1e6 if ok > 0 else float("nan"),
                 (m1 - m0) / (t1 - t0) if t1 > t0 else float("nan"))


def render(series: list[Series], args: argparse.Namespace, took: float) -> str:
    when = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    load1, cores = os.getloadavg()[0], args.cores
    lines = [
        "## Requests per machine: llmgw's workers beside vllm-router's threads "
        "(bench/per_machine.py)", "",
        f"Written by `python bench/per_machine.py` on {when}: {cores} cores, nothing pinned; "
        f"llmgw on {peers.interpreter()}; {args.rounds} rounds of {args.duration:g} s a point, "
        f"the proxies alternated; wrk with {cores} threads; load average {load1:.2f} after, "
        f"{took:.0f} s in all. Figures are the rounds' medians. The stand-in, etcd, the agent "
        "and wrk run on the same cores: a proxy's CPU a request is what it leaves them.", "",
        "| proxy | c | req/s | p99 ms | proxy CPU/req | machine busy | errors | rounds' req/s |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for s in series:
        for c in args.concurrency:
            pts = s.points.get(c, [])
            lines.append(
                f"| {s.name} | {c} | {s.median(c, 'rps'):,.0f} | {s.median(c, 'p99_ms'):.1f} | "
                f"{s.median(c, 'cpu_us'):.0f} us | {s.median(c, 'machine'):.2f} | "
                f"{sum(p.errors for p in pts)} | {', '.join(f'{p.rps:,.0f}' for p in pts)} |")
    lines += ["", "What each proxy was: " + "; ".join(f"{s.name}: {s.note}" for s in series), ""]
    ours, theirs = series[0], series[1] if len(series) > 1 else None
    checks = []
    for c in args.concurrency:
        if theirs is None or not theirs.points.get(c):
            checks.append(f"c={c}: vllm-router not measured")
            continue
        ratio = ours.median(c, "rps") / theirs.median(c, "rps")
        mark = "met" if ratio >= 1.0 else "not met"
        checks.append(f"c={c}: {ratio:.2f}x ({mark})")
    lines.append("Goal (issue 28): with `--workers` at the cores, requests per machine "
                 "≥ vllm-router's on the same machine: " + "; ".join(checks) + ".")
    summary = " ".join(
        f"{s.name.replace('-', '')}_rps_c{c}={s.median(c, 'rps'):.0f}"
        for s in series for c in args.concurrency)
    lines += ["", f"per_machine: {summary}"]
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--duration", type=float, default=10, help="seconds per wrk point")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--concurrency", default="64,256")
    p.add_argument("--cores", type=int, default=len(os.sched_getaffinity(0)),
                   help="llmgw's workers, vllm-router's threads and wrk's threads")
    p.add_argument("--vllm-router-venv", type=Path, default=Path("/tmp/bench-vrouter"))
    p.add_argument("--results", type=Path, default=ROOT / "bench" / "RESULTS.md")
    p.add_argument("--keep", action="store_true", help="keep the temp dir (logs)")
    args = p.parse_args(argv)
    args.concurrency = [int(c) for c in args.concurrency.split(",") if c]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if shutil.which("wrk") is None:
        raise SystemExit("wrk not found (apt-get install wrk)")
    started = time.monotonic()
    tmp = Path(tempfile.mkdtemp(prefix="llmgw-per-machine-"))
    gw = peers.Llmgw(tmp, None, None, {"LLMGW_WORKERS": str(args.cores)})
    series: list[Series] = []
    router: Peer | None = None
    with peers.running(gw, tmp, args.keep, lambda: [router]):
        gw.start()
        ours = Peer("llmgw", gw.url, gw.client_key, None,
                    f"`llmgw serve`, {args.cores} workers, cluster mode (etcd)")
        runs: list[tuple[Series, Peer, int]] = [
            (Series("llmgw", ours.note), ours, gw.gateway.pid)]
        try:
            router = peers.start_vllm_router(tmp, None, gw.engine_url, gw.engine_key,
                                             args.vllm_router_venv, threads=args.cores)
        except Unavailable as exc:
            print(f"  vllm-router: not measured: {exc}", flush=True)
        if router is not None:
            assert router.proc is not None
            runs.append((Series("vllm-router", router.note + f", {args.cores} threads"),
                         router, router.proc.pid))
        print(f"llmgw at {gw.url} ({len(descendants(gw.gateway.pid))} processes); setup "
              f"{time.monotonic() - started:.1f} s", flush=True)
        series = [s for s, _, _ in runs]
        for _, peer, _ in runs:  # warm-up, untimed
            load.run_wrk(peer.url, peer.token, MODEL, 64, 2, threads=args.cores)
        for rnd in range(args.rounds):
            for s, peer, root in runs:
                for c in args.concurrency:
                    pt = measure(peer, root, c, args.duration, args.cores)
                    s.points.setdefault(c, []).append(pt)
                    print(f"  round {rnd + 1} {s.name:<12} c={c:<4} {pt.rps:8.0f} req/s  "
                          f"p99 {pt.p99_ms:7.2f} ms  CPU/req {pt.cpu_us:5.0f} us  "
                          f"machine {pt.machine:.2f}  errors {pt.errors}", flush=True)
    text = render(series, args, time.monotonic() - started)
    sections.replace_section(args.results, SECTION, text)
    print()
    print(text.rstrip())
    return 0


if __name__ == "__main__":
    sys.exit(main())
