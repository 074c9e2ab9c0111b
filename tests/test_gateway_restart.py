"""A gateway restarted while etcd is unreachable knows nothing of the fleet:
it must say so (503), never hand its agents an empty assignment list, which
they would obey by stopping every engine (docs/architecture.md, invariant 9)."""

from __future__ import annotations

import signal
import uuid
from pathlib import Path

from tests.support.etcd import EtcdServer
from tests.support.procs import (
    Cluster,
    engine_pid,
    replicas,
    routes,
    serve_one,
    wait_for,
)


def test_a_gateway_restarted_without_etcd_stops_and_restarts_no_engine(
    own_etcd: EtcdServer, tmp_path: Path
) -> None:
    cluster = Cluster(tmp_path, own_etcd.endpoint, f"/llmgw-{uuid.uuid4().hex}/")
    try:
        gw = cluster.gateway("gw-a")
        # Debug: an agent logs only the first failure of a streak as a
        # warning, and this test counts every 503 it is told.
        agent = cluster.agent("node-1", [gw], "--gpus", "1",
                              env_extra={"LLMGW_LOG_LEVEL": "debug"})
        served = serve_one(gw)
        key, rep, pid = served.key, served.replica, served.pid

        own_etcd.stop()
        gw.signal(signal.SIGTERM)
        gw.wait(20)
        log_before = agent.output()
        gw.start()  # the same port, the same settings; etcd still down
        wait_for(lambda: agent.output()[len(log_before):].count("answered 503") >= 3, 30,
                 "the agent to be told 503 by the restarted gateway")
        after = agent.output()[len(log_before):]
        assert engine_pid(rep["url"]) == pid
        assert "stopped engine" not in after and "started vllm engine" not in after, after

        own_etcd.start()
        wait_for(lambda: [(r["id"], r["phase"]) for r in replicas(gw)] == [(rep["id"], "ready")],
                 30, "the same replica ready again")
        wait_for(lambda: routes(gw, key, "m"), 15, "routing again")
        assert engine_pid(rep["url"]) == pid  # the very same process throughout
        after = agent.output()[len(log_before):]
        assert "stopped engine" not in after and "started vllm engine" not in after, after
    finally:
        cluster.close()
