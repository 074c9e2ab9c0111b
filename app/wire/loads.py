"""Engine load figures: as vLLM's /metrics shows them, and as an agent
serves them to gateways (`GET /node/v1/loads`, docs/design/routing.md, "Choosing a replica").
Both ends use this module; it imports nothing else of
llmgw, so neither end's internals become the protocol.

The answer an agent gives:

    {"node": "gpu-1", "loads": {REPLICA: {"running": 3, "waiting": 0,
                                          "kv": 0.25, "age_s": 0.4}}}

`age_s` is how long ago the agent read the figures from the engine: a
gateway dates them that much before it received them, so the staleness
bound covers the agent's own lag too.
"""

from __future__ import annotations

import json
import math
from typing import Any, NamedTuple, Protocol

LOADS_PATH = "/node/v1/loads"
# The most a gateway reads of an agent's answer: ~80 bytes a replica, so
# thousands of replicas per node fit; a larger answer is refused whole.
MAX_ANSWER = 256 * 1024
# The most an agent reads of one engine's /metrics page. vLLM's is tens of
# KiB (histograms per served name); more is not an engine we know.
MAX_METRICS = 4 * 1024 * 1024

_RUNNING = "vllm:num_requests_running"
_WAITING = "vllm:num_requests_waiting"
_KV = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")  # the second before 0.9


class Counts(NamedTuple):
    """One engine's own figures. A named tuple: made for every replica of
    every node a gateway asks, and a frozen dataclass cost twice as much to
    make (timeit: 1.4 us against 0.7)."""

    running: float
    waiting: float
    kv: float  # 0..1


class Chunks(Protocol):
    """A body read in chunks (aiohttp's `StreamReader`)."""

    async def readany(self) -> bytes: ...


async def read_capped(body: Chunks, cap: int) -> bytes:
    """The body up to `cap` + 1 bytes: longer than `cap` means too long.
    (One `read(n)` returns what one chunk holds, not n bytes.)"""
    out = bytearray()
    while len(out) <= cap and (chunk := await body.readany()):
        out += chunk
    return bytes(out[: cap + 1])


def parse_vllm_metrics(text: str) -> Counts | None:
    """The counts in a Prometheus text page; None without vLLM's gauges.
    Several label sets of one gauge (one per engine of a data-parallel
    server) are summed; the KV cache use is their largest."""
    sums: dict[str, float] = {}
    for line in text.splitlines():
        if not line.startswith("vllm:"):
            continue
        # `name{labels} value [timestamp]` or `name value [timestamp]`
        head, brace, tail = line.rpartition("}")
        name, fields = (head.split("{", 1)[0], tail.split()) if brace else (
            line.split()[0], line.split()[1:])
        try:
            value = float(fields[0])
        except (ValueError, IndexError):
            continue
        if name in _KV:
            sums["kv"] = max(sums.get("kv", 0.0), value)
        elif name in (_RUNNING, _WAITING):
            sums[name] = sums.get(name, 0.0) + value
    if _RUNNING not in sums or _WAITING not in sums:
        return None
    return Counts(sums[_RUNNING], sums[_WAITING], sums.get("kv", 0.0))


def loads_answer(node: str, figures: dict[str, tuple[Counts, float]]) -> dict[str, Any]:
    """The agent's answer: replica -> (counts, age in seconds)."""
    return {"node": node, "loads": {
        rid: {"running": c.running, "waiting": c.waiting, "kv": c.kv,
              "age_s": round(max(0.0, age), 3)}
        for rid, (c, age) in sorted(figures.items())}}


class BadAnswer(ValueError):
    """An agent's loads answer that is not the shape above."""


def read_loads_answer(body: bytes) -> dict[str, tuple[Counts, float]]:
    """Replica -> (counts, age) from an agent's answer, or BadAnswer: too
    large, not JSON, or any figure not a finite number in its range. One
    bad entry refuses the whole answer: an agent that sends it is broken."""
    if len(body) > MAX_ANSWER:
        raise BadAnswer(f"more than {MAX_ANSWER} bytes")
    try:
        obj = json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise BadAnswer(f"not JSON: {exc}") from None
    loads = obj.get("loads") if isinstance(obj, dict) else None
    if not isinstance(loads, dict):
        raise BadAnswer('no "loads" object')
    out: dict[str, tuple[Counts, float]] = {}
    # Asked of thousands of nodes a second (a gateway's poll): each check
    # is inline. A comparison with NaN is false, so NaN fails the ranges.
    for rid, fig in loads.items():
        if type(fig) is not dict:
            raise BadAnswer(f"{rid[:64]!r}: not an object")
        f: Any = fig  # each figure's type is checked below, as mypy cannot follow
        r, w, kv, age = f.get("running"), f.get("waiting"), f.get("kv"), f.get("age_s")
        if not (type(r) in _NUMBER and type(w) in _NUMBER and type(kv) in _NUMBER
                and type(age) in _NUMBER):
            raise BadAnswer(f"{rid[:64]!r}: running, waiting, kv, age_s must be numbers >= 0")
        if not (0 <= r < _INF and 0 <= w < _INF and 0 <= kv < _INF and 0 <= age < _INF):
            raise BadAnswer(f"{rid[:64]!r}: running, waiting, kv, age_s must be numbers >= 0")
        if kv > 1.0:
            raise BadAnswer(f"{rid[:64]!r}: kv {kv} is over 1")
        out[rid] = Counts(float(r), float(w), float(kv)), float(age)
    return out


_NUMBER = (int, float)  # exactly: not a bool, not a string
_INF = math.inf
