"""bench/RESULTS.md for bench/router_overhead.py: the figures of one run, the
ratios against the Python floor measured in that run, the issue's goal
checked line by line, and the summary line last.
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
from dataclasses import dataclass, field
from typing import Any

import load
from load import pct
from loop_seen import LoopSeen
from peers import interpreter


@dataclass
class Figures:
    """One target's figures in one run: router_overhead.py measures, render() writes."""

    name: str
    note: str = ""
    skipped: str = ""
    wrk: dict[int, load.WrkResult] = field(default_factory=dict)
    ttft: list[float] = field(default_factory=list)
    streams: list[load.StreamStats] = field(default_factory=list)
    gc256: dict[int, tuple[int, float, float]] = field(default_factory=dict)  # see gc_window
    loop256: LoopSeen | None = None  # llmgw's own /metrics over the c=256 point
    # llmgw's own figure of what it added (llmgw_gateway_added_seconds), its
    # mean over the c=1 point, in ms: checked against the side-by-side one.
    gateway_c1: float = float("nan")


def _ms(v: float, digits: int = 2) -> str:
    return "n/a" if math.isnan(v) else f"{v:.{digits}f}"


class View:
    """The derived numbers of one target, against `direct` (the stand-in)."""

    def __init__(self, f: Figures, direct: Figures | None) -> None:
        self.f = f
        w = f.wrk
        nan = float("nan")
        self.rps64 = w[64].ok_rps if 64 in w else nan
        self.rps256 = w[256].ok_rps if 256 in w else nan
        self.p99_256 = w[256].p99_ms if 256 in w else nan
        self.cpu64 = w[64].proxy_cpu_us if 64 in w else nan
        self.errors = sum(max(0, r.errors) for r in w.values())
        d = direct.wrk if direct is not None and f is not direct else {}
        self.p50_1 = w[1].p50_ms if 1 in w else nan
        self.p99_1 = w[1].p99_ms if 1 in w else nan
        self.add_p50 = self.p50_1 - d[1].p50_ms if 1 in d else nan
        self.add_p99 = self.p99_1 - d[1].p99_ms if 1 in d else nan
        self.gateway_c1 = f.gateway_c1  # what llmgw's own metric says it added
        ttft99 = pct(f.ttft, .99) * 1e3
        self.ttft_add99 = (ttft99 - pct(direct.ttft, .99) * 1e3
                           if direct is not None and f is not direct else nan)
        self.ttft99 = ttft99
        last = f.streams[-1] if f.streams else None
        self.clean = last.clean if last else 0
        self.tried = last.streams if last else 0
        self.late99 = pct(last.lateness, .99) * 1e3 if last else nan
        self.late_max = max(last.lateness, default=nan) * 1e3 if last else nan
        self.stream_error = last.first_error if last else ""

    def streams_cell(self) -> str:
        if not self.tried:
            return "n/a"
        if self.clean == self.tried:
            return f"{self.clean} clean"
        return f"fails at {self.tried} ({self.clean} clean)"


def render(figures: list[Figures], args: argparse.Namespace, load_before: tuple[float, ...],
           load_after: tuple[float, ...], wall: float, prof: str) -> str:
    by = {f.name: f for f in figures}
    direct = by.get("direct")
    views = {f.name: View(f, direct) for f in figures if not f.skipped}
    floor = views.get("floor")
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    out = [
        "# Router overhead: llmgw beside other proxies, one run",
        "",
        f"Written by `python bench/router_overhead.py` on {now}: nproc {os.cpu_count()}, "
        f"Python proxies on {interpreter()}, "
        f"load average {load_before[0]:.2f} before, {load_after[0]:.2f} after, "
        f"{wall:.0f} s in all; {args.duration:g} s per wrk point, chunks every "
        f"{args.chunk_ms:g} ms, {args.chunks} per stream, late = over {args.late_ms:g} ms.",
        "Each proxy pinned to core 0; the stand-in, etcd, the agent, wrk and the SSE client "
        "on core 1. The machine is shared with other sessions running tests: absolute "
        "figures are noisy, the ratios against the floor measured in this same run less so.",
        "",
        "| target | c=1 p50/p99 ms (added) | req/s c=64 | req/s c=256 | p99 c=256 ms "
        "| first chunk p99 ms (added) | streams | CPU/req c=64 | errors | what |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for f in figures:
        if f.skipped:
            out.append(f"| {f.name} | not measured: {f.skipped} | | | | | | | | |")
            continue
        v = views[f.name]
        lat = (f"{_ms(v.p50_1)}/{_ms(v.p99_1)}" if f is direct else
               f"{_ms(v.add_p50)}/{_ms(v.add_p99)}")
        ttft = _ms(v.ttft99) if f is direct else _ms(v.ttft_add99)
        out.append(f"| {f.name} | {lat} | {v.rps64:,.0f} | {v.rps256:,.0f} | "
                   f"{_ms(v.p99_256, 1)} | {ttft} | {v.streams_cell()} | "
                   f"{_ms(v.cpu64, 0)} us | {v.errors} | {f.note} |")
    out += ["", "Direct row: absolute latencies (the stand-in alone); other rows: what the "
            "proxy adds to them. CPU/req: the proxy's own processes' CPU time per answered "
            "request. Streams: the largest batch of concurrent SSE streams tried "
            f"({', '.join(map(str, args.streams))}, stopping at the first with a broken or "
            "late chunk).", ""]
    if floor is not None:
        out += ["## Against the floor (same run)", "",
                "| target | req/s c=64 | req/s c=256 | p99 c=256 | added p50 c=1 | "
                "added p99 c=1 | added first chunk p99 | chunk lateness p99/max ms |",
                "| --- | --- | --- | --- | --- | --- | --- | --- |"]
        for name, v in views.items():
            if name == "direct":
                continue
            out.append(
                f"| {name} | {v.rps64 / floor.rps64:.2f}x | {v.rps256 / floor.rps256:.2f}x | "
                f"{v.p99_256 / floor.p99_256:.2f}x | {v.add_p50 - floor.add_p50:+.2f} ms | "
                f"{v.add_p99 - floor.add_p99:+.2f} ms | "
                f"{v.ttft_add99 - floor.ttft_add99:+.2f} ms | "
                f"{_ms(v.late99, 1)}/{_ms(v.late_max, 1)} |")
        out.append("")
    probed = [f for f in figures if f.gc256]
    if probed:
        out += ["## Cyclic GC during the c=256 point (bench/gcprobe)", "",
                "The event loop stops while a collection runs. Collections, their total time "
                "and the longest single pause, per generation:", "",
                "| target | gen0 | gen1 | gen2 (full) | GC share of the point |",
                "| --- | --- | --- | --- | --- |"]
        for f in probed:
            cells = [f"{n} / {secs * 1e3:.0f} ms / max {mx * 1e3:.1f} ms"
                     for n, secs, mx in (f.gc256.get(g, (0, 0.0, 0.0)) for g in (0, 1, 2))]
            share = sum(v[1] for v in f.gc256.values()) / args.duration
            out.append(f"| {f.name} | {' | '.join(cells)} | {share:.0%} |")
        out.append("")
    looped = [f for f in figures if f.loop256 is not None]
    if looped:
        out += ["## llmgw's event loop during the c=256 point (its /metrics)", "",
                *(f"- {f.name}: {f.loop256.line()}" for f in looped if f.loop256), "",
                "A tick late by as much as the p99 means the process stalled; ticks on time "
                "beside a long p99 mean the requests waited elsewhere (accept queue, "
                "connection setup, the client).", ""]
    if args.gateway_env:
        out += ["**What-if run**: llmgw's gateway ran with "
                + ", ".join(f"`{k}={v}`" for k, v in args.gateway_env) + ".", ""]
    if args.gc_tune:
        out += [f"**What-if run**: llmgw's gateway ran with gc thresholds {args.gc_tune} and "
                "`gc.freeze()` after setup (bench/gcprobe, `--gc-tune`); app/ unchanged.", ""]
    llmgw = views.get("llmgw")
    if llmgw is not None and floor is not None:
        out += ["## The floor's goal, checked on this run", "", *goal(llmgw, floor, args)]
        out.append("")
    rust = views.get("vllm-router")
    if llmgw is not None and rust is not None:
        out += ["## Rust-class goal: against vllm-router, checked on this run", "",
                *rust_goal(llmgw, rust), ""]
    granian = views.get("llmgw-granian")
    if llmgw is not None and granian is not None:
        out += ["## Server: granian beside uvicorn, checked on this run", "",
                *server_choice(llmgw, granian), ""]
        if rust is not None:
            out += ["The Rust-class goal for llmgw on granian:", "", *rust_goal(granian, rust),
                    ""]
    if prof:
        out += ["## Profile: llmgw's gateway under wrk at c=256 (py-spy)", "", "```", prof,
                "```", ""]
    out.append(summary_line(views))
    return "\n".join(out) + "\n"


def goal(g: View, fl: View, args: argparse.Namespace) -> list[str]:
    checks: list[tuple[str, bool]] = [
        (f"req/s at c=64 >= 90% of the floor's: {g.rps64 / fl.rps64:.0%}",
         g.rps64 >= 0.9 * fl.rps64),
        (f"req/s at c=256 >= 90% of the floor's: {g.rps256 / fl.rps256:.0%}",
         g.rps256 >= 0.9 * fl.rps256),
        (f"p99 at c=256 <= 1.5x the floor's: {g.p99_256:.1f} vs {fl.p99_256:.1f} ms "
         f"({g.p99_256 / fl.p99_256:.2f}x)", g.p99_256 <= 1.5 * fl.p99_256),
        (f"added p50 at c=1 within 0.1 ms of the floor's: {g.add_p50:.2f} vs "
         f"{fl.add_p50:.2f} ms", g.add_p50 <= fl.add_p50 + 0.1),
        (f"added p99 at c=1 within 0.1 ms of the floor's: {g.add_p99:.2f} vs "
         f"{fl.add_p99:.2f} ms", g.add_p99 <= fl.add_p99 + 0.1),
        (f"added first-chunk p99 within 0.2 ms of the floor's: {g.ttft_add99:.2f} vs "
         f"{fl.ttft_add99:.2f} ms", g.ttft_add99 <= fl.ttft_add99 + 0.2),
        (f"{max(args.streams)} concurrent streams, every chunk on time: {g.streams_cell()}",
         g.tried == max(args.streams) and g.clean == g.tried),
        (f"the gateway's own time as its /metrics tells it (mean at c=1) within 0.1 ms of "
         f"the added p50 measured side by side: {g.gateway_c1:.2f} vs {g.add_p50:.2f} ms",
         abs(g.gateway_c1 - g.add_p50) <= 0.1),
    ]
    return checklist(checks)


def rust_goal(g: View, r: View) -> list[str]:
    """The goal set against the Rust router: its requests per second on one
    core, its p99 at c=256, and its added p50 at c=1 within 0.05 ms."""
    checks: list[tuple[str, bool]] = [
        (f"req/s at c=64 >= vllm-router's: {g.rps64:,.0f} vs {r.rps64:,.0f} "
         f"({g.rps64 / r.rps64:.2f}x)", g.rps64 >= r.rps64),
        (f"req/s at c=256 >= vllm-router's: {g.rps256:,.0f} vs {r.rps256:,.0f} "
         f"({g.rps256 / r.rps256:.2f}x)", g.rps256 >= r.rps256),
        (f"p99 at c=256 <= vllm-router's: {g.p99_256:.1f} vs {r.p99_256:.1f} ms",
         g.p99_256 <= r.p99_256),
        (f"added p50 at c=1 within 0.05 ms of vllm-router's: {g.add_p50:.2f} vs "
         f"{r.add_p50:.2f} ms", g.add_p50 <= r.add_p50 + 0.05),
    ]
    return checklist(checks)


def server_choice(u: View, g: View) -> list[str]:
    """The same gateway on uvicorn (`u`, llmgw's server) and on granian
    (`g`): granian is worth the move only if it is faster on every count."""
    checks: list[tuple[str, bool]] = [
        (f"granian's req/s at c=64 above uvicorn's: {g.rps64:,.0f} vs {u.rps64:,.0f} "
         f"({g.rps64 / u.rps64:.2f}x)", g.rps64 > u.rps64),
        (f"granian's req/s at c=256 above uvicorn's: {g.rps256:,.0f} vs {u.rps256:,.0f} "
         f"({g.rps256 / u.rps256:.2f}x)", g.rps256 > u.rps256),
        (f"granian's p99 at c=256 below uvicorn's: {g.p99_256:.1f} vs {u.p99_256:.1f} ms",
         g.p99_256 < u.p99_256),
        (f"granian's added p50 at c=1 below uvicorn's: {g.add_p50:.2f} vs {u.add_p50:.2f} ms",
         g.add_p50 < u.add_p50),
        (f"granian's CPU per request at c=64 below uvicorn's: {g.cpu64:.0f} vs "
         f"{u.cpu64:.0f} us", g.cpu64 < u.cpu64),
    ]
    return checklist(checks)


def checklist(checks: list[tuple[str, bool]]) -> list[str]:
    """Markdown task lines: each goal, ticked when met."""
    return [f"- [{'x' if ok else ' '}] {what}" for what, ok in checks]


def summary_line(views: dict[str, Any]) -> str:
    nan = float("nan")

    def get(name: str, attr: str) -> float:
        v = views.get(name)
        return float(getattr(v, attr)) if v is not None else nan

    def n(x: float) -> str:
        return "nan" if math.isnan(x) else str(round(x))

    def x(v: float) -> str:
        return "nan" if math.isnan(v) else f"{v:.2f}"

    return ("router_overhead: "
            f"llmgw_rps_c64={n(get('llmgw', 'rps64'))} floor_rps_c64={n(get('floor', 'rps64'))} "
            f"llmgw_rps_c256={n(get('llmgw', 'rps256'))} "
            f"floor_rps_c256={n(get('floor', 'rps256'))} "
            f"llmgw_p99_c256_ms={x(get('llmgw', 'p99_256'))} "
            f"floor_p99_c256_ms={x(get('floor', 'p99_256'))} "
            f"added_p50_ms={x(get('llmgw', 'add_p50'))} "
            f"gateway_metric_ms={x(get('llmgw', 'gateway_c1'))} "
            f"floor_added_p50_ms={x(get('floor', 'add_p50'))} "
            f"ttft_added_p99_ms={x(get('llmgw', 'ttft_add99'))} "
            f"clean_streams={n(get('llmgw', 'clean'))} "
            f"vllmrouter_rps_c64={n(get('vllm-router', 'rps64'))} "
            f"vllmrouter_rps_c256={n(get('vllm-router', 'rps256'))} "
            f"vllmrouter_p99_c256_ms={x(get('vllm-router', 'p99_256'))} "
            f"vllmrouter_added_p50_ms={x(get('vllm-router', 'add_p50'))} "
            f"litellm_rps_c64={n(get('litellm', 'rps64'))} "
            f"granian_rps_c64={n(get('llmgw-granian', 'rps64'))} "
            f"granian_rps_c256={n(get('llmgw-granian', 'rps256'))}")
