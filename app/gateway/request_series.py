"""The last minutes of each model's traffic, for the cluster page's charts
(docs/design/cluster-page.md, "Charts").

A fixed ring per model: one sample per `interval` seconds of wall-clock time
(aligned on multiples of it, so that gateways' samples line up and can be
summed), `samples` of them. Each sample holds what the proxy already reports
at a request's end (`RequestObserver`): requests by status class, prompt and
completion tokens, and the sum and count of times to first token, so that a
fleet's samples add up exactly (a median would not: medians do not sum).

Bounded: the models are those the proxy reports (catalog names and
"(unknown)", as the metrics' label sets), at most `max_models` of them; a
model with no sample in the window is dropped when the series is read, and
a new model past the cap replaces the one least recently seen. On the
request path: an integer division, a compare and a few additions; runs on
the event loop like app/gateway/request_metrics.py, so no lock.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field

from app.router.outcome import Outcome

INTERVAL = 10.0  # seconds a sample covers
SAMPLES = 90  # 15 minutes
MAX_MODELS = 256
# The figures of a sample, in this order in each row and in the answer.
FIELDS = ("requests_2xx", "requests_4xx", "requests_5xx", "prompt_tokens",
          "completion_tokens", "ttft_sum", "ttft_count")
_OK, _CLIENT, _SERVER, _PROMPT, _COMPLETION, _TTFT_SUM, _TTFT_N = range(len(FIELDS))


class _Ring:
    __slots__ = ("current", "last", "rows", "stamps")

    def __init__(self, samples: int) -> None:
        self.rows = [[0.0] * len(FIELDS) for _ in range(samples)]
        # The interval number each row holds (-1: none yet).
        self.stamps = [-1] * samples
        self.last = -1  # the latest interval counted, and its row
        self.current = self.rows[0]

    def row(self, tick: int) -> list[float]:
        i = tick % len(self.stamps)
        row = self.rows[i]
        if self.stamps[i] != tick:  # a row from an earlier round: start it again
            self.stamps[i] = tick
            for j in range(len(row)):
                row[j] = 0.0
        if tick >= self.last:
            self.last, self.current = tick, row
        return row


class RequestSeries:
    """A `RequestObserver` (one of the gateway's, app/gateway/observers.py):
    counts each request in its model's ring."""

    def __init__(self, *, clock: Callable[[], float] = time.time, interval: float = INTERVAL,
                 samples: int = SAMPLES, max_models: int = MAX_MODELS) -> None:
        self._clock = clock
        self.interval = interval
        self.samples = samples
        self._max = max_models
        self._rings: dict[str, _Ring] = {}

    def _row(self, model: str) -> list[float]:
        tick = int(self._clock() // self.interval)
        ring = self._rings.get(model)
        if ring is not None and ring.last == tick:  # the common case: no call
            return ring.current
        if ring is None:
            if len(self._rings) >= self._max:
                del self._rings[min(self._rings, key=lambda m: self._rings[m].last)]
            ring = self._rings[model] = _Ring(self.samples)
        return ring.row(tick)

    def observe(self, outcome: Outcome) -> None:
        row = self._row(outcome.model)
        status = outcome.status
        row[_OK if status < 400 else _CLIENT if status < 500 else _SERVER] += 1
        row[_PROMPT] += outcome.prompt
        row[_COMPLETION] += outcome.completion
        if outcome.first_byte is not None:
            row[_TTFT_SUM] += outcome.first_byte
            row[_TTFT_N] += 1

    def prompt_counted(self, model: str, tokens: int) -> None:
        self._row(model)[_PROMPT] += tokens

    def continued(self, model: str, outcome: str) -> None:
        """Not charted (the metrics count it: app/router/continuation.py)."""

    def snapshot(self) -> Series:
        """The window ending with the current interval, oldest sample first."""
        now = int(self._clock() // self.interval)
        first = now - self.samples + 1
        models: dict[str, dict[str, list[float]]] = {}
        for name, ring in list(self._rings.items()):
            if ring.last < first:  # nothing in the window: forget it
                del self._rings[name]
                continue
            rows = [[0.0] * len(FIELDS)] * self.samples
            for row, tick in zip(ring.rows, ring.stamps, strict=True):
                if first <= tick <= now:
                    rows[tick - first] = row
            models[name] = dict(zip(FIELDS, map(list, zip(*rows, strict=True)), strict=True))
        # Built from our own numbers: not validated (the type check is for peers').
        return Series.model_construct(interval=self.interval, start=first * self.interval,
                                      samples=self.samples, models=models)


_MAX_SAMPLES = 10_000
_Column = Annotated[list[Annotated[float, Field(allow_inf_nan=False)]],
                    Field(max_length=_MAX_SAMPLES)]


class Series(BaseModel):
    """One gateway's or a fleet's window: `models[name][field][i]` is the
    figure of the interval starting at `start + i * interval`. Also the type
    check of a peer's answer, hence the bounds."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)
    interval: float = Field(gt=0, le=3600)
    start: float
    samples: int = Field(gt=0, le=_MAX_SAMPLES)
    models: dict[Annotated[str, Field(max_length=256)], dict[str, _Column]] = Field(
        max_length=4 * MAX_MODELS)


def merge(mine: Series, others: Iterable[Series]) -> dict[str, Any]:
    """`mine` with `others` added sample by sample, aligned on their start
    times: a sample of another's window outside mine (a clock a little off,
    a different window) is left out. Fields and models not ours are kept
    only if known fields (FIELDS); a row of another length is cut."""
    models = {m: {f: list(v) for f, v in cols.items()} for m, cols in mine.models.items()}
    for other in others:
        if other.interval != mine.interval:
            continue
        shift = round((other.start - mine.start) / mine.interval)
        for name, cols in other.models.items():
            into = models.get(name)
            if into is None:
                into = models[name] = {f: [0.0] * mine.samples for f in FIELDS}
            for f in FIELDS:
                for i, v in enumerate(cols.get(f, ())[:other.samples]):
                    j = i + shift
                    if 0 <= j < mine.samples:
                        into[f][j] += v
    return {"interval": mine.interval, "start": mine.start, "samples": mine.samples,
            "models": models}
