"""GET /metrics: requests counted as the proxy reports them, the fleet read
from the mirror at scrape time."""

from __future__ import annotations

import httpx

from app import compiled
from tests.support.procs import FAKE_BIN, Cluster, make_key, put_model, routes, wait_for
from tests.support.scrape import Samples, samples, scrape_text


def scrape(url: str) -> Samples:
    return samples(scrape_text(url))


def test_metrics_count_requests_and_show_the_fleet(solo: Cluster) -> None:
    gw = solo.gateway("metrics", local_node="gpu-1", local_gpus="2",
                      vllm_bin=str(FAKE_BIN / "vllm"))
    key = make_key(gw)
    put_model(gw, "m", {"model": "acme/m", "aliases": ["a"], "gpus": 1})
    wait_for(lambda: routes(gw, key, "m"), 30, "routing")
    before = scrape(gw.url).get(("llmgw_requests_total", (("code", "200"), ("model", "m"))), 0)

    auth = {"Authorization": f"Bearer {key}"}
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    for _ in range(3):
        assert httpx.post(gw.url + "/v1/chat/completions", headers=auth,
                          json={"model": "a", **chat}).status_code == 200
    assert httpx.post(gw.url + "/v1/chat/completions", headers=auth,
                      json={"model": "no-such-model", **chat}).status_code == 404

    m = scrape(gw.url)
    assert m[("llmgw_requests_total", (("code", "200"), ("model", "m")))] == before + 3
    # An unknown model is not a label value: clients cannot mint time series.
    assert m[("llmgw_requests_total", (("code", "404"), ("model", "(unknown)")))] == 1
    assert not any("no-such-model" in str(k) for k in m)
    assert m[("llmgw_request_duration_seconds_count", (("model", "m"),))] >= before + 3
    assert m[("llmgw_leader", ())] == 1 and m[("llmgw_mirror_ready", ())] == 1
    # The gateway runs this tree's router as this process does (app/compiled.py).
    assert m[("llmgw_router_compiled", ())] == (
        1 if compiled.state().startswith("compiled by mypyc") else 0)
    assert m[("llmgw_replicas", (("model", "m"), ("phase", "ready")))] == 1
    assert m[("llmgw_replicas_wanted", (("model", "m"),))] == 1
    assert m[("llmgw_node_gpus", (("node", "gpu-1"), ("state", "used")))] == 1
    assert m[("llmgw_node_gpus", (("node", "gpu-1"), ("state", "free")))] == 1
    (inflight,) = [v for (name, _), v in m.items() if name == "llmgw_replica_inflight"]
    assert inflight == 0
    # The loop's timer has ticked (every 0.1 s) and the collector has run:
    # the process's own health, beside the fleet's (app/gateway/loop_lag.py).
    # (a gateway may route within its first second: its ticks are waited for)
    wait_for(lambda: scrape(gw.url)[("llmgw_event_loop_lag_seconds_count", ())] > 10, 10,
             "ten ticks of the loop's timer")
    assert sum(v for (name, labels), v in m.items()
               if name == "llmgw_gc_pause_seconds_count") > 0
    # Start-up's objects frozen out of collections (app/gateway/gc_keeper.py).
    assert m[("llmgw_gc_frozen_objects", ())] > 10_000
    assert ("llmgw_gc_reclaims_total", ()) in m

    # The engine's own counts, as polled from its /metrics (within a second or two).
    def engine_gauges() -> dict[str, float] | None:
        got = {name: v for (name, labels), v in scrape(gw.url).items()
               if name.startswith("llmgw_engine_") and ("model", "m") in labels}
        return got if len(got) == 3 else None

    gauges = wait_for(engine_gauges, 10, "the engine's load in /metrics")
    assert gauges["llmgw_engine_running"] == 0 and gauges["llmgw_engine_waiting"] == 0
    assert 0 <= gauges["llmgw_engine_kv_cache_usage"] <= 1
