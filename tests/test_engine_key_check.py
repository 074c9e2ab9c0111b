"""The agent's probes check the engine key (docs/design/agent.md): an
engine that refuses the key the agent holds is not ready, says why, and a
ready one whose key changed to one it refuses (a secret rotation ended
before its replica was replaced) leaves routing at once. In-process: the
agent's steps against the vLLM stand-in, as tests/test_agent_steps.py."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from app.agent.agent import Agent
from tests.test_agent_steps import (
    Clock,
    MemoryGateway,
    answer,
    chat,
    config,
    engines_env,  # noqa: F401 (a fixture, used by `agent` below)
    observe_until,
    phase,
    replica,
)


@pytest.fixture
async def agent(engines_env: str, tmp_path: Path  # noqa: F811
                ) -> AsyncIterator[tuple[Agent, MemoryGateway]]:
    gw = MemoryGateway()
    a = Agent(config(tmp_path), clock=Clock(), client=gw)
    await a.start()
    try:
        yield a, gw
    finally:
        await a.shutdown(stop_engines=True)


def rekeyed(rep: dict[str, Any], key: str) -> dict[str, Any]:
    """An answer giving replica `rep` another key (the gateways' fingerprint
    changes with the secret a key derives from: app/api/agent.py)."""
    out = answer(2, rep | {"key": key})
    out["fingerprint"] = "rekeyed"
    return out


async def test_an_engine_refusing_its_key_is_not_ready_and_says_why(
    agent: tuple[Agent, MemoryGateway],
) -> None:
    a, gw = agent
    rep = replica("m-1", [0])
    gw.answer = answer(1, rep)
    await a.poll(0)
    await a.converge()  # started with the key of the first answer
    gw.answer = rekeyed(rep, "llmgw-" + "0" * 40)
    assert await a.poll(0) == "changed"
    await a.converge()  # the same engine: a key is no reason to restart it
    await observe_until(a, lambda: "refuses its key" in a.running["m-1"].detail,
                        "the refusal reported", timeout=5)
    assert phase(a, "m-1") == "starting"
    await a.report()
    assert gw.reports[-1][0]["detail"] == a.running["m-1"].detail
    assert gw.reports[-1][0]["phase"] == "starting"


async def test_a_ready_engine_given_a_key_it_refuses_is_demoted_at_once(
    agent: tuple[Agent, MemoryGateway],
) -> None:
    a, gw = agent
    rep = replica("m-1", [0])
    gw.answer = answer(1, rep)
    await a.poll(0)
    await a.converge()
    await observe_until(a, lambda: phase(a, "m-1") == "ready", "ready")
    url = a.running["m-1"].proc.url
    assert await chat(url, rep["key"]) == 200

    gw.answer = rekeyed(rep, "llmgw-" + "1" * 40)
    await a.poll(0)
    await a.converge()
    await a.observe()  # one probe, not LIVENESS_FAILURES: a 401 will not pass
    assert phase(a, "m-1") == "starting"
    assert "refuses its key (HTTP 401)" in a.running["m-1"].detail
    # Given its own key back, it is ready again: the same engine.
    pid = a.running["m-1"].proc.pid
    gw.answer = answer(3, rep)
    await a.poll(0)
    await a.converge()
    await observe_until(a, lambda: phase(a, "m-1") == "ready", "ready again")
    assert a.running["m-1"].proc.pid == pid and a.running["m-1"].detail == ""
