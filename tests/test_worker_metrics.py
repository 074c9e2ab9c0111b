"""`/metrics` under `--workers N`, in-process (app/gateway/worker_metrics.py):
each worker's request figures as a snapshot file, summed on a scrape; what
is not a snapshot is left out, not trusted. The processes: tests/test_workers.py."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from app.gateway.request_metrics import RequestMetrics
from app.gateway.worker_metrics import FOLDER, MAX_BYTES, WorkerMetrics, clear
from app.router.outcome import Outcome
from tests.support.scrape import Samples, collected


def figures(m: RequestMetrics) -> Samples:
    return collected(m)


def test_every_workers_figures_are_summed_and_a_bad_file_left_out(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    a, b = RequestMetrics(), RequestMetrics()
    a.observe(Outcome("m", 200, 0.2, first_byte=0.01, prompt=3, completion=5))
    a.observe(Outcome("m", 429, 0.001))
    b.observe(Outcome("m", 200, 7.0, first_byte=0.3, prompt=4, completion=2))
    b.continued("m", "completed")
    wa, wb = (WorkerMetrics(m, tmp_path, i, 3) for i, m in enumerate((a, b)))
    wb.write(b.snapshot())
    got = figures(wa.totals(a.snapshot()))  # worker 2 has written nothing yet
    assert got[("llmgw_requests_total", (("code", "200"), ("model", "m")))] == 2
    assert got[("llmgw_requests_total", (("code", "429"), ("model", "m")))] == 1
    assert got[("llmgw_prompt_tokens_total", (("model", "m"),))] == 7
    assert got[("llmgw_generation_tokens_total", (("model", "m"),))] == 7
    assert got[("llmgw_request_duration_seconds_count", (("model", "m"),))] == 3
    assert got[("llmgw_request_duration_seconds_bucket", (("le", "0.25"), ("model", "m")))] == 2
    assert got[("llmgw_request_duration_seconds_sum", (("model", "m"),))] == pytest.approx(7.201)
    assert got[("llmgw_stream_continuations_total",
                (("model", "m"), ("outcome", "completed")))] == 1
    # A file that is not a snapshot: left out (said once), the others summed.
    folder = tmp_path / FOLDER
    for bad in (b"{not json", json.dumps({"requests": [["m", "x", 1]], "models": {},
                                          "continued": []}).encode(),
                json.dumps({"requests": [], "continued": [], "models": {
                    "m": {"seconds": [1], "ttft": [], "tpot": [], "prompt": 0,
                          "completion": 0}}}).encode(),
                b"[" + b" " * MAX_BYTES + b"]"):
        (folder / "1.json").write_bytes(bad)
        with caplog.at_level(logging.WARNING):
            got = figures(wa.totals(a.snapshot()))
        assert got[("llmgw_requests_total", (("code", "200"), ("model", "m")))] == 1, bad[:40]
    assert sum("worker 1's metrics file" in r.getMessage() for r in caplog.records) == 1
    # The supervisor starts a run with no earlier figures.
    clear(tmp_path)
    assert list(folder.glob("*.json")) == []
