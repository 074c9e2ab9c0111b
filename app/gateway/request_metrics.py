"""The per-request figures of `GET /metrics`, counted on the request path.

The proxy reports each request once, at its end (`RequestObserver`); nothing
is done per chunk. Counted in plain Python numbers, not prometheus_client's
Counter and Histogram: those take a lock and search their buckets one by
one on each call (1-2 µs a histogram observation on an idle core), which the
router pays per request. Everything here runs on the gateway's event loop,
the scrape included (app/gateway/main.py renders /metrics in the loop), so no lock
is needed and a scrape never sees half an observation.
docs/design/metrics.md lists the series.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterator
from typing import Any, ClassVar

from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from app.router.outcome import Outcome

# Whole-request durations: plain answers take tenths of seconds, long
# generations minutes.
DURATION_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
# vLLM's own buckets (vllm/v1/metrics/loggers.py) for its
# `vllm:time_to_first_token_seconds` and
# `vllm:request_time_per_output_token_seconds`, so that the gateway's
# figures and the engines' read side by side.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0)
# What the gateway itself adds before a client's first byte (outcome.py,
# `Outcome.gateway`): a fraction of a millisecond when all is well (the
# router's own benchmark: about 0.4 ms at c=1), so fine below 1 ms; the
# top buckets catch a loop held up.
GATEWAY_BUCKETS = (0.0001, 0.0002, 0.0003, 0.0004, 0.0005, 0.00075, 0.001, 0.0015, 0.0025,
                   0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)
# Status codes that are their own label value; any other is its class
# ("4xx"): an engine or provider may answer any code, and each must not
# mint a time series.
_CODES = frozenset({200, 400, 401, 403, 404, 405, 408, 413, 422, 429, 499, 500, 502, 503, 504})


def code_label(status: int) -> str:
    return str(status) if status in _CODES else f"{status // 100}xx"


class Histogram:
    """One label set's buckets (not cumulative; the last is +Inf) and sum."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        # The first bound >= value: Prometheus buckets are `le`.
        self.counts[bisect_left(self.bounds, value)] += 1
        self.sum += value

    def cumulative(self) -> list[tuple[str, float]]:
        out, total = [], 0
        for bound, n in zip((*map(floatToGoString, self.bounds), "+Inf"), self.counts,
                            strict=True):
            total += n
            out.append((bound, float(total)))
        return out


class _Model:
    """One model's figures. A snapshot (`RequestMetrics.snapshot`) carries
    each of `HISTOGRAMS` and `COUNTS` by name: a figure added to these is
    summed over workers with nothing else to change."""

    HISTOGRAMS: ClassVar[dict[str, tuple[float, ...]]] = {
        "seconds": DURATION_BUCKETS, "ttft": TTFT_BUCKETS, "tpot": TPOT_BUCKETS,
        "gateway": GATEWAY_BUCKETS}
    COUNTS: ClassVar[tuple[str, ...]] = ("prompt", "completion")
    __slots__ = ("completion", "gateway", "prompt", "seconds", "tpot", "ttft")
    seconds: Histogram
    gateway: Histogram
    ttft: Histogram
    tpot: Histogram
    prompt: int
    completion: int

    def __init__(self) -> None:
        for name, bounds in self.HISTOGRAMS.items():
            setattr(self, name, Histogram(bounds))
        for name in self.COUNTS:
            setattr(self, name, 0)

    def snapshot(self) -> dict[str, Any]:
        hists: dict[str, Any] = {name: [*getattr(self, name).counts, getattr(self, name).sum]
                                 for name in self.HISTOGRAMS}
        return hists | {name: getattr(self, name) for name in self.COUNTS}

    @classmethod
    def read(cls, fig: Any) -> dict[str, Any]:
        """A snapshot's figures checked (ValueError, TypeError, KeyError...)."""
        out: dict[str, Any] = {}
        for name, bounds in cls.HISTOGRAMS.items():
            hist = [float(x) for x in fig[name]]
            if len(hist) != len(bounds) + 2:
                raise ValueError(f"{name}: {len(hist)} values")
            out[name] = hist
        return out | {name: int(fig[name]) for name in cls.COUNTS}

    def add(self, figures: dict[str, Any]) -> None:
        for name in self.HISTOGRAMS:
            hist, got = getattr(self, name), figures[name]
            hist.counts = [a + int(b) for a, b in zip(hist.counts, got[:-1], strict=True)]
            hist.sum += got[-1]
        for name in self.COUNTS:
            setattr(self, name, getattr(self, name) + figures[name])


# The counters by label set, as a snapshot names them, with their labels'
# types (the last value of a row is the count).
_TALLIES = {"requests": (str, int), "continued": (str, str)}


class RequestMetrics(Collector):
    """The request figures the proxy reports (a `RequestObserver`, one of
    the gateway's: app/gateway/observers.py), and their collector.
    Under `--workers N` a scrape shows every worker's figures summed
    (`snapshot()` and `add()`, app/gateway/worker_metrics.py)."""

    def __init__(self) -> None:
        self._requests: dict[tuple[str, int], int] = {}
        self._models: dict[str, _Model] = {}
        self._continued: dict[tuple[str, str], int] = {}

    def _tallies(self) -> dict[str, dict[Any, int]]:
        return {"requests": self._requests, "continued": self._continued}

    def snapshot(self) -> dict[str, Any]:
        """Everything counted, as JSON-ready values (`add` reads them back)."""
        out: dict[str, Any] = {name: [[*labels, n] for labels, n in tally.items()]
                               for name, tally in self._tallies().items()}
        out["models"] = {m: per.snapshot() for m, per in self._models.items()}
        return out

    def add(self, snap: Any) -> bool:
        """Adds another worker's `snapshot()`; False (and nothing added) when
        it is not one: a file another process wrote is checked, not trusted."""
        try:
            rows = {name: [(tuple(t(v) for t, v in zip(types, row[:-1], strict=True)),
                            int(row[-1])) for row in snap[name]]
                    for name, types in _TALLIES.items()}
            models = [(str(m), _Model.read(fig)) for m, fig in snap["models"].items()]
        except (TypeError, ValueError, KeyError, AttributeError, IndexError):
            return False
        tallies = self._tallies()
        for name, got in rows.items():
            tally = tallies[name]
            for labels, n in got:
                tally[labels] = tally.get(labels, 0) + n
        for m, figures in models:
            per = self._models.get(m)
            if per is None:
                per = self._models[m] = _Model()
            per.add(figures)
        return True

    def observe(self, outcome: Outcome) -> None:
        """On the request path: a dict update, a bisect per histogram."""
        model, status, seconds = outcome.model, outcome.status, outcome.seconds
        first_byte, completion = outcome.first_byte, outcome.completion
        key = (model, status)
        self._requests[key] = self._requests.get(key, 0) + 1
        per = self._models.get(model)
        if per is None:
            per = self._models[model] = _Model()
        per.seconds.observe(seconds)
        per.prompt += outcome.prompt
        per.completion += completion
        if outcome.gateway is not None:
            per.gateway.observe(max(outcome.gateway, 0.0))
        if first_byte is not None:
            per.ttft.observe(first_byte)
            # The mean gap between its tokens, once per request, like
            # vLLM's request_time_per_output_token (not its per-token
            # inter_token_latency: that would be work per chunk).
            if completion > 1 and status == 200:
                per.tpot.observe((seconds - first_byte) / (completion - 1))

    def prompt_counted(self, model: str, tokens: int) -> None:
        per = self._models.get(model)
        if per is None:
            per = self._models[model] = _Model()
        per.prompt += tokens

    def continued(self, model: str, outcome: str) -> None:
        """A stream continued on another replica (app/router/continuation.py);
        `outcome` is one of four words."""
        key = (model, outcome)
        self._continued[key] = self._continued.get(key, 0) + 1

    def collect(self) -> Iterator[Metric]:
        requests = CounterMetricFamily(
            "llmgw_requests", "OpenAI API requests forwarded by this gateway, by status",
            labels=["model", "code"])
        by_code: dict[tuple[str, str], int] = {}
        for (model, status), n in self._requests.items():
            label = (model, code_label(status))
            by_code[label] = by_code.get(label, 0) + n
        for labels, n in sorted(by_code.items()):
            requests.add_metric(list(labels), n)
        seconds = HistogramMetricFamily(
            "llmgw_request_duration_seconds",
            "Time from a request's arrival to the end of its answer (streams included)",
            labels=["model"])
        ttft = HistogramMetricFamily(
            "llmgw_time_to_first_token_seconds", "Streams: time from a request's arrival "
            "to the engine's first body byte (a cold start's wait included)", labels=["model"])
        tpot = HistogramMetricFamily(
            "llmgw_request_time_per_output_token_seconds", "Streams answered 200: each "
            "request's mean time between output tokens, (duration - time to first token) / "
            "(completion tokens - 1), one observation per request", labels=["model"])
        gateway = HistogramMetricFamily(
            "llmgw_gateway_added_seconds", "What this gateway itself added before a "
            "request's first byte to its client: from its arrival to its answer's start, "
            "less the time engines took (and a wait for a starting replica or a spill)",
            labels=["model"])
        prompt = CounterMetricFamily("llmgw_prompt_tokens", "Prompt tokens of requests, as "
                                     "their engines reported them", labels=["model"])
        completion = CounterMetricFamily("llmgw_generation_tokens", "Completion tokens of "
                                         "requests, as their engines reported them",
                                         labels=["model"])
        for model, per in sorted(self._models.items()):
            for family, hist in ((seconds, per.seconds), (ttft, per.ttft), (tpot, per.tpot),
                                 (gateway, per.gateway)):
                family.add_metric([model], hist.cumulative(), hist.sum)
            prompt.add_metric([model], per.prompt)
            completion.add_metric([model], per.completion)
        continued = CounterMetricFamily(
            "llmgw_stream_continuations", "Streams whose engine died mid-way, continued on "
            "another replica, by outcome", labels=["model", "outcome"])
        for labels, n in sorted(self._continued.items()):
            continued.add_metric(list(labels), n)
        yield from (requests, seconds, ttft, tpot, gateway, prompt, completion, continued)
