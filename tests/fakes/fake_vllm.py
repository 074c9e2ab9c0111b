#!/usr/bin/env python3
"""A stand-in for ``vllm serve`` that needs no GPU.

It accepts vLLM's real command line (``vllm serve MODEL [flags]``): its
``serve`` parser is generated from ``vllm_serve_flags.json``, flags recorded
from a named vLLM version; any other flag is an argparse error (exit status
2). It serves the parts of vLLM's OpenAI-compatible HTTP API that llmgw talks
to:

* ``GET /health`` (200, empty body), ``GET /version``, ``GET|POST /ping``
* ``GET /metrics`` (Prometheus text, vLLM's metric names, live values), and
  ``fake_vllm_metrics_requests_total``: the /metrics requests served, this one
  included (a test counts the engine's scrapers with it)
* ``GET /v1/models``, ``POST /v1/chat/completions``, ``POST /v1/completions``,
  ``POST /v1/embeddings``
* outside ``/v1``, without the key as vLLM does: ``POST /invocations``,
  ``/tokenize``, ``/detokenize``, ``/pooling``, ``/classify``, ``/score``,
  ``/rerank`` (fake_vllm_more.py), and ``--middleware IMPORT.PATH`` as vLLM
  adds it (a class or a coroutine function; fake_vllm_more.py says how).

The reply is deterministic: ``fake-vllm <served-name> echo: <last user
message>`` (or ``<prompt>`` for text completions), streamed one word per chunk.
Embeddings are ``fake_embedding(served-name, text)``: 32 numbers from a hash,
each exactly representable as float32, so ``encoding_format="base64"`` (the
official ``openai`` client's default) decodes to the same values as "float".

A client that disconnects aborts its request, as vLLM does (it listens for
the disconnect): the generation stops, ``vllm:num_requests_running`` drops,
and ``vllm:request_success_total{finished_reason="abort"}`` counts it.

Environment:

* ``FAKE_VLLM_TOKEN_DELAY``   seconds to sleep before each generated word (default 0)
* ``FAKE_VLLM_PREFILL_DELAY`` seconds of prefill per prompt token not in the prefix cache,
  before a chat's first token (default 0). The cache holds every message prefix of
  the chats served (as vLLM's automatic prefix caching holds their KV blocks), so the
  next turn of a conversation on the same engine prefills only its new messages.
* ``FAKE_VLLM_STARTUP_DELAY`` seconds to wait before binding the port (default 0),
  like vLLM loading weights; ``/health`` is unreachable until then.
* ``FAKE_VLLM_HOLD_DIR``      a folder: while a file there is named after one of the engine's
  served model names, it waits (port unbound, as still loading weights) until the file
  is removed. One engine of an agent held while its others start: a test can kill
  the agent while that engine runs but is not ready.
* ``VLLM_API_KEY``            the key ``/v1`` demands when ``--api-key`` is not given,
  as real vLLM reads it (``args.api_key or envs.VLLM_API_KEY``).
* ``VLLM_RPC_BASE_PATH``      a folder: a Unix socket is bound there under a uuid, as
  vLLM binds its ZeroMQ sockets, removed on a clean exit and left by a kill, as
  vLLM's are (unset: none; vLLM would use the system's temporary folder).
* ``FAKE_VLLM_BASE_LOAD``     ``RUNNING,WAITING``: added to the live
  ``vllm:num_requests_running`` and ``vllm:num_requests_waiting`` gauges, a steady load
  a test can look for (default none).
* ``FAKE_VLLM_DIE_AFTER``     N: a streamed chat or completion breaks off after N words
  (its connection dropped, as by an engine dying mid-stream), except one that
  continues a message it was given (fake_vllm_continue.py says how it does).
* ``FAKE_VLLM_DIE_ON_CHAT``   a signal name (``SIGILL``): the engine kills itself with
  it on each chat completion, like a build for another CPU that passes the
  health check and dies on its first real request.

With ``--tensor-parallel-size N`` > 1 it starts N-1 idle worker processes, as
vLLM does, and does not stop them itself (as a vLLM killed by a signal
cannot): a kill of its process group ends them; else, orphaned, they linger
30 s (long enough for a test to see them left behind, short enough not to
leak for long).

What was checked against vLLM's own source (search tool, repository
vllm-project/vllm, v0.10/v0.11 era):

* Flags and defaults: ``vllm/entrypoints/openai/cli_args.py`` (FrontendArgs:
  ``host: str | None = None`` -- None means every interface, ``port = 8000``,
  ``uvicorn_log_level`` choices, ``api_key: list[str] | None`` -> nargs='+',
  positional ``model_tag`` nargs='?') and ``vllm/engine/arg_utils.py``
  (``--tensor-parallel-size``/``-tp``, ``--pipeline-parallel-size``/``-pp``,
  ``--data-parallel-size``/``-dp``, ``--gpu-memory-utilization`` (0.9),
  ``--max-model-len`` (accepts 1k/1K style), ``--dtype`` choices,
  ``--served-model-name`` (list -> nargs='+'), bool fields become
  ``--x/--no-x`` via BooleanOptionalAction, ``--enable-log-requests`` and the
  DEPRECATED ``--disable-log-requests`` ("will be removed in v0.12.0"),
  ``--disable-log-stats`` store_true). vLLM's FlexibleArgumentParser also
  accepts ``--max_model_len`` spellings (underscores -> dashes).
* Auth: ``vllm/entrypoints/openai/server_utils.py`` AuthenticationMiddleware:
  only paths starting with ``/v1`` are checked, OPTIONS skipped, scheme
  "bearer" case-insensitive, failure -> 401 ``{"error": "Unauthorized"}``.
* Errors: ``ErrorResponse{error: ErrorInfo{message, type, param, code:int}}``;
  unknown model -> 404, "The model `X` does not exist.", type "NotFoundError".
* Metrics: ``vllm/v1/metrics/loggers.py`` PrometheusStatLogger: labels
  ``model_name`` (first served name) and ``engine`` ("0");
  gauges ``vllm:num_requests_running``, ``vllm:num_requests_waiting``,
  ``vllm:kv_cache_usage_perc`` (the 0.9+ name; ``vllm:gpu_cache_usage_perc`` is
  the deprecated one); counters (prometheus_client appends ``_total``)
  ``vllm:prompt_tokens``, ``vllm:generation_tokens``, ``vllm:num_preemptions``,
  ``vllm:prefix_cache_queries``, ``vllm:prefix_cache_hits``,
  ``vllm:request_success`` (+ label ``finished_reason``); histograms
  ``vllm:time_to_first_token_seconds``, ``vllm:e2e_request_latency_seconds``.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import collections
import hashlib
import json
import os
import re
import signal
import socket
import struct
import sys
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from contextlib import aclosing
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from aiohttp import web

if __package__:
    from tests.fakes import fake_vllm_continue as resume
else:  # run as a script: its folder is on sys.path
    import fake_vllm_continue as resume  # type: ignore[no-redef]

FAKE_VERSION = "0.11.0+fake"
DEFAULT_MAX_MODEL_LEN = 4096
DEFAULT_MAX_NUM_SEQS = 256  # vLLM's default for the OpenAI server usage context
EMBED_DIM = 32


def fake_embedding(model: str, text: str) -> list[float]:
    """The vector the fake answers for `text`: k/128 values, exact in float32."""
    digest = hashlib.sha256(f"{model}\0{text}".encode()).digest()
    return [(b - 128) / 128 for b in digest[:EMBED_DIM]]


# --------------------------------------------------------------------------- CLI


def _human_readable_int(value: str) -> int:
    """vLLM's parser for --max-model-len / --max-num-batched-tokens (1k, 2K, 25.6k)."""
    value = value.strip()
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([kKmMgGtT])", value)
    if m:
        number, suffix = m.groups()
        dec = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
        binary = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
        if suffix in dec:
            return int(float(number) * dec[suffix])
        try:
            return int(number) * binary[suffix]
        except ValueError as e:
            raise argparse.ArgumentTypeError(
                f"Decimals are not allowed with binary suffixes like {suffix}."
            ) from e
    try:
        return int(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"invalid int value: {value!r}") from e


def _optional(conv: Any) -> Any:
    def parse(val: str) -> Any:
        if val in ("", "None"):
            return None
        return conv(val)

    parse.__name__ = getattr(conv, "__name__", "value")
    return parse


def _flexible_argv(argv: Sequence[str]) -> list[str]:
    """Like vLLM's FlexibleArgumentParser: ``--max_model_len`` == ``--max-model-len``."""
    out: list[str] = []
    for arg in argv:
        if arg.startswith("--") and "_" in arg.split("=", 1)[0]:
            key, sep, val = arg.partition("=")
            arg = key.replace("_", "-") + sep + val
        out.append(arg)
    return out


FLAGS_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "vllm_serve_flags.json")


def recorded_flags() -> dict[str, Any]:
    """The recorded ``vllm serve`` flags (see vllm_serve_flags.json)."""
    with open(FLAGS_FILE, encoding="utf-8") as f:
        return dict(json.load(f))


_TYPES: dict[str, dict[str, Any]] = {
    "str": {"type": str},
    "int": {"type": int},
    "float": {"type": float},
    "str?": {"type": _optional(str)},
    "int?": {"type": _optional(int)},
    "human_int?": {"type": _optional(_human_readable_int)},
    "json?": {"type": _optional(json.loads)},
    "list": {"nargs": "+", "type": _optional(str)},
    "bool": {"action": argparse.BooleanOptionalAction},
    "append": {"action": "append", "type": str},
    "store_true": {"action": "store_true"},
}


def build_parser() -> argparse.ArgumentParser:
    # allow_abbrev=False: stricter than argparse's default so that a shortened or
    # misspelt flag from our launcher fails here instead of silently matching.
    parser = argparse.ArgumentParser(prog="vllm", description="fake vLLM CLI (tests only)",
                                     allow_abbrev=False)
    parser.add_argument("-v", "--version", action="version", version=FAKE_VERSION)
    sub = parser.add_subparsers(dest="subparser", required=True)
    s = sub.add_parser("serve", help="Start the fake vLLM OpenAI-compatible API server.",
                       allow_abbrev=False)
    s.usage = "vllm serve [model_tag] [options]"
    s.add_argument("model_tag", nargs="?", default=None, help="The model tag to serve.")
    for flag in recorded_flags()["flags"]:
        kind = flag["type"]
        kwargs = ({"choices": flag["choices"]} if kind == "choice" else dict(_TYPES[kind]))
        s.add_argument(*flag["names"], default=flag["default"], **kwargs)
    return parser


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(_flexible_argv(argv))
    if args.model_tag is not None:
        args.model = args.model_tag
    if not args.model:
        # vLLM falls back to a default model; a launcher that forgets the model is a bug.
        parser.error("the model to serve is required: vllm serve MODEL")
    if args.served_model_name is None:
        args.served_model_name = [args.model]
    if args.max_model_len is None:
        args.max_model_len = DEFAULT_MAX_MODEL_LEN
    if args.max_num_seqs is None:
        args.max_num_seqs = DEFAULT_MAX_NUM_SEQS
    if not 0 < args.gpu_memory_utilization <= 1:
        parser.error("--gpu-memory-utilization must be in (0, 1]")
    if args.enable_auto_tool_choice and not args.tool_call_parser:
        parser.error("--enable-auto-tool-choice requires --tool-call-parser")
    return args


# ----------------------------------------------------------------------- metrics


@dataclass
class Histogram:
    buckets: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    n: int = 0

    def __post_init__(self) -> None:
        self.counts = [0] * len(self.buckets)

    def observe(self, v: float) -> None:
        self.total += v
        self.n += 1
        for i, b in enumerate(self.buckets):
            if v <= b:
                self.counts[i] += 1


TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
               50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
FINISH_REASONS = ("stop", "length", "abort")


class Stats:
    def __init__(self, model_name: str, max_num_seqs: int, max_model_len: int) -> None:
        self.model_name = model_name
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.running = 0
        self.waiting = 0
        base = os.environ.get("FAKE_VLLM_BASE_LOAD", "") or "0,0"
        self.base_running, self.base_waiting = (int(x) for x in base.split(","))
        self.scrapes = 0
        self.kv_tokens = 0  # tokens held by running requests
        self.prompt_tokens = 0
        self.cached_tokens = 0  # prompt tokens found in the prefix cache
        self.generation_tokens = 0
        self.success = dict.fromkeys(FINISH_REASONS, 0)
        self.ttft = Histogram(TTFT_BUCKETS)
        self.e2e = Histogram(E2E_BUCKETS)
        self.created = time.time()

    def kv_usage(self) -> float:
        capacity = self.max_num_seqs * self.max_model_len
        return min(1.0, self.kv_tokens / capacity) if capacity else 0.0

    def render(self) -> str:
        labels = f'model_name="{_escape(self.model_name)}",engine="0"'
        lines: list[str] = []

        def gauge(name: str, doc: str, value: float) -> None:
            lines.extend([f"# HELP {name} {doc}", f"# TYPE {name} gauge",
                          f"{name}{{{labels}}} {_num(value)}"])

        def counter(name: str, doc: str, values: dict[str, float]) -> None:
            # prometheus_client exposition: TYPE uses the base name, samples get _total.
            lines.extend([f"# HELP {name} {doc}", f"# TYPE {name} counter"])
            for extra, value in values.items():
                lab = labels + extra
                lines.append(f"{name}_total{{{lab}}} {_num(value)}")
                lines.append(f"{name}_created{{{lab}}} {_num(self.created)}")

        def histogram(name: str, doc: str, h: Histogram) -> None:
            lines.extend([f"# HELP {name} {doc}", f"# TYPE {name} histogram"])
            for b, c in zip(h.buckets, h.counts, strict=True):
                lines.append(f'{name}_bucket{{{labels},le="{_num(b)}"}} {_num(c)}')
            lines.append(f'{name}_bucket{{{labels},le="+Inf"}} {_num(h.n)}')
            lines.append(f"{name}_count{{{labels}}} {_num(h.n)}")
            lines.append(f"{name}_sum{{{labels}}} {_num(h.total)}")

        gauge("vllm:num_requests_running", "Number of requests in model execution batches.",
              self.running + self.base_running)
        gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.",
              self.waiting + self.base_waiting)
        gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
              self.kv_usage())
        counter("vllm:prefix_cache_queries",
                "Prefix cache queries, in terms of number of queried tokens.",
                {"": self.prompt_tokens})
        counter("vllm:prefix_cache_hits",
                "Prefix cache hits, in terms of number of cached tokens.",
                {"": self.cached_tokens})
        counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.",
                {"": 0})
        counter("vllm:prompt_tokens", "Number of prefill tokens processed.",
                {"": self.prompt_tokens})
        counter("vllm:generation_tokens", "Number of generation tokens processed.",
                {"": self.generation_tokens})
        counter("vllm:request_success", "Count of successfully processed requests.",
                {f',finished_reason="{r}"': v for r, v in self.success.items()})
        histogram("vllm:time_to_first_token_seconds",
                  "Histogram of time to first token in seconds.", self.ttft)
        histogram("vllm:e2e_request_latency_seconds",
                  "Histogram of e2e request latency in seconds.", self.e2e)
        self.scrapes += 1
        lines.extend(["# HELP fake_vllm_metrics_requests Requests for /metrics served.",
                      "# TYPE fake_vllm_metrics_requests counter",
                      f"fake_vllm_metrics_requests_total {self.scrapes}"])
        return "\n".join(lines) + "\n"


def _escape(s: str) -> str:
    return s.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _num(v: float) -> str:
    return repr(float(v))


# ----------------------------------------------------------------------- serving


def _log(msg: str, level: str = "INFO") -> None:
    print(f"{level} {time.strftime('%m-%d %H:%M:%S')} [fake_vllm] {msg}", file=sys.stderr,
          flush=True)


def _die(name: str) -> None:
    """Dies by signal `name`, as a crashing engine would (no core file)."""
    import resource

    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    _log(f"FAKE_VLLM_DIE_ON_CHAT={name}: dying by it", "ERROR")
    sig = signal.Signals[name]
    signal.signal(sig, signal.SIG_DFL)
    os.kill(os.getpid(), sig)


def _start_workers(count: int) -> list[int]:
    """Idle stand-ins for vLLM's tensor-parallel workers, never stopped by
    this process (a vLLM killed by a signal leaves its workers behind)."""
    import subprocess

    code = ("import os, time\n"
            "parent = os.getppid()\n"
            "while os.getppid() == parent:\n"
            "    time.sleep(0.2)\n"
            "time.sleep(30)\n")
    pids = []
    for rank in range(1, count):
        worker = subprocess.Popen([sys.executable, "-c", code, f"fake-vllm-worker-{rank}"],
                                  stdin=subprocess.DEVNULL)
        pids.append(worker.pid)
    return pids


def _error(status: int, message: str, err_type: str, param: str | None = None) -> web.Response:
    body = {"error": {"message": message, "type": err_type, "param": param, "code": status}}
    return web.json_response(body, status=status)


def _invalid(loc: str, kind: str, msg: str) -> web.Response:
    """A 400 as FastAPI's request validation makes it under vLLM: the
    error's location is the param, "Bad Request" its type."""
    detail = {"type": kind, "loc": loc, "msg": msg}
    return _error(400, f"1 validation error:\n  {detail}", "Bad Request", loc)


def _count_tokens(text: str) -> int:
    return len(text.split())


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return " ".join(
            str(p.get("text", "")) for p in content if isinstance(p, dict) and "text" in p
        )
    return ""


class FakeVLLM:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.names: list[str] = list(args.served_model_name)
        # vLLM: `args.api_key or envs.VLLM_API_KEY`.
        keys = args.api_key or [os.environ.get("VLLM_API_KEY", "")]
        self.api_keys: list[str] = [k for k in keys if k]
        self.token_delay = float(os.environ.get("FAKE_VLLM_TOKEN_DELAY", "0") or 0)
        self.prefill_delay = float(os.environ.get("FAKE_VLLM_PREFILL_DELAY", "0") or 0)
        self.die_after = int(os.environ.get("FAKE_VLLM_DIE_AFTER", "0") or 0)
        # Message-prefix hash -> its token count; oldest dropped past the cap.
        self.prefix_cache: collections.OrderedDict[str, int] = collections.OrderedDict()
        self.stats = Stats(self.names[0], args.max_num_seqs, args.max_model_len)
        self.slots = asyncio.Semaphore(args.max_num_seqs)
        self.created = int(time.time())
        # LoRA adapters loaded at run time: lora_name -> lora_path.
        self.loras: dict[str, str] = {}

    # -- app ---------------------------------------------------------------
    def make_app(self) -> web.Application:
        @web.middleware
        async def auth(request: web.Request, handler: Any) -> web.StreamResponse:
            return await self.auth_middleware(request, handler)

        if __package__:
            from tests.fakes import fake_vllm_more as more
        else:  # run as a script: its folder is on sys.path
            import fake_vllm_more as more  # type: ignore[no-redef]
        if __package__:
            from tests.fakes.fake_vllm_responses import Responses as more_routes
        else:
            from fake_vllm_responses import Responses as more_routes  # type: ignore[no-redef]

        # vLLM adds --middleware after its own key check: they wrap it.
        stack = more.middleware_stack(self.args.middleware)
        app = web.Application(middlewares=[more.asgi_bridge(stack), auth])
        more.add_unguarded_routes(app, self, fake_embedding)
        app.router.add_get("/health", self.health)
        app.router.add_get("/version", self.version)
        app.router.add_route("*", "/ping", self.health)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/embeddings", self.embeddings)
        more_routes(self).add_routes(app)  # responses, rerank, score, audio
        # vLLM registers these only with VLLM_ALLOW_RUNTIME_LORA_UPDATING set.
        if os.environ.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "").lower() in ("true", "1"):
            app.router.add_post("/v1/load_lora_adapter", self.load_lora)
            app.router.add_post("/v1/unload_lora_adapter", self.unload_lora)
        return app

    async def load_lora(self, request: web.Request) -> web.Response:
        """vLLM's POST /v1/load_lora_adapter {lora_name, lora_path}."""
        body = await self._lora_body(request)
        if body is None or not isinstance(body.get("lora_path"), str):
            return _error(400, "lora_name and lora_path are required.", "BadRequestError")
        if not self.args.enable_lora:
            return _error(400, "LoRA is not enabled: start with --enable-lora.",
                          "BadRequestError")
        name = body["lora_name"]
        if name in self.loras:
            return _error(400, f"The lora adapter '{name}' has already been loaded. If you "
                          "want to load the adapter in place, set 'load_inplace' to True.",
                          "InvalidUserInput")
        path = body["lora_path"]
        if path.startswith("/") and not await asyncio.to_thread(os.path.isdir, path):
            # A local folder is read at once (a hub id would be downloaded:
            # the stand-in takes it as found).
            return _error(404, f"Loading lora {name} failed: No adapter found for "
                          f"{body['lora_path']}", "NotFoundError")
        self.loras[name] = body["lora_path"]
        _log(f"Loaded new LoRA adapter: name '{name}', path '{body['lora_path']}'")
        return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")

    async def unload_lora(self, request: web.Request) -> web.Response:
        """vLLM's POST /v1/unload_lora_adapter {lora_name}."""
        body = await self._lora_body(request)
        if body is None:
            return _error(400, "lora_name is required.", "BadRequestError")
        name = body["lora_name"]
        if self.loras.pop(name, None) is None:
            return _error(404, f"The lora adapter '{name}' cannot be found.", "NotFoundError")
        _log(f"Removed LoRA adapter: name '{name}'")
        return web.Response(text=f"Success: LoRA adapter '{name}' removed successfully.")

    async def _lora_body(self, request: web.Request) -> dict[str, Any] | None:
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            return None
        if not isinstance(body, dict) or not isinstance(body.get("lora_name"), str):
            return None
        return body

    async def auth_middleware(self, request: web.Request, handler: Any) -> web.StreamResponse:
        if self.api_keys and request.method != "OPTIONS" and request.path.startswith("/v1"):
            scheme, _, token = request.headers.get("Authorization", "").partition(" ")
            if scheme.lower() != "bearer" or token not in self.api_keys:
                return web.json_response({"error": "Unauthorized"}, status=401)
        resp: web.StreamResponse = await handler(request)
        return resp

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def version(self, request: web.Request) -> web.Response:
        return web.json_response({"version": FAKE_VERSION})

    async def metrics(self, request: web.Request) -> web.Response:
        return web.Response(
            body=self.stats.render().encode(),
            headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"},
        )

    async def models(self, request: web.Request) -> web.Response:
        data = [
            {
                "id": name,
                "object": "model",
                "created": self.created,
                "owned_by": "vllm",
                "root": self.args.model,
                "parent": None,
                "max_model_len": self.args.max_model_len,
                "permission": [{
                    "id": f"modelperm-{uuid.uuid4().hex}",
                    "object": "model_permission",
                    "created": self.created,
                    "allow_create_engine": False,
                    "allow_sampling": True,
                    "allow_logprobs": True,
                    "allow_search_indices": False,
                    "allow_view": True,
                    "allow_fine_tuning": False,
                    "organization": "*",
                    "group": None,
                    "is_blocking": False,
                }],
            }
            for name in self.names
        ] + [
            # vLLM lists each loaded adapter with its path as root and the
            # base's served name as parent.
            {"id": name, "object": "model", "created": self.created, "owned_by": "vllm",
             "root": path, "parent": self.names[0], "max_model_len": self.args.max_model_len,
             "permission": []}
            for name, path in self.loras.items()
        ]
        return web.json_response({"object": "list", "data": data})

    # -- request parsing ----------------------------------------------------
    async def _parse(
        self, request: web.Request
    ) -> tuple[dict[str, Any] | None, web.Response | None]:
        try:
            body = await request.json()
        except json.JSONDecodeError as exc:
            # FastAPI's request validation, as vLLM answers it
            # (tests/test_vllm_contract.py).
            return None, _invalid(f"body.{exc.pos}", "json_invalid", "JSON decode error")
        except UnicodeDecodeError:
            return None, _invalid("body", "json_invalid", "JSON decode error")
        if not isinstance(body, dict):
            return None, _error(400, "Request body must be a JSON object.", "BadRequestError")
        model = body.get("model") or self.names[0]
        if model not in self.names and model not in self.loras:
            return None, _error(404, f"The model `{model}` does not exist.", "NotFoundError",
                                "model")
        body["model"] = model
        # vLLM takes X-Request-Id as its request's id (and the trace context
        # when it traces): logged, so tests see what reached the engine.
        _log(f"Added request {request.headers.get('X-Request-Id', '-')} traceparent="
             f"{request.headers.get('traceparent', '-')} tracestate="
             f"{request.headers.get('tracestate', '-')}")
        limit = body.get("max_completion_tokens", body.get("max_tokens"))
        if limit is not None and (not isinstance(limit, int) or limit < 1):
            return None, _error(400, f"max_tokens must be at least 1, got {limit}.",
                                "BadRequestError", "max_tokens")
        return body, None

    def _reply_words(self, model: str, asked: str, limit: int | None,
                     given: str = "", ignore_eos: bool = False) -> tuple[list[str], str]:
        """The answer's words (after `given`, the start of it to continue);
        with vLLM's `ignore_eos`, the echo repeated to `limit` words, as the
        engine generates past its end-of-sequence token."""
        words = resume.words_after(f"fake-vllm {model} echo: {asked}".split(), given)
        if ignore_eos and limit is not None and words:
            words = (words * (limit // len(words) + 1))[:limit]
        if limit is not None and limit <= len(words) and (ignore_eos or limit < len(words)):
            return words[:limit], "length"
        return words, "stop"

    # -- generation ---------------------------------------------------------
    async def _generate(self, words: list[str], prompt_tokens: int,
                        lead: bool = False) -> AsyncIterator[str]:
        """Yield deltas (words with their leading space, the first one too
        if `lead`: it continues given text), keeping the metrics live."""
        st = self.stats
        st.waiting += 1
        waiting = True
        start = time.monotonic()
        try:
            async with self.slots:
                st.waiting -= 1
                waiting = False
                st.running += 1
                st.kv_tokens += prompt_tokens
                try:
                    for i, word in enumerate(words):
                        if self.token_delay > 0:
                            await asyncio.sleep(self.token_delay)
                        if i == 0:
                            st.prompt_tokens += prompt_tokens
                            st.ttft.observe(time.monotonic() - start)
                        st.generation_tokens += 1
                        st.kv_tokens += 1
                        yield word if i == 0 and not lead else " " + word
                except (asyncio.CancelledError, GeneratorExit):  # the client left: vLLM aborts
                    st.success["abort"] += 1
                    raise
                finally:
                    st.running -= 1
                    st.kv_tokens -= prompt_tokens + len(words)
                    st.kv_tokens = max(st.kv_tokens, 0)
        finally:
            if waiting:
                st.waiting -= 1

    def _finished(self, reason: str, start: float) -> None:
        self.stats.success[reason] += 1
        self.stats.e2e.observe(time.monotonic() - start)

    @staticmethod
    def _drop(request: web.Request, resp: web.StreamResponse) -> web.StreamResponse:
        """Drops the connection mid-stream, as an engine dying does
        (FAKE_VLLM_DIE_AFTER)."""
        _log("FAKE_VLLM_DIE_AFTER: dropping a stream mid-way", "ERROR")
        assert request.transport is not None
        request.transport.abort()
        return resp

    @staticmethod
    def _usage(prompt: int, completion: int) -> dict[str, Any]:
        return {"prompt_tokens": prompt, "total_tokens": prompt + completion,
                "completion_tokens": completion, "prompt_tokens_details": None}

    async def _sse_start(self, request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(status=200, headers={
            "Content-Type": "text/event-stream; charset=utf-8",
            "Cache-Control": "no-cache",
        })
        await resp.prepare(request)
        return resp

    @staticmethod
    async def _sse(resp: web.StreamResponse, obj: Any) -> None:
        data = obj if isinstance(obj, str) else json.dumps(obj, separators=(",", ":"))
        await resp.write(f"data: {data}\n\n".encode())

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        die = os.environ.get("FAKE_VLLM_DIE_ON_CHAT", "")
        if die:
            _die(die)
        start = time.monotonic()
        body, err = await self._parse(request)
        if err is not None:
            return err
        assert body is not None
        messages = body.get("messages")
        if not isinstance(messages, list):
            return _invalid("body.messages", "list_type", "Input should be a valid list")
        if not messages:
            return _error(400, "Cannot apply chat template to an empty conversation. Provide "
                          "at least one message.", "BadRequestError")
        given, bad = resume.continued(body, messages)
        if bad is not None:
            return _error(400, bad, "BadRequestError")
        model = body["model"]
        asked = ""
        for m in reversed(messages):
            if isinstance(m, dict) and m.get("role") == "user":
                asked = _content_text(m.get("content"))
                break
        prompt_tokens = sum(
            _count_tokens(_content_text(m.get("content"))) + 1
            for m in messages if isinstance(m, dict)
        ) - (given is not None)  # an open assistant message: no framing token
        await self._prefill(messages)
        limit = body.get("max_completion_tokens", body.get("max_tokens"))
        words, reason = self._reply_words(model, asked, limit, given or "",
                                          body.get("ignore_eos") is True)
        lead = bool(given and given.split())
        req_id = f"chatcmpl-{uuid.uuid4().hex}"
        created = int(time.time())

        if not body.get("stream"):
            async with aclosing(self._generate(words, prompt_tokens, lead)) as gen:
                text = "".join([d async for d in gen])
            self._finished(reason, start)
            return web.json_response({
                "id": req_id, "object": "chat.completion", "created": created, "model": model,
                "choices": [{
                    "index": 0,
                    "message": {"role": "assistant", "content": text, "refusal": None,
                                "annotations": None, "audio": None, "function_call": None,
                                "tool_calls": [], "reasoning_content": None},
                    "logprobs": None, "finish_reason": reason, "stop_reason": None,
                }],
                "service_tier": None, "system_fingerprint": None,
                "usage": self._usage(prompt_tokens, len(words)),
                "prompt_logprobs": None, "kv_transfer_params": None,
            })

        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))

        def chunk(delta: dict[str, Any], finish: str | None) -> dict[str, Any]:
            return {"id": req_id, "object": "chat.completion.chunk", "created": created,
                    "model": model, "choices": [{"index": 0, "delta": delta, "logprobs": None,
                                                 "finish_reason": finish}]}

        resp = await self._sse_start(request)
        await self._sse(resp, chunk({"role": "assistant", "content": ""}, None))
        n = 0
        async with aclosing(self._generate(words, prompt_tokens, lead)) as gen:
            async for delta in gen:
                n += 1
                last = n == len(words)
                await self._sse(resp, chunk({"content": delta}, reason if last else None))
                if n == self.die_after and given is None and not last:
                    return self._drop(request, resp)
        self._finished(reason, start)
        if include_usage:
            await self._sse(resp, {"id": req_id, "object": "chat.completion.chunk",
                                   "created": created, "model": model, "choices": [],
                                   "usage": self._usage(prompt_tokens, n)})
        await self._sse(resp, "[DONE]")
        await resp.write_eof()
        return resp

    async def _prefill(self, messages: list[Any]) -> None:
        """Sleeps for the prompt tokens the prefix cache does not hold, then
        caches every message prefix of this prompt."""
        tokens, cached, keys = 0, 0, []
        digest = hashlib.sha256()
        for m in messages:
            digest.update(json.dumps(m, sort_keys=True).encode())
            tokens += _count_tokens(_content_text(m.get("content")) if isinstance(m, dict)
                                    else "") + 1
            key = digest.hexdigest()
            keys.append((key, tokens))
            if key in self.prefix_cache:
                cached = tokens
                self.prefix_cache.move_to_end(key)
        self.stats.cached_tokens += cached
        for key, count in keys:
            self.prefix_cache[key] = count
        while len(self.prefix_cache) > 4096:
            self.prefix_cache.popitem(last=False)
        if self.prefill_delay > 0:
            await asyncio.sleep((tokens - cached) * self.prefill_delay)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        start = time.monotonic()
        body, err = await self._parse(request)
        if err is not None:
            return err
        assert body is not None
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            prompts = [prompt]
        elif isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
            prompts = list(prompt)
        elif isinstance(prompt, list) and prompt and all(isinstance(p, int) for p in prompt):
            prompts = [" ".join(str(p) for p in prompt)]
        else:
            return _error(400, "prompt must be a string, a list of strings or token ids.",
                          "BadRequestError", "prompt")
        model = body["model"]
        limit = body.get("max_tokens")
        if limit is None:
            limit = 16  # OpenAI's and vLLM's default for /v1/completions
        req_id = f"cmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        splits = [resume.completion_split(p, model) for p in prompts]
        plans = [(p, *self._reply_words(model, asked, limit, given,
                                        body.get("ignore_eos") is True))
                 for p, (asked, given) in zip(prompts, splits, strict=True)]
        prompt_total = sum(_count_tokens(p) for p in prompts)

        if not body.get("stream"):
            choices = []
            completion_total = 0
            for i, (p, words, reason) in enumerate(plans):
                lead = bool(splits[i][1])
                async with aclosing(self._generate(words, _count_tokens(p), lead)) as gen:
                    text = "".join([d async for d in gen])
                self._finished(reason, start)
                completion_total += len(words)
                choices.append({"index": i, "text": text, "logprobs": None,
                                "finish_reason": reason, "stop_reason": None,
                                "prompt_logprobs": None})
            return web.json_response({
                "id": req_id, "object": "text_completion", "created": created, "model": model,
                "choices": choices, "service_tier": None, "system_fingerprint": None,
                "usage": self._usage(prompt_total, completion_total),
                "kv_transfer_params": None,
            })

        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        resp = await self._sse_start(request)
        completion_total = 0
        for i, (p, words, reason) in enumerate(plans):
            n = 0
            given = splits[i][1]
            async with aclosing(self._generate(words, _count_tokens(p), bool(given))) as gen:
                async for delta in gen:
                    n += 1
                    last = n == len(words)
                    await self._sse(resp, {
                        "id": req_id, "object": "text_completion", "created": created,
                        "model": model,
                        "choices": [{"index": i, "text": delta, "logprobs": None,
                                     "finish_reason": reason if last else None,
                                     "stop_reason": None}],
                    })
                    if n == self.die_after and not given and not last:
                        return self._drop(request, resp)
            completion_total += n
            self._finished(reason, start)
        if include_usage:
            await self._sse(resp, {"id": req_id, "object": "text_completion",
                                   "created": created, "model": model, "choices": [],
                                   "usage": self._usage(prompt_total, completion_total)})
        await self._sse(resp, "[DONE]")
        await resp.write_eof()
        return resp


    async def embeddings(self, request: web.Request) -> web.StreamResponse:
        body, err = await self._parse(request)
        if err is not None:
            return err
        assert body is not None
        given = body.get("input")
        texts: list[str]
        if isinstance(given, str):
            texts = [given]
        elif isinstance(given, list) and given and all(isinstance(t, str) for t in given):
            texts = list(given)
        elif isinstance(given, list) and given and all(isinstance(t, int) for t in given):
            texts = [" ".join(str(t) for t in given)]
        elif (isinstance(given, list) and given
              and all(isinstance(t, list) and all(isinstance(x, int) for x in t)
                      for t in given)):
            texts = [" ".join(str(x) for x in t) for t in given]
        else:
            return _error(400, "input must be a string, a list of strings or token ids.",
                          "BadRequestError", "input")
        fmt = body.get("encoding_format") or "float"
        if fmt not in ("float", "base64"):
            return _error(400, f"encoding_format {fmt!r} is not supported.",
                          "BadRequestError", "encoding_format")
        model = body["model"]
        if body.get("dimensions") is not None:  # vLLM: only matryoshka models may
            return _error(400, f'Model "{model}" does not support matryoshka '
                          "representation, changing output dimensions will lead to poor "
                          "results.", "BadRequestError", "dimensions")
        data = []
        for i, text in enumerate(texts):
            vector = fake_embedding(model, text)
            embedding: Any = vector if fmt == "float" else base64.b64encode(
                struct.pack(f"<{len(vector)}f", *vector)).decode()
            data.append({"index": i, "object": "embedding", "embedding": embedding})
        tokens = sum(_count_tokens(t) for t in texts)
        self.stats.prompt_tokens += tokens
        return web.json_response({
            "id": f"embd-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
            "model": model, "data": data,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens,
                      "completion_tokens": 0, "prompt_tokens_details": None},
        })


# -------------------------------------------------------------------------- main


async def serve(args: argparse.Namespace) -> int:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)

    _log(f"non-default args: model={args.model!r} served_model_name={args.served_model_name} "
         f"tensor_parallel_size={args.tensor_parallel_size} "
         f"gpu_memory_utilization={args.gpu_memory_utilization} "
         f"max_model_len={args.max_model_len} dtype={args.dtype}")
    _log(f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')}")

    startup_delay = float(os.environ.get("FAKE_VLLM_STARTUP_DELAY", "0") or 0)
    if startup_delay > 0:
        _log(f"loading model weights (FAKE_VLLM_STARTUP_DELAY={startup_delay}s)")
        try:
            await asyncio.wait_for(stop.wait(), timeout=startup_delay)
            _log("received signal during startup; exiting")
            return 0
        except TimeoutError:
            pass

    hold = os.environ.get("FAKE_VLLM_HOLD_DIR", "")
    held = [Path(hold) / name for name in args.served_model_name] if hold else []
    if any(p.exists() for p in held):
        _log(f"held until {', '.join(map(str, held))} is removed (FAKE_VLLM_HOLD_DIR)")
        while any(p.exists() for p in held):
            try:
                await asyncio.wait_for(stop.wait(), timeout=0.05)
                _log("received signal while held; exiting")
                return 0
            except TimeoutError:
                pass
        _log("released")

    if args.tensor_parallel_size > 1:
        _log(f"started tensor-parallel workers: {_start_workers(args.tensor_parallel_size)}")
    fake = FakeVLLM(args)
    # handler_cancellation: a client leaving cancels its handler, as vLLM's
    # disconnect listener aborts the request (aiohttp's default runs on).
    runner = web.AppRunner(fake.make_app(), access_log=None, handle_signals=False,
                           handler_cancellation=True,
                           shutdown_timeout=0.2)
    await runner.setup()
    host = args.host  # None -> every interface, as vLLM/uvicorn do
    site = web.TCPSite(runner, host=host, port=args.port)
    try:
        await site.start()
    except OSError as e:
        _log(f"cannot bind {host or '0.0.0.0'}:{args.port}: {e}", "ERROR")
        await runner.cleanup()
        return 1
    rpc = _bind_rpc_socket()
    shown = host if host is not None else "0.0.0.0"
    _log(f"Starting vLLM API server 0 on http://{shown}:{args.port} "
         f"(fake vllm serving model {args.model} as {fake.names}, "
         f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')})")
    _log("Application startup complete.")
    await stop.wait()
    _log("Shutting down FastAPI HTTP server.")
    await runner.cleanup()
    if rpc is not None:
        rpc.close()
        os.unlink(rpc.getsockname())
    return 0


def _bind_rpc_socket() -> socket.socket | None:
    base = os.environ.get("VLLM_RPC_BASE_PATH")
    if not base:
        return None
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(os.path.join(base, str(uuid.uuid4())))
    sock.listen()
    return sock


def _import_aiohttp() -> None:
    # Imported only once the command line is known to be good: aiohttp takes a
    # noticeable share of a second to import, which `vllm --version` and argparse
    # errors should not pay.
    global web
    from aiohttp import web as aiohttp_web

    web = aiohttp_web


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    _import_aiohttp()
    return asyncio.run(serve(args))


if __name__ == "__main__":
    sys.exit(main())
