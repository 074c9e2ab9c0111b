"""A gateway's stop never hangs on one of its tasks (app/gateway/stopping.py):
one that ignores its cancel is named, with where it waits, and left. The
chaos suite saw a stop hang past 120 s once in 100 schedules, with nothing
logged to say where; before, stop() gathered its tasks with no bound."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import pytest

from app.gateway.stopping import ended


async def test_a_task_that_ignores_its_cancel_is_named_and_left(
    caplog: pytest.LogCaptureFixture,
) -> None:
    release = asyncio.Event()

    async def stubborn() -> None:
        while not release.is_set():
            with contextlib.suppress(asyncio.CancelledError):
                await release.wait()

    async def polite() -> None:
        await asyncio.sleep(3600)

    async def failing() -> None:
        raise RuntimeError("ended badly")

    tasks = [asyncio.create_task(stubborn(), name="stubborn"),
             asyncio.create_task(polite(), name="polite"),
             asyncio.create_task(failing(), name="failing")]
    await asyncio.sleep(0)
    for t in tasks:
        t.cancel()
    began = time.monotonic()
    with caplog.at_level(logging.ERROR):
        await ended(tasks, 0.3, "being cancelled")
    assert time.monotonic() - began < 2
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1, said
    assert "task stubborn had not ended 0.3 s after being cancelled" in said[0]
    assert "stubborn (test_stopping.py:" in said[0]
    assert tasks[1].cancelled()
    release.set()
    await tasks[0]
