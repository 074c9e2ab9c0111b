"""An engine's health: the probes the agent sends it, and what a death means.

Readiness and liveness are different questions (docs/design/agent.md).
Until an engine is first ready, the agent asks `/v1/models` with
the engine key and wants the model listed: the engine loaded its weights and
accepts our key. After that it only asks whether the engine is alive, with a
request that never queues behind a generation: llama-cpp-python's
`/v1/models` takes the model lock that a running generation holds, so a
readiness probe during a long generation times out (and, with the server's
default `interrupt_requests`, cut the generation short). One failed liveness
probe is a busy moment, not a dead engine; only `LIVENESS_FAILURES` in a row
take the replica out of routing. The liveness paths take no key, so when the
key the agent holds for a ready engine changes (a secret rotation's end),
the readiness probe checks it again: an engine refusing it (401) leaves
routing at once, not after three probes, since no retry will change it.
"""

from __future__ import annotations

import signal
from collections.abc import Sequence
from typing import Literal

import aiohttp

from app.wire.names import Engine

# Consecutive failed liveness probes (one per observe interval, 1 s) before a
# ready replica is demoted to `starting` and leaves the routers. Higher: a
# hung engine keeps receiving requests for longer; lower: a slow moment (a
# long prefill hogging a CPU node) flaps the replica out of routing.
LIVENESS_FAILURES = 3

# Paths that answer without touching the model. vLLM's /health checks its
# engine core without queueing; llama-cpp-python has no health route, and
# FastAPI's /docs is served by the event loop without the model lock
# (measured: 20-40 ms while a generation runs). Asked every second, so its
# server is started without an access-log line for it (llamacpp_server.py).
LIVENESS_PATHS: dict[Engine, str] = {"vllm": "/health", "llamacpp": "/docs"}

# An engine that dies this many times within this window is left failed
# instead of restarted again. A build for another CPU dies by SIGILL on its
# first real request after passing the health check, weights that do not fit
# die during load: restarting those forever reloads the model again and again
# and flaps the replica in and out of routing. One death (an OOM kill by a
# neighbour, a one-off bug) is still restarted, with a backoff. Ten minutes
# covers three slow vLLM loads; the replica is restarted again only when its
# assignment changes (or the agent restarts).
CRASH_LOOP_DEATHS = 3
CRASH_LOOP_WINDOW = 600.0


def start_overdue(started: float | None, now: float, timeout: float) -> bool:
    """Whether an engine still not ready `timeout` s after it was started (or
    adopted) is overdue: a vLLM hung in its load (an NCCL hang, a stuck
    download, a wedged GPU) would otherwise stay `starting` holding its GPUs
    for ever. None: ready once since its start, so no start is running."""
    return started is not None and now - started >= timeout


def backoff(deaths: int) -> float:
    """Seconds before restarting an engine that died `deaths` times lately."""
    return min(60.0, 2.0 * 2.0**deaths)


def death_detail(reason: str, deaths: int, delay: float | None, tail: str) -> str:
    """A dead replica's status detail: why, what happens next (a restart in
    `delay` s, or None: left failed), and the engine's last log lines."""
    minutes = CRASH_LOOP_WINDOW / 60
    if delay is None:
        return (f"{reason}; {deaths} deaths within {minutes:.0f} min: not restarted "
                f"until its assignment changes; last log lines:\n{tail}")
    return (f"{reason} ({deaths} of {CRASH_LOOP_DEATHS} deaths allowed within "
            f"{minutes:.0f} min); restarting in {delay:.0f} s; last log lines:\n{tail}")


def describe_exit(code: int) -> str:
    """asyncio gives a process killed by a signal a negative return code."""
    if code >= 0:
        return f"exited with code {code}"
    try:
        return f"killed by {signal.Signals(-code).name}"
    except ValueError:
        return f"killed by signal {-code}"


def recent(deaths: Sequence[float], now: float) -> list[float]:
    """The deaths that still count towards a crash loop."""
    return [t for t in deaths if now - t < CRASH_LOOP_WINDOW]


def crash_looping(deaths: Sequence[float]) -> bool:
    return len(deaths) >= CRASH_LOOP_DEATHS


# Readiness's answers: the model is listed with our key; the engine refused
# the key (401: it was started with another, e.g. of a secret since
# rotated); or no (still loading, no answer, not listed).
Readiness = Literal["ready", "key refused", "no"]

# An engine's status detail while it refuses its key: the replica is out of
# routing (a router would get the same 401, a 502 for its client).
KEY_REFUSED = ("the engine refuses its key (HTTP 401): it was started with a key the "
               "gateways no longer derive (LLMGW_SECRET rotated?); out of routing")


async def serves_model(
    session: aiohttp.ClientSession, url: str, key: str, model: str, timeout: float
) -> Readiness:
    """Readiness: the engine lists `model` and accepts `key`. Also the key
    check of a ready engine whose key changed: both engines check the key
    before anything else (llama-cpp-python before taking its model lock), so
    a refusal is answered at once even during a generation, while an
    accepted key may wait for the lock and time out ("no": not a verdict)."""
    try:
        async with session.get(
            url + "/v1/models", headers={"Authorization": f"Bearer {key}"},
            timeout=aiohttp.ClientTimeout(total=timeout),
        ) as resp:
            if resp.status == 401:
                return "key refused"
            if resp.status != 200:
                return "no"
            body = await resp.json()
    except (aiohttp.ClientError, TimeoutError, ValueError):
        return "no"
    data = body.get("data") if isinstance(body, dict) else None
    listed = isinstance(data, list) and any(
        isinstance(m, dict) and m.get("id") == model for m in data)
    return "ready" if listed else "no"


async def answers(
    session: aiohttp.ClientSession, url: str, engine: Engine, timeout: float
) -> bool:
    """Liveness: the engine's server answers a request that takes no lock."""
    try:
        async with session.get(
            url + LIVENESS_PATHS[engine], timeout=aiohttp.ClientTimeout(total=timeout),
        ) as resp:
            await resp.read()
            return resp.status == 200
    except (aiohttp.ClientError, TimeoutError):
        return False
