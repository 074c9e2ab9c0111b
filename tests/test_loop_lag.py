"""The event loop's lag and the collector's pauses (app/gateway/loop_lag.py):
ticks with injected times, the collector's real callbacks with an injected
timer, and a real loop held by a blocking call."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import time
from collections.abc import Iterator

import pytest

from app.gateway.loop_lag import LAG_BUCKETS, LoopLag
from tests.support.scrape import collected


def test_a_tick_is_counted_in_its_bucket_and_a_stall_is_logged_once_a_minute(
    caplog: pytest.LogCaptureFixture,
) -> None:
    lag = LoopLag(every=0.1, stall=1.0, warn_every=60.0)
    caplog.set_level(logging.WARNING, "app.gateway.loop_lag")
    assert lag.step(due=10.0, now=10.0004) == pytest.approx(0.0004)
    assert lag.step(due=11.0, now=10.9) == 0.0  # early (clock granularity): no lag
    assert lag.step(due=12.0, now=12.03) == pytest.approx(0.03)
    m = collected(lag)
    assert m[("llmgw_event_loop_lag_seconds_bucket", (("le", "0.001"),))] == 2
    assert m[("llmgw_event_loop_lag_seconds_bucket", (("le", "0.025"),))] == 2
    assert m[("llmgw_event_loop_lag_seconds_bucket", (("le", "0.05"),))] == 3
    assert m[("llmgw_event_loop_lag_seconds_count", ())] == 3
    assert m[("llmgw_event_loop_lag_seconds_sum", ())] == pytest.approx(0.0304)
    assert not caplog.records

    lag.worst_gc = 0.8
    lag.step(due=20.0, now=21.5)
    lag.step(due=30.0, now=32.0)  # 10.5 s after the last warning: not logged
    lag.step(due=81.0, now=82.0)  # a minute later: logged again
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 2, said
    assert "stalled 1.50 s" in said[0] and "0.800 s" in said[0]
    assert "stalled 1.00 s" in said[1] and "0.000 s" in said[1]  # reset at each warning
    assert collected(lag)[("llmgw_event_loop_lag_seconds_bucket", (("le", "+Inf"),))] == 6


@contextlib.contextmanager
def watching(lag: LoopLag) -> Iterator[None]:
    lag.watch_gc()
    try:
        yield
    finally:
        lag.unwatch_gc()


def test_each_collection_is_timed_by_generation_until_unwatched() -> None:
    ticks = iter(range(0, 1_000_000, 3))  # each read of the timer 0.3 s on: a pause of 0.3
    lag = LoopLag(timer=lambda: next(ticks) / 10)
    with watching(lag):
        lag.watch_gc()  # twice: hooked once
        assert gc.callbacks.count(lag._on_gc) == 1
        gc.collect(2)
        gc.collect(0)
    m = collected(lag)
    assert m[("llmgw_gc_pause_seconds_count", (("generation", "2"),))] >= 1
    assert m[("llmgw_gc_pause_seconds_count", (("generation", "0"),))] >= 1
    # 0.3 s each: above the 0.25 bound, within 0.5.
    assert m[("llmgw_gc_pause_seconds_bucket", (("generation", "2"), ("le", "0.25")))] == 0
    assert m[("llmgw_gc_pause_seconds_sum", (("generation", "2"),))] == pytest.approx(
        0.3 * m[("llmgw_gc_pause_seconds_count", (("generation", "2"),))])
    assert lag.worst_gc == pytest.approx(0.3)
    counted = sum(v for (name, _), v in m.items() if name == "llmgw_gc_pause_seconds_count")
    gc.collect(2)
    assert lag._on_gc not in gc.callbacks
    assert sum(v for (name, _), v in collected(lag).items()
               if name == "llmgw_gc_pause_seconds_count") == counted


async def test_a_blocking_call_on_the_loop_shows_as_lag() -> None:
    lag = LoopLag(every=0.01)
    ticking = asyncio.create_task(lag.run())
    await asyncio.sleep(0.1)
    time.sleep(0.3)  # noqa: ASYNC251 - what a blocking call in a handler does
    await asyncio.sleep(0.05)
    ticking.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await ticking
    m = collected(lag)
    await asyncio.sleep(0.05)  # cancelled: no tick after it
    assert collected(lag) == m
    over = m[("llmgw_event_loop_lag_seconds_count", ())] - m[
        ("llmgw_event_loop_lag_seconds_bucket", (("le", "0.25"),))]
    assert over == 1  # the one tick that waited behind it
    assert m[("llmgw_event_loop_lag_seconds_count", ())] >= 5
    assert LAG_BUCKETS[-1] >= 5.0
