"""The operator's seat: free GPUs and who holds them (/admin/nodes, `llmgw
ctl nodes`, /metrics), and the token-level figures vLLM's operators expect,
through real gateway, agent and vLLM stand-in processes and the official
`openai` client; the held-request counts in-process."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import openai
import pytest

from app.router.outcome import Outcome
from app.router.timeouts import Timeouts
from tests.support.procs import (
    Cluster,
    make_key,
    put_model,
    routes,
    wait_for,
    wait_ready,
)
from tests.support.proxy_rig import CHAT, CLIENT_KEY, MESSAGES, Rig, started
from tests.support.scrape import Samples, samples, scrape_text, served_names
from tests.test_ctl import admin_get, ok_on

NODE = "node-1"


def test_nodes_show_free_gpus_and_the_replica_holding_each(cluster: Cluster,
                                                           tmp_path: Path) -> None:
    gw = cluster.gateway("seat")
    cluster.agent(NODE, [gw], "--gpus", "3", "--cache-dir", str(tmp_path / "hub"))
    put_model(gw, "m", {"model": "acme/m", "gpus": 2})
    rep = wait_ready(gw)

    (node,) = admin_get(gw, "/admin/nodes")
    assert (node["gpus_free"], node["gpus_used"]) == (1, 2)
    held = {g["index"]: g["replica"] for g in node["gpus"]}
    assert held == {i: (rep["id"] if i in rep["gpus"] else None) for i in range(3)}

    # `llmgw ctl nodes`: FREE, as free of total.
    row = next(ln for ln in ok_on(gw, "nodes").splitlines() if NODE in ln)
    assert " 1/3 " in row, row

    m = samples(scrape_text(gw.url))
    assert m[("llmgw_node_gpus", (("node", NODE), ("state", "free")))] == 1
    assert m[("llmgw_node_gpus", (("node", NODE), ("state", "used")))] == 2

    # A model no node fits (4 GPUs) is unplaceable; the placed one is not.
    put_model(gw, "big", {"model": "acme/big", "gpus": 4})
    m = wait_for(lambda: (got := samples(scrape_text(gw.url))).get(
        ("llmgw_model_unplaceable", (("model", "big"),))) == 1 and got, 10, "big unplaceable")
    assert m[("llmgw_model_unplaceable", (("model", "m"),))] == 0


def test_token_metrics_per_model_through_the_openai_client(cluster: Cluster,
                                                           tmp_path: Path) -> None:
    gw = cluster.gateway("tokens")
    # Each generated word takes 50 ms: a stream's time per output token is
    # at least that, whatever the machine's load.
    cluster.agent(NODE, [gw], "--gpus", "1", "--cache-dir", str(tmp_path / "hub"),
                  env_extra={"FAKE_VLLM_TOKEN_DELAY": "0.05"})
    key = make_key(gw)
    put_model(gw, "m", {"model": "acme/m", "gpus": 1, "aliases": ["small"]})
    wait_ready(gw)
    wait_for(lambda: routes(gw, key, "m"), 10, "routing")
    before = samples(scrape_text(gw.url))

    client = openai.OpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0)
    messages: list[openai.types.chat.ChatCompletionMessageParam] = [
        {"role": "user", "content": "count the tokens of this"}]
    plain = client.chat.completions.create(model="small", messages=messages)
    assert plain.usage is not None
    usage = None
    for chunk in client.chat.completions.create(model="small", messages=messages, stream=True,
                                                stream_options={"include_usage": True}):
        usage = chunk.usage or usage
    assert usage is not None and usage.completion_tokens == plain.usage.completion_tokens > 2
    # The gateway asks for this one's usage itself and cuts it from the stream.
    assert all(c.usage is None for c in client.chat.completions.create(
        model="m", messages=messages, stream=True))
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="no-such-model", messages=messages)

    def grew(name: str, **labels: str) -> float:
        k = (name, tuple(sorted({"model": "m", **labels}.items())))
        return after.get(k, 0.0) - before.get(k, 0.0)

    # A request is counted once it has ended, after its last byte went out:
    # the client can read a stream's end (and ask again) before the gateway
    # has counted it. Four requests counted: the three above and the 404.
    def all_counted() -> Samples | None:
        now = samples(scrape_text(gw.url))
        counted = sum(v - before.get(k, 0.0) for k, v in now.items()
                      if k[0] == "llmgw_requests_total")
        return now if counted >= 4 else None

    after = wait_for(all_counted, 5, "the four requests counted")
    assert grew("llmgw_requests_total", code="200") == 3
    assert after[("llmgw_requests_total", (("code", "404"), ("model", "(unknown)")))] == 1
    # Tokens as the engine reported them, the stripped usage's included.
    assert grew("llmgw_prompt_tokens_total") == 3 * plain.usage.prompt_tokens
    assert grew("llmgw_generation_tokens_total") == 3 * plain.usage.completion_tokens
    # Time to first token and per output token: streams only, once each.
    assert grew("llmgw_time_to_first_token_seconds_count") == 2
    assert grew("llmgw_request_time_per_output_token_seconds_count") == 2
    ttft = grew("llmgw_time_to_first_token_seconds_sum")
    assert 0 < ttft < grew("llmgw_request_duration_seconds_sum")
    # Timed finer than the serving loop's clock, which moves in whole
    # milliseconds under uvloop: a fast engine's first token came within
    # one, a time to first token of 0 (a chart's mean at 0, once in a run).
    assert abs(ttft * 1000 - round(ttft * 1000)) > 1e-6, ttft
    assert grew("llmgw_request_time_per_output_token_seconds_sum") / 2 >= 0.05
    # vLLM's buckets: the first is 1 ms, the last finite one 2560 s.
    assert ("llmgw_time_to_first_token_seconds_bucket",
            (("le", "0.001"), ("model", "m"))) in after
    assert ("llmgw_time_to_first_token_seconds_bucket",
            (("le", "2560.0"), ("model", "m"))) in after

    # The engines' queues and KV cache per model, from the loads polled.
    def per_model() -> dict[str, float] | None:
        got = {name: v for (name, labels), v in samples(scrape_text(gw.url)).items()
               if labels == (("model", "m"),) and name in (
                   "llmgw_num_requests_running", "llmgw_num_requests_waiting",
                   "llmgw_kv_cache_usage_perc")}
        # Figures read by the agent can be up to ~2 s old
        # (docs/design/routing.md, "Choosing a replica"): one taken during the
        # last stream shows it running.
        return got if len(got) == 3 and got["llmgw_num_requests_running"] == 0 else None

    gauges = wait_for(per_model, 10, "the model's idle engine load in /metrics")
    assert gauges["llmgw_num_requests_running"] == 0
    assert gauges["llmgw_num_requests_waiting"] == 0
    assert 0 <= gauges["llmgw_kv_cache_usage_perc"] <= 1
    names = served_names(scrape_text(gw.url))
    assert {"llmgw_requests_held", "llmgw_held_timeouts_total", "llmgw_store_unreachable",
            "llmgw_store_nospace"} <= names
    assert after[("llmgw_store_unreachable", ())] == 0


def test_status_labels_are_a_fixed_set() -> None:
    from app.gateway.request_metrics import code_label

    assert [code_label(c) for c in (200, 404, 429, 499, 503)] == [
        "200", "404", "429", "499", "503"]
    # Whatever an engine or provider answers, no new label value per code.
    assert [code_label(c) for c in (201, 418, 451, 507, 599)] == [
        "2xx", "4xx", "4xx", "5xx", "5xx"]


@pytest.fixture
async def rig() -> AsyncIterator[Rig]:
    timeouts = Timeouts(connect=2, first_byte=10, idle=10, request=10, cooldown=5,
                        cold_start=1, cold_start_held=4)
    async with started(Rig(timeouts)) as r:
        yield r


async def test_held_requests_that_time_out_are_counted(rig: Rig) -> None:
    rig.table.set_holdable({"small"})
    calls = [asyncio.create_task(rig.chat("small")) for _ in range(2)]
    await asyncio.sleep(0.2)
    assert rig.table.held() == {"small": 2}
    for r in await asyncio.wait_for(asyncio.gather(*calls), 5):
        assert r.status_code == 503
    assert rig.table.held() == {} and rig.table.hold_timeouts == {"small": 2}


async def test_the_observer_gets_a_streams_first_byte_only(rig: Rig) -> None:
    up = await rig.upstream("r1", mode="gzip-stream")  # three events, then its end
    rig.route("small", ("r1", up.url))
    resp = await rig.http.post(CHAT, json={"model": "small", "messages": MESSAGES,
                                           "stream": True},
                               headers={"Authorization": f"Bearer {CLIENT_KEY}"})
    assert resp.status_code == 200 and resp.text.endswith("data: [DONE]\n\n")
    ((seconds, first_byte, _, completion),) = rig.observed.details
    assert first_byte is not None and 0 < first_byte <= seconds
    assert completion == 1  # two events, no usage: estimated, one after the first
    rig.observed.details.clear()
    ok = await rig.upstream("r2")
    rig.route("small", ("r2", ok.url))
    assert (await rig.chat("small")).status_code == 200
    ((_, first_byte, _, _),) = rig.observed.details
    assert first_byte is None  # not a stream: no time to first token


def test_request_histograms_render_as_prometheus_buckets() -> None:
    from prometheus_client import CollectorRegistry, generate_latest

    from app.gateway.request_metrics import RequestMetrics

    rm = RequestMetrics()
    registry = CollectorRegistry(auto_describe=False)
    registry.register(rm)
    rm.observe(Outcome("m", 200, 0.3, 0.001, 5, 3))   # ttft on a bound: in its `le` bucket
    rm.observe(Outcome("m", 200, 9000.0, 3000.0, 0, 1))  # past the last bound: +Inf only
    rm.observe(Outcome("m", 418, 0.1))
    rm.prompt_counted("m", 7)
    m = samples(generate_latest(registry).decode())

    def ttft(le: str) -> float:
        return m[("llmgw_time_to_first_token_seconds_bucket", (("le", le), ("model", "m")))]

    assert (ttft("0.001"), ttft("2560.0"), ttft("+Inf")) == (1, 1, 2)
    assert m[("llmgw_time_to_first_token_seconds_sum", (("model", "m"),))] == 3000.001
    assert m[("llmgw_time_to_first_token_seconds_count", (("model", "m"),))] == 2
    # (0.3 - 0.001) / 2; the one-token stream has no gap to time.
    assert m[("llmgw_request_time_per_output_token_seconds_count", (("model", "m"),))] == 1
    assert m[("llmgw_request_time_per_output_token_seconds_sum", (("model", "m"),))] == (
        pytest.approx(0.1495))
    assert m[("llmgw_request_duration_seconds_count", (("model", "m"),))] == 3
    assert m[("llmgw_requests_total", (("code", "4xx"), ("model", "m")))] == 1
    assert m[("llmgw_prompt_tokens_total", (("model", "m"),))] == 12
    assert m[("llmgw_generation_tokens_total", (("model", "m"),))] == 4
