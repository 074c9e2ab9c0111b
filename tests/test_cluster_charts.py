"""The cluster page's charts in a real headless Chromium, driven by
Playwright, against a real gateway serving a replica on the fake vLLM:
requests sent through the gateway appear in the model's charts without a
reload. The screenshot goes to $LLMGW_TEST_ARTIFACTS/cluster/charts.png
(default: test-artifacts/ at the repository root)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from playwright.sync_api import Page, expect

from tests.support.procs import ADMIN, FAKE_BIN, ROOT, Cluster, GatewayProc, Served, serve_one
from tests.test_cluster_page import browser, page, sign_in  # noqa: F401 (fixtures)


def artifacts() -> Path:
    out = Path(os.environ.get("LLMGW_TEST_ARTIFACTS") or ROOT / "test-artifacts") / "cluster"
    out.mkdir(parents=True, exist_ok=True)
    return out


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[GatewayProc, Served]]:
    c = Cluster(tmp_path_factory.mktemp("cluster-charts"), None, "")
    try:
        gw = c.gateway("gw-charts", local_node="gpu-1", local_gpus="1",
                       vllm_bin=str(FAKE_BIN / "vllm"))
        yield gw, serve_one(gw, "chat-m")
    finally:
        c.close()


def total(pg: Page, model: str, chart: str) -> float:
    figure = pg.locator(f'.model-charts[data-model="{model}"] figure.{chart}')
    return float(figure.get_attribute("data-total") or 0)


def test_requests_appear_in_the_models_charts_without_a_reload(
        served: tuple[GatewayProc, Served], page: Page) -> None:  # noqa: F811
    gw, one = served
    sign_in(page, gw, ADMIN)
    expect(page.locator("#charts h2")).to_have_text("Traffic")
    expect(page.locator("#charts-note")).to_contain_text("summed over 1 gateway")
    url = page.url

    client = openai.OpenAI(base_url=gw.url + "/v1", api_key=one.key, max_retries=0)
    messages: list[openai.types.chat.ChatCompletionMessageParam] = [
        {"role": "user", "content": "draw me a chart of this"}]
    for _ in range(3):
        client.chat.completions.create(model="chat-m", messages=messages)
    for _ in range(2):
        list(client.chat.completions.create(model="chat-m", messages=messages, stream=True,
                                            stream_options={"include_usage": True}))
    # A refusal is counted too, as a 4xx.
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="chat-m", messages=[])

    card = page.locator('.model-charts[data-model="chat-m"]')
    expect(card).to_have_count(1, timeout=15_000)  # the next poll (5 s), no reload
    expect(card.locator("h3")).to_have_text("chat-m")
    page.wait_for_function(
        "() => Number(document.querySelector('.model-charts figure.requests')"
        "?.dataset.total) >= 6", timeout=15_000)
    assert page.url == url
    assert total(page, "chat-m", "requests") >= 6
    assert total(page, "chat-m", "tokens") > 0
    assert total(page, "chat-m", "ttft") > 0  # the two streams' mean
    bars = card.locator("figure.requests rect")
    assert bars.locator("xpath=self::*[@class='ok']").count() >= 1
    assert bars.locator("xpath=self::*[@class='client']").count() == 1
    expect(card.locator("figure.tokens path.line.completion")).to_have_count(1)
    expect(card.locator("figure.ttft circle.dot")).not_to_have_count(0)

    # What the page showed is what the API says.
    api = httpx.get(gw.url + "/admin/stats", headers={"Authorization": f"Bearer {ADMIN}"}).json()
    cols = api["models"]["chat-m"]
    assert sum(cols["requests_2xx"]) >= 5 and sum(cols["requests_4xx"]) >= 1

    card.scroll_into_view_if_needed()
    page.locator("#charts").screenshot(path=str(artifacts() / "charts.png"))
    page.screenshot(path=str(artifacts() / "charts-page.png"), full_page=True)


def test_the_charts_files_are_served_under_the_pages_policy(
        served: tuple[GatewayProc, Served]) -> None:
    gw, _ = served
    for name, kind in (("charts.js", "text/javascript"), ("charts.css", "text/css")):
        r = httpx.get(f"{gw.url}/cluster/{name}")
        assert r.status_code == 200 and r.headers["content-type"].startswith(kind)
        assert "script-src 'self'" in r.headers["content-security-policy"]
    # The page loads them from this gateway, and no inline code.
    html = httpx.get(gw.url + "/cluster").text
    assert '<script src="/cluster/charts.js" defer></script>' in html
    assert "<script>" not in html and "style=" not in html
