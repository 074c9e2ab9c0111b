"""The cluster page (/cluster) in a real headless Chromium, driven by
Playwright, against a real gateway and two real agents serving a replica on
the vLLM stand-in: what it shows. Its actions: test_cluster_page_actions.py."""

from __future__ import annotations

import http.client
import re

import httpx
from playwright.sync_api import Page, expect

from tests.support.cluster_page import Fleet, browser, fleet, page, shot, sign_in
from tests.support.procs import ADMIN

__all__ = ["browser", "fleet", "page"]  # fixtures


def test_the_page_shows_the_fleet_and_follows_it(fleet: Fleet, page: Page) -> None:
    gw = fleet.gw
    sign_in(page, gw, ADMIN)
    expect(page.locator("#signin")).to_be_hidden()
    replica = page.locator("#replicas tbody tr", has_text="chat-m")
    expect(replica).to_have_count(1)
    expect(replica.locator(".badge")).to_have_text("ready")
    model = page.locator("#models tbody tr", has_text="chat-m")
    # Model, engine, ready, replicas, wanted, range, health.
    expect(model.locator("td").nth(1)).to_have_text("vllm")
    expect(model.locator("td").nth(2)).to_have_text("1")
    expect(model.locator("td").nth(5)).to_have_text("1")
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
    r = httpx.put(f"{gw.url}/admin/models/second", json={"model": "acme/s", "gpus": 8},
                  headers={"Authorization": f"Bearer {ADMIN}"})
    assert r.status_code == 201, r.text
    second = page.locator("#models tbody tr", has_text="second")
    expect(second).to_have_count(1, timeout=10_000)
    # No node has 8 GPUs: its health says so, and why.
    expect(second.locator(".badge")).to_have_text("unplaceable", timeout=10_000)
    expect(second.locator("td.detail")).to_contain_text("gpu-1")
    shot(page.locator("#models"), "models")
    assert httpx.delete(f"{gw.url}/admin/models/second",
                        headers={"Authorization": f"Bearer {ADMIN}"}).status_code == 204


def test_each_node_draws_its_gpus_and_each_replica_its_queue(fleet: Fleet, page: Page) -> None:
    gw = fleet.gw
    sign_in(page, gw)
    with gw.admin() as admin:
        rep = next(r for r in admin.get("/admin/replicas").json() if r["model"] == "chat-m")
    held_node, held_gpu = rep["node"], rep["gpus"][0]
    node = page.locator("#nodes tbody tr", has_text=held_node)
    gpu = node.locator(".gpu").nth(held_gpu)
    # Which replica holds each GPU; the other is free.
    expect(gpu.locator(".holder")).to_have_text(rep["id"])
    expect(node.locator(".gpu").nth(1 - held_gpu).locator(".holder")).to_have_text("free")
    expect(node.locator(".count")).to_have_text("1 free, 1 used")
    # Memory and utilisation as bars, widths set from the script (the CSP
    # refuses inline styles in the markup): GPU 0 is 25% used and 37% busy.
    gpu0 = node.locator(".gpu").nth(0)
    expect(gpu0.locator(".mem .bar > span")).to_have_attribute("style", "width: 25%;")
    expect(gpu0.locator(".mem .words")).to_have_text("20 GiB used, 60 GiB free")
    expect(gpu0.locator(".util .bar > span")).to_have_attribute("style", "width: 37%;")
    expect(node.locator(".gpu").nth(1).locator(".util .words")).to_have_text("88% busy")
    # The grid: one cell per GPU, the held one in its replica's colour.
    cells = node.locator(".grid .cell")
    expect(cells).to_have_count(2)
    expect(cells.nth(held_gpu)).to_have_class(re.compile(r"\bheld\b"))
    expect(cells.nth(held_gpu)).to_have_attribute("style", re.compile(r"background-color: rgb"))
    expect(cells.nth(1 - held_gpu)).to_have_class(re.compile(r"\bfree\b"))
    expect(page.locator("#legend")).to_contain_text("chat-m")
    other = page.locator("#nodes tbody tr", has_text="gpu-2" if held_node == "gpu-1" else "gpu-1")
    expect(other.locator(".count")).to_have_text("2 free, 0 used")
    # The engine's queue and KV cache, as the gateway polled them.
    row = page.locator("#replicas tbody tr", has_text=rep["id"])
    cells = row.locator("td")
    expect(cells.nth(6)).to_have_text("1", timeout=15_000)  # running
    expect(cells.nth(7)).to_have_text("2")  # waiting
    expect(cells.nth(8).locator(".words")).to_have_text("0%")
    shot(page.locator("#nodes").locator(".."), "nodes")
    shot(page.locator("#replicas"), "replicas")
    shot(page, "page")


def test_a_refused_token_says_so_and_asks_again(fleet: Fleet, page: Page) -> None:
    sign_in(page, fleet.gw, "not-the-token")
    expect(page.locator("#problem")).to_have_text("the gateway refused this token")
    expect(page.locator("#signin")).to_be_visible()
    expect(page.locator("#fleet")).to_be_hidden()
    shot(page, "signin-refused")


def raw_get(gw_url: str, target: str) -> tuple[int, str]:
    """GET with the request target sent as written (httpx would remove the dot segments)."""
    host, port = gw_url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    try:
        conn.request("GET", target)
        r = conn.getresponse()
        return r.status, r.read().decode(errors="replace")
    finally:
        conn.close()


def test_the_page_is_served_under_a_strict_policy(fleet: Fleet) -> None:
    gw = fleet.gw
    r = httpx.get(gw.url + "/cluster")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    csp = r.headers["content-security-policy"]
    for directive in ("default-src 'none'", "script-src 'self'", "style-src 'self'",
                      "connect-src 'self'", "frame-ancestors 'none'"):
        assert directive in csp, csp
    assert "unsafe-inline" not in csp and "unsafe-eval" not in csp and "http" not in csp
    for name in ("cluster.js", "actions.js"):
        r = httpx.get(f"{gw.url}/cluster/{name}")
        assert r.headers["content-type"].startswith("text/javascript")
        assert r.headers["content-security-policy"] == csp
    # Only the page's own files: no path reaches anything else, written
    # plainly or encoded.
    for name in ("cluster.py", "..%2Fcluster.py", "..%2F..%2Fcli.py", "%2e%2e%2fcluster.py"):
        r = httpx.get(f"{gw.url}/cluster/{name}")
        assert r.status_code == 404 and r.headers["content-type"] == "application/problem+json"
    for target in ("/cluster/../../app/cli.py", "/cluster/..%2f..%2fapp%2fcli.py",
                   "/cluster/%2e%2e/%2e%2e/pyproject.toml", "/cluster/static/../cluster.py",
                   "/cluster/..\\..\\pyproject.toml"):
        status, body = raw_get(gw.url, target)
        assert status == 404, (target, status)
        assert "llmgw" not in body and "import" not in body, (target, body[:200])
