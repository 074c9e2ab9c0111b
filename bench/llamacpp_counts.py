#!/usr/bin/env python3
"""What counting a llama.cpp stream's prompt costs the engine: streams that
ask for their usage, through llmgw and straight to the engine, interleaved,
on the quickstart's engine (SmolLM2-135M on llama-cpp-python's server).

llama-cpp-python's streams carry no usage, so llmgw has the engine count
the prompt as the stream ends (app/router/usage/prompt_count.py). It can
count it two ways: the route our agent adds to the engine (the chat's own
template and tokenizer, the model not run), or, on an engine an older agent
started, the same chat for one token, a second prefill of the prompt when
another request came between. This runs each checkout given (`--roots`:
this one by default; a second one, e.g. `git worktree add /tmp/before
HEAD~1`, side by side) as the quickstart runs it, and prints per
concurrency: the engine's chat completions per stream (each a prefill of
the prompt) and its count requests per stream (its access log), the added
time to first token p50 and the throughput, against the engine alone.

    python bench/llamacpp_counts.py --roots /tmp/before,. --streams 30

Not a test (pytest never collects bench/); writes its section of
bench/RESULTS.md (bench/sections.py).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))

import sections  # noqa: E402
import serve  # noqa: E402
from serve_tools import Target  # noqa: E402

# About 220 of SmolLM2's tokens.
PROMPT = ("Summarise in one line what follows. " + " ".join(
    f"Item {i}: the river passes the mill, the bridge and the old town hall." for i in range(14)))


def one_stream(target: Target, usage: bool) -> tuple[float, float]:
    """(seconds to the first content chunk, seconds to the end) of one stream."""
    body = {"model": serve.MODEL, "max_tokens": 16, "temperature": 0, "stream": True,
            "messages": [{"role": "user", "content": PROMPT}]}
    if usage:
        body["stream_options"] = {"include_usage": True}
    t0 = time.perf_counter()
    first = float("nan")
    with httpx.stream("POST", target.url + "/v1/chat/completions", json=body, timeout=120,
                      headers={"Authorization": f"Bearer {target.key}"}) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if first != first and '"content"' in line:
                first = time.perf_counter() - t0
    return first, time.perf_counter() - t0


def run(target: Target, streams: int, concurrency: int) -> tuple[list[float], float]:
    """`streams` streams, `concurrency` at a time: their first-chunk times
    and the streams per second."""
    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        got = list(pool.map(lambda _: one_stream(target, target.name == "llmgw"),
                            range(streams)))
    return [f for f, _ in got], streams / (time.perf_counter() - t0)


def engine_posts(gw: serve.Gateway, admin: str) -> tuple[int, int]:
    """Chat completions (each a prefill of its prompt) and other POSTs (the
    counts) in the engine's access log so far."""
    reps = serve.http(f"{gw.url}/admin/replicas", admin)
    rep = next(r for r in reps if r["model"] == serve.MODEL and r["phase"] == "ready")
    lines = serve.http(f"{gw.url}/admin/nodes/{rep['node']}/logs?source={rep['id']}"
                       "&lines=10000", admin)["lines"]
    chats = sum('"POST /v1/chat/completions ' in line for line in lines)
    return chats, sum('"POST ' in line for line in lines) - chats


def measure(root: Path, args: argparse.Namespace, work: Path) -> list[str]:
    serve.ROOT = root  # the checkout whose llmgw runs (its `python -m app.cli serve`)
    gw = serve.Gateway(work / root.name, args.port)
    out = []
    try:
        llmgw, direct = gw.start(serve.llamacpp_engine(work), 300)
        admin = (gw.data_dir / "admin-token").read_text().strip()
        run(llmgw, 4, 1)
        run(direct, 4, 1)  # warm: the prompt's prefix cached, the server's paths hot
        for c in args.concurrency:
            ttft: dict[str, list[float]] = {"llmgw": [], "direct": []}
            rate: dict[str, list[float]] = {"llmgw": [], "direct": []}
            chats = counts = 0
            for _ in range(args.pairs):
                for target in (llmgw, direct):
                    before = engine_posts(gw, admin)
                    firsts, per_s = run(target, args.streams // args.pairs, c)
                    if target is llmgw:
                        time.sleep(1.0)  # the counts made after a stream
                        after = engine_posts(gw, admin)
                        chats += after[0] - before[0]
                        counts += after[1] - before[1]
                    ttft[target.name] += firsts
                    rate[target.name].append(per_s)
            n = args.streams // args.pairs * args.pairs
            added = (statistics.median(ttft["llmgw"]) - statistics.median(ttft["direct"])) * 1e3
            ratio = statistics.mean(rate["llmgw"]) / statistics.mean(rate["direct"])
            line = (f"llamacpp_counts: root={root.name} concurrency={c} streams={n} "
                    f"engine_chats_per_stream={chats / n:.2f} "
                    f"engine_counts_per_stream={counts / n:.2f} "
                    f"ttft_added_p50_ms={added:.1f} throughput_ratio={ratio:.3f}")
            print(line, flush=True)
            out.append(line)
    finally:
        gw.stop()
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--roots", default=str(BENCH.parent),
                   help="checkouts to run, comma-separated, each side by side")
    p.add_argument("--concurrency", default="1,4")
    p.add_argument("--streams", type=int, default=30, help="streams each way, per concurrency")
    p.add_argument("--pairs", type=int, default=3, help="llmgw/direct alternations")
    p.add_argument("--port", type=int, default=18931)
    p.add_argument("--results", type=Path, default=BENCH / "RESULTS.md")
    args = p.parse_args(argv)
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    lines = []
    with tempfile.TemporaryDirectory(prefix="llamacpp-counts-") as tmp:
        for root in args.roots.split(","):
            lines += measure(Path(root).resolve(), args, Path(tmp))
    sections.replace_section(args.results, "llamacpp-counts", "\n".join([
        "## A llama.cpp stream's prompt count (bench/llamacpp_counts.py)", "",
        f"{args.streams} streams each way per concurrency, 221-token prompt, 16 tokens "
        "out, include_usage through llmgw; interleaved with the engine alone.", "",
        "```", *lines, "```"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
