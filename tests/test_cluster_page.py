"""The cluster page (/cluster) in a real headless Chromium, driven by
Playwright, against a real gateway serving a replica on the fake vLLM."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from playwright.sync_api import Browser, Page, expect, sync_playwright

from tests.support.procs import ADMIN, FAKE_BIN, Cluster, GatewayProc, serve_one

# Debian's Chromium (scripts/install-test.sh installs it); Playwright's own
# browser downloads are not reachable from CI.
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
# Without the background-networking flags Chromium keeps trying hosts that
# this network refuses; no sandbox: the tests run as root.
FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayProc]:
    c = Cluster(tmp_path_factory.mktemp("cluster-page"), None, "")
    try:
        gw = c.gateway("gw-page", local_node="gpu-1", local_gpus="2",
                       vllm_bin=str(FAKE_BIN / "vllm"))
        serve_one(gw, "chat-m")
        yield gw
    finally:
        c.close()


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    assert Path(CHROMIUM).exists(), "Chromium is missing: run scripts/install-test.sh"
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
        try:
            yield b
        finally:
            b.close()


@pytest.fixture
def page(browser: Browser) -> Iterator[Page]:
    context = browser.new_context()
    pg = context.new_page()
    errors: list[str] = []
    pg.on("pageerror", lambda exc: errors.append(str(exc)))
    # A Content-Security-Policy refusal is a console error, not a page error.
    pg.on("console", lambda msg: errors.append(msg.text) if msg.type == "error" else None)
    yield pg
    context.close()
    assert not [e for e in errors if "401" not in e], errors


def sign_in(page: Page, gw: GatewayProc, token: str) -> None:
    page.goto(gw.url + "/")  # redirected to /cluster
    expect(page).to_have_url(gw.url + "/cluster")
    page.fill("#token", token)
    page.click("#signin button[type=submit]")


def test_the_page_shows_the_fleet_and_follows_it(gw: GatewayProc, page: Page) -> None:
    sign_in(page, gw, ADMIN)
    expect(page.locator("#signin")).to_be_hidden()
    replica = page.locator("#replicas tbody tr", has_text="chat-m")
    expect(replica).to_have_count(1)
    expect(replica.locator(".badge")).to_have_text("ready")
    model = page.locator("#models tbody tr", has_text="chat-m")
    # Model, engine, ready, replicas, wanted, health.
    expect(model.locator("td").nth(1)).to_have_text("vllm")
    expect(model.locator("td").nth(2)).to_have_text("1")
    expect(model.locator(".badge")).to_have_text("ok")
    node = page.locator("#nodes tbody tr", has_text="gpu-1")
    expect(node.locator(".gpu")).to_have_count(2)
    expect(node.locator(".badge")).to_have_text("schedulable")
    expect(page.locator("#gateways tbody tr", has_text="gw-page").locator(".badge")
           ).to_have_text("leader")
    expect(page.locator("#where")).to_contain_text("gateway gw-page")
    # The token stays in this tab, not in the page's address or markup.
    assert ADMIN not in page.url and ADMIN not in page.content()

    # A second model appears on the next refresh, without a reload.
    r = httpx.put(f"{gw.url}/admin/models/second", json={"model": "acme/s", "gpus": 1},
                  headers={"Authorization": f"Bearer {ADMIN}"})
    assert r.status_code == 201, r.text
    expect(page.locator("#models tbody tr", has_text="second")).to_have_count(1,
                                                                               timeout=10_000)


def test_a_refused_token_says_so_and_asks_again(gw: GatewayProc, page: Page) -> None:
    sign_in(page, gw, "not-the-token")
    expect(page.locator("#problem")).to_have_text("the gateway refused this token")
    expect(page.locator("#signin")).to_be_visible()
    expect(page.locator("#fleet")).to_be_hidden()


def test_the_page_is_served_under_a_strict_policy(gw: GatewayProc) -> None:
    r = httpx.get(gw.url + "/cluster")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    csp = r.headers["content-security-policy"]
    assert "script-src 'self'" in csp and "unsafe-inline" not in csp
    assert httpx.get(gw.url + "/cluster/cluster.js").headers["content-type"].startswith(
        "text/javascript")
    # Only the page's own files: no path reaches anything else.
    for name in ("cluster.py", "..%2Fcluster.py", "..%2F..%2Fcli.py"):
        r = httpx.get(f"{gw.url}/cluster/{name}")
        assert r.status_code == 404 and r.headers["content-type"] == "application/problem+json"
