"""`llmgw serve` alone (embedded store, in-process agent) restarts without
reloading a model: its engines outlive it and the next run adopts them.
LLMGW_STOP_ENGINES_ON_EXIT=true stops them with the gateway instead."""

from __future__ import annotations

import contextlib
import os
import signal
import uuid

import openai

from tests.support.procs import (
    FAKE_BIN,
    Cluster,
    GatewayProc,
    engine_pid,
    engine_pids,
    replicas,
    routes,
    serve_one,
    wait_for,
)

ALL_IN_ONE = {"local_gpus": "1", "vllm_bin": str(FAKE_BIN / "vllm")}


def stop(gw: GatewayProc) -> None:
    gw.signal(signal.SIGTERM)
    # uvicorn re-raises the signal once its graceful shutdown is done.
    assert gw.wait(20) in (0, -signal.SIGTERM), gw.output()[-2000:]


def test_a_restarted_serve_adopts_its_engine_and_reloads_nothing(solo: Cluster) -> None:
    # A name of this run's own: engines are found by it among every process
    # on the machine, other test runs' included.
    name = f"restart-{uuid.uuid4().hex[:8]}"
    gw = solo.gateway("aio", **ALL_IN_ONE)
    served = serve_one(gw, name)
    key, rep, pid = served.key, served.replica, served.pid
    adopted = "adopted engine of " + rep["id"]

    def restart(**extra: str) -> GatewayProc:
        """Starts `llmgw serve` again on the same data dir (and log file),
        and waits until its agent adopted the engine and it routes."""
        before = gw.output().count(adopted)
        new = solo.gateway("aio", **ALL_IN_ONE, **extra)
        wait_for(lambda: new.output().count(adopted) > before, 20, "adoption")
        wait_for(lambda: routes(new, key, name), 20, "routing after the restart")
        assert [(r["id"], r["phase"], r["url"]) for r in replicas(new)] == [
            (rep["id"], "ready", rep["url"])]
        assert engine_pids("--served-model-name", name) == [pid]  # the same process, alone
        return new

    try:
        stop(gw)
        assert engine_pid(rep["url"]) == pid  # the engine outlived `llmgw serve`

        gw = restart()
        client = openai.OpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0)
        chat = client.chat.completions.create(
            model=name, messages=[{"role": "user", "content": "after the restart"}])
        assert "after the restart" in (chat.choices[0].message.content or "")

        # Asked to, `llmgw serve` stops its engines (this one adopted) with it.
        stop(gw)
        gw = restart(stop_engines_on_exit="true")
        stop(gw)
        assert engine_pids("--served-model-name", name) == []
    finally:
        for left in engine_pids("--served-model-name", name):
            with contextlib.suppress(ProcessLookupError):
                os.kill(left, signal.SIGKILL)
