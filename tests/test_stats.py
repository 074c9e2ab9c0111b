"""Each model's last minutes (app/gateway/request_series.py) in-process with an
injected clock, and `GET /admin/stats` adding up a fleet of three real
gateway processes (docs/design/cluster-page.md, "Charts")."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from aiohttp import web

from app.api.stats import MAX_BYTES, _ask
from app.gateway.request_series import FIELDS, RequestSeries, Series, merge
from app.router.outcome import Outcome
from tests.support.procs import ADMIN, Cluster, make_key, put_model, routes, wait_for, wait_ready


class Clock:
    def __init__(self, t: float) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def test_each_interval_counts_its_requests_tokens_and_ttft() -> None:
    clock = Clock(1000.0)
    series = RequestSeries(clock=clock, interval=10, samples=6)
    series.observe(Outcome("m", 200, 0.5, first_byte=0.2, prompt=10, completion=30))
    series.observe(Outcome("m", 200, 0.5, first_byte=0.4, prompt=5, completion=20))
    series.observe(Outcome("m", 429, 0.01))
    clock.t = 1012.0  # the next interval
    series.observe(Outcome("m", 502, 1.0, first_byte=0.1, completion=3))
    series.prompt_counted("m", 7)  # a llama.cpp stream's prompt, counted after
    snap = series.snapshot()
    assert (snap.interval, snap.samples, snap.start) == (10, 6, 960.0)
    cols = snap.models["m"]
    assert set(cols) == set(FIELDS)
    # Oldest first; the last sample is the interval now (1010-1020).
    assert cols["requests_2xx"] == [0, 0, 0, 0, 2, 0]
    assert cols["requests_4xx"] == [0, 0, 0, 0, 1, 0]
    assert cols["requests_5xx"] == [0, 0, 0, 0, 0, 1]
    assert cols["prompt_tokens"] == [0, 0, 0, 0, 15, 7]
    assert cols["completion_tokens"] == [0, 0, 0, 0, 50, 3]
    assert cols["ttft_sum"][4] == pytest.approx(0.6) and cols["ttft_count"][4] == 2


def test_the_ring_forgets_what_left_the_window() -> None:
    clock = Clock(0.0)
    series = RequestSeries(clock=clock, interval=10, samples=3)
    series.observe(Outcome("old", 200, 0.1))
    clock.t = 25.0
    series.observe(Outcome("new", 200, 0.1))
    assert series.snapshot().models["old"]["requests_2xx"] == [1, 0, 0]
    clock.t = 30.0  # interval 3: "old"'s interval 0 is out of the window
    series.observe(Outcome("new", 200, 0.1))
    snap = series.snapshot()
    assert set(snap.models) == {"new"}
    assert snap.models["new"]["requests_2xx"] == [0, 1, 1]
    # Interval 5 reuses interval 2's row: it starts again from zero (1, not
    # 2); interval 3's request is still in the window, 4 had none.
    clock.t = 55.0
    series.observe(Outcome("new", 200, 0.1))
    assert series.snapshot().models["new"]["requests_2xx"] == [1, 0, 1]


def test_models_are_bounded_the_least_recently_seen_goes() -> None:
    clock = Clock(0.0)
    series = RequestSeries(clock=clock, interval=10, samples=90, max_models=2)
    series.observe(Outcome("a", 200, 0.1))
    clock.t = 10
    series.observe(Outcome("b", 200, 0.1))
    clock.t = 20
    series.observe(Outcome("a", 200, 0.1))
    series.observe(Outcome("c", 200, 0.1))  # "b" was seen last longest ago
    assert set(series.snapshot().models) == {"a", "c"}


def test_merge_adds_windows_aligned_on_their_start() -> None:
    def window(start: float, counts: list[float], model: str = "m") -> Series:
        cols = {f: [0.0] * len(counts) for f in FIELDS}
        cols["requests_2xx"] = counts
        return Series(interval=10, start=start, samples=len(counts), models={model: cols})

    mine = window(100, [1, 2, 3])
    # One a sample behind (its clock just before a boundary), one ahead, one
    # with a model of its own, one with another interval (left out).
    out = merge(mine, [window(90, [10, 20, 30]), window(110, [100, 200, 300]),
                       window(100, [0, 0, 7], "other"),
                       Series(interval=5, start=100, samples=1,
                              models={"m": {"requests_2xx": [1000.0]}})])
    assert out["models"]["m"]["requests_2xx"] == [1 + 20 + 0, 2 + 30 + 100, 3 + 0 + 200]
    assert out["models"]["other"]["requests_2xx"] == [0, 0, 7]
    assert out["models"]["other"]["ttft_count"] == [0, 0, 0]
    assert (out["start"], out["samples"], out["interval"]) == (100, 3, 10)


@pytest.mark.parametrize(("body", "why"), [
    (b"x" * (MAX_BYTES + 10), f"answered over {MAX_BYTES} bytes"),
    (b"not json", "answered no stats (JSONDecodeError)"),
    (json.dumps({"interval": 10, "start": 0, "samples": 1,
                 "models": {"m": {"ttft_sum": ["a"]}}}).encode(),
     "answered no stats (ValidationError)"),
])
async def test_a_peers_answer_is_capped_and_checked(body: bytes, why: str) -> None:
    async def handler(request: web.Request) -> web.Response:
        assert request.headers["Authorization"] == "Bearer tok"
        assert request.query["scope"] == "self"
        return web.Response(body=body, content_type="application/json")

    app = web.Application()
    app.router.add_get("/admin/stats", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        import aiohttp

        async with aiohttp.ClientSession() as session:
            with pytest.raises(ValueError) as err:
                await _ask(session, f"http://127.0.0.1:{port}", "tok")
        assert str(err.value) == why
    finally:
        await runner.cleanup()


def stats(url: str, scope: str = "fleet", token: str = ADMIN) -> httpx.Response:
    return httpx.get(url + "/admin/stats", params={"scope": scope}, timeout=10,
                     headers={"Authorization": f"Bearer {token}"})


def total(answer: dict[str, Any], model: str, field: str) -> float:
    return float(sum(answer["models"].get(model, {}).get(field, [])))


def test_the_fleets_figures_from_any_gateway(cluster: Cluster, tmp_path: Path) -> None:
    gws = [cluster.gateway(f"gw-{i}") for i in range(3)]
    cluster.agent("node-1", gws, "--gpus", "1", "--cache-dir", str(tmp_path / "hub"))
    key = make_key(gws[0])
    put_model(gws[0], "m", {"model": "acme/m", "gpus": 1})
    wait_ready(gws[0])
    for gw in gws[:2]:
        wait_for(lambda gw=gw: routes(gw, key, "m"), 15, f"{gw.name} routing")
    # Five requests on gw-0 (two streams), three on gw-1, none on gw-2.
    before = {gw.name: total(stats(gw.url, "self").json(), "m", "requests_2xx")
              for gw in gws}
    for gw, n in ((gws[0], 5), (gws[1], 3)):
        client = openai.OpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0)
        for i in range(n):
            if i < 2:
                list(client.chat.completions.create(
                    model="m", messages=[{"role": "user", "content": "hi there"}], stream=True,
                    stream_options={"include_usage": True}))
            else:
                client.chat.completions.create(
                    model="m", messages=[{"role": "user", "content": "hi there"}])

    own = {gw.name: stats(gw.url, "self").json() for gw in gws}
    assert [total(own[g.name], "m", "requests_2xx") - before[g.name] for g in gws] == [5, 3, 0]
    fleet = stats(gws[2].url)
    assert fleet.status_code == 200, fleet.text
    body = fleet.json()
    assert body["gateways"] == ["gw-0", "gw-1", "gw-2"] and body["missing"] == {}
    assert total(body, "m", "requests_2xx") - sum(before.values()) == 8
    assert total(body, "m", "ttft_count") == sum(total(own[g], "m", "ttft_count")
                                                for g in own) >= 4
    assert total(body, "m", "completion_tokens") > 0
    assert total(body, "m", "prompt_tokens") > 0

    # A gateway gone (its entry not yet expired) is named; the rest still add up.
    gws[1].kill()
    body = stats(gws[2].url).json()
    assert body["gateways"] == ["gw-0", "gw-2"] and list(body["missing"]) == ["gw-1"]
    assert total(body, "m", "requests_2xx") == total(own["gw-0"], "m", "requests_2xx")

    # The admin token is required, and a bad scope is refused as problem JSON.
    assert stats(gws[2].url, token="wrong").status_code == 401
    r = stats(gws[2].url, scope="everyone")
    assert r.status_code == 422 and r.headers["content-type"] == "application/problem+json"
