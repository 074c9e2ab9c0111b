"""How bench/serve.py runs each tool and reads its report: one function per
tool, taking a Job, returning a Run with the same figures for both."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# A run that has not ended by then is killed: a tool stuck on a dead engine
# must not hold the benchmark for ever.
GRACE_S = 600


@dataclass(frozen=True)
class Target:
    name: str  # "llmgw" or "direct"
    url: str
    key: str
    # Where GuideLLM's first check goes: GET /health (as vLLM answers it);
    # llama-cpp-python's server has none, its /v1/models stands in.
    health: str = "health"


@dataclass(frozen=True)
class Job:
    venv: Path
    target: Target
    model: str
    tokenizer: Path
    work: Path
    concurrency: int
    seconds: int
    prompt_tokens: int
    output_tokens: int
    requests: int


@dataclass(frozen=True)
class Run:
    tool: str
    target: str
    pair: int
    ok: int
    failed: int
    ttft_p50_ms: float
    ttft_p99_ms: float
    itl_p50_ms: float
    tokens_per_s: float
    wall_s: float
    # CPU seconds the gateway's process and the engine's used during the run
    # (bench/serve.py measures them around the tool).
    gateway_cpu_s: float = float("nan")
    engine_cpu_s: float = float("nan")


def _run(cmd: list[str], job: Job) -> float:
    """Run the tool, its output in job.work/log.txt; the wall time."""
    job.work.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    with (job.work / "log.txt").open("wb") as log:
        proc = subprocess.run(cmd, cwd=job.work, stdout=log, stderr=subprocess.STDOUT,
                              timeout=job.seconds + GRACE_S, check=False,
                              env={"PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1",
                                   "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                                   "HOME": str(job.work), "GUIDELLM__LOGGING__DISABLED": "1"})
    if proc.returncode != 0:
        tail = (job.work / "log.txt").read_text(errors="replace")[-2000:]
        raise RuntimeError(
            f"{job.venv.name} exited {proc.returncode} on {job.target.name}:\n{tail}")
    return time.monotonic() - t0


def inference_perf(job: Job, pair: int) -> Run:
    """inference-perf 0.7: a concurrent stage of `concurrency` workers, streaming
    completions of random prompts; its summary_lifecycle_metrics.json (seconds)."""
    # Concurrent stages are sized in requests, not seconds (--requests).
    requests = max(job.concurrency, job.requests)
    config = {
        "api": {"type": "completion", "streaming": True},
        "data": {"type": "random",
                 "input_distribution": _fixed(job.prompt_tokens),
                 "output_distribution": _fixed(job.output_tokens)},
        "load": {"type": "concurrent", "num_workers": 1,
                 "stages": [{"num_requests": requests, "concurrency_level": job.concurrency}]},
        "server": {"type": "vllm", "model_name": job.model, "base_url": job.target.url,
                   "api_key": job.target.key, "ignore_eos": True},
        "tokenizer": {"pretrained_model_name_or_path": str(job.tokenizer)},
        "report": {"request_lifecycle": {"summary": True, "per_stage": False}},
        "storage": {"local_storage": {"path": str(job.work / "reports")}},
    }
    _fresh(job.work)
    (job.work / "config.json").write_text(json.dumps(config, indent=1))
    wall = _run([str(job.venv / "bin" / "python"), "-c",
                 "from inference_perf.main import main_cli; main_cli()",
                 "--config_file", str(job.work / "config.json")], job)
    summary = json.loads(next((job.work / "reports").rglob(
        "summary_lifecycle_metrics.json")).read_text())
    ok = summary["successes"]
    lat = ok["latency"]
    return Run("inference-perf", job.target.name, pair, int(ok["count"]),
               int(summary.get("failures", {}).get("count", 0)),
               1000 * lat["time_to_first_token"]["median"],
               1000 * lat["time_to_first_token"]["p99"],
               1000 * lat["inter_token_latency"]["median"],
               float(ok["throughput"]["output_tokens_per_sec"]), wall)


def _fresh(work: Path) -> None:
    """An empty folder: a report left by an earlier run is never read as this one's."""
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)


def _fixed(n: int) -> dict[str, Any]:
    return {"min": n, "max": n, "mean": n, "std_dev": 0}


def guidellm(job: Job, pair: int) -> Run:
    """GuideLLM 0.8: the concurrent profile at `concurrency` streams for
    `seconds`, synthetic prompts, given as a scenario file; its JSON report
    (milliseconds)."""
    out = job.work / "benchmarks.json"
    scenario = {"spec": {
        "backend": {"kind": "openai_http", "target": job.target.url, "model": job.model,
                    "api_key": job.target.key, "request_format": "/v1/completions",
                    "api_routes": {"/health": job.target.health}},
        "profile": {"kind": "concurrent", "streams": [job.concurrency]},
        "tokenizer": {"kind": "huggingface_auto", "model": str(job.tokenizer)},
        "data": [{"kind": "synthetic_text", "prompt_tokens": job.prompt_tokens,
                  "output_tokens": job.output_tokens}],
        "constraints": [{"kind": "max_duration", "seconds": job.seconds}],
        "outputs": [{"kind": "json", "path": str(out)}],
    }}
    _fresh(job.work)
    (job.work / "scenario.json").write_text(json.dumps(scenario, indent=1))
    wall = _run([str(job.venv / "bin" / "python"), "-m", "guidellm", "run",
                 "--scenario", str(job.work / "scenario.json"), "--disable-progress"], job)
    bench = json.loads(out.read_text())["benchmarks"][0]
    m = bench["metrics"]
    totals = m["request_totals"]
    # Failed: errored only; "incomplete" ones were in flight when
    # max_duration ended the run (cancelled by the tool, not failed).
    return Run("guidellm", job.target.name, pair, int(totals["successful"]),
               int(totals.get("errored", 0)),
               float(m["time_to_first_token_ms"]["successful"]["median"]),
               float(m["time_to_first_token_ms"]["successful"]["percentiles"]["p99"]),
               float(m["inter_token_latency_ms"]["successful"]["median"]),
               float(m["output_tokens_per_second"]["successful"]["mean"]), wall)


TOOLS: dict[str, Callable[[Job, int], Run]] = {
    "inference-perf": inference_perf,
    "guidellm": guidellm,
}
