"""The cluster page's actions, in a real headless Chromium driven by
Playwright, against a real gateway and two real agents (the vLLM stand-in):
each asks for confirmation, its effect shows without a reload, and the
API's refusal is shown as written. The tests share one fleet and run in
order; each leaves the fleet as it found it, but the range test (last)."""

from __future__ import annotations

import re
from typing import Any

import openai
from playwright.sync_api import Locator, Page, expect

from tests.support.cluster_page import (
    Fleet,
    browser,
    fleet,
    mark,
    page,
    shot,
    sign_in,
    unreloaded,
)
from tests.support.procs import wait_for

__all__ = ["browser", "fleet", "page"]  # fixtures


def node_row(page: Page, node: str) -> Locator:
    return page.locator("#nodes tbody tr", has=page.locator("td:first-child", has_text=node))


def conf(fleet: Fleet, node: str) -> dict[str, Any]:
    with fleet.gw.admin() as admin:
        return dict(admin.get(f"/admin/nodes/{node}/conf").json())


def chat_replica(fleet: Fleet) -> dict[str, Any]:
    with fleet.gw.admin() as admin:
        return next(r for r in admin.get("/admin/replicas").json() if r["model"] == "chat-m")


def confirm(page: Page, title: str) -> None:
    dialog = page.locator("#act")
    expect(dialog).to_be_visible()
    expect(dialog.locator("#act-title")).to_have_text(title)
    dialog.locator("#act-ok").click()


def test_cordon_and_uncordon_from_the_page(fleet: Fleet, page: Page) -> None:
    sign_in(page, fleet.gw)
    row = node_row(page, "gpu-2")
    expect(row.locator(".badge")).to_have_text("schedulable")
    mark(page)
    row.get_by_role("button", name="Cordon").click()
    expect(page.locator("#act-text")).to_contain_text("No new replicas are placed on gpu-2")
    shot(page.locator("#act"), "confirm-cordon")
    # Cancelled: nothing is sent.
    page.locator("#act-cancel").click()
    expect(page.locator("#act")).to_be_hidden()
    assert conf(fleet, "gpu-2")["cordoned"] is False

    row.get_by_role("button", name="Cordon").click()
    confirm(page, "Cordon node gpu-2?")
    expect(page.locator("#act")).to_be_hidden()
    expect(row.locator(".badge")).to_have_text("cordoned")
    assert conf(fleet, "gpu-2")["cordoned"] is True
    row.get_by_role("button", name="Uncordon").click()
    confirm(page, "Uncordon node gpu-2?")
    expect(row.locator(".badge")).to_have_text("schedulable")
    assert conf(fleet, "gpu-2")["cordoned"] is False
    unreloaded(page)


def test_drain_moves_the_replica_to_the_other_node(fleet: Fleet, page: Page) -> None:
    sign_in(page, fleet.gw)
    held = chat_replica(fleet)["node"]
    other = "gpu-2" if held == "gpu-1" else "gpu-1"
    mark(page)
    node_row(page, held).get_by_role("button", name="Drain").click()
    confirm(page, f"Drain node {held}?")
    expect(node_row(page, held).locator(".badge")).to_have_text("draining")
    # Moved: a ready replica on the other node, the drained node's GPUs freed.
    moved = page.locator("#replicas tbody tr", has_text="chat-m").filter(
        has=page.locator("td:nth-child(3)", has_text=other))
    expect(moved.locator(".badge")).to_have_text("ready", timeout=45_000)
    expect(node_row(page, held).locator(".count")).to_have_text("2 free, 0 used",
                                                                 timeout=45_000)
    expect(node_row(page, other).locator(".grid .cell.held")).to_have_count(1)
    shot(page, "drained")
    node_row(page, held).get_by_role("button", name="Uncordon").click()
    confirm(page, f"Uncordon node {held}?")
    expect(node_row(page, held).locator(".badge")).to_have_text("schedulable")
    unreloaded(page)


def test_engine_build_chosen_from_the_page_and_a_refusal_shown(fleet: Fleet,
                                                                page: Page) -> None:
    sign_in(page, fleet.gw)
    row = node_row(page, "gpu-1")
    mark(page)
    row.get_by_role("button", name="Engine build…").click()
    expect(page.locator("#f-build-choice")).to_have_value("auto")
    page.select_option("#f-build-choice", "cu129")
    page.fill("#f-build-version", "not a version")
    confirm(page, "Engine build of node gpu-1")
    # The API's 422, as it wrote it; the dialog stays open and nothing changed.
    error = page.locator("#act-error")
    expect(error).to_contain_text("422 Invalid request body: the body does not match the schema")
    expect(error).to_contain_text("body.vllm_version: Value error, 'not a version' is not a "
                                  "vLLM version")
    shot(page.locator("#act"), "refused-engine-build")
    assert conf(fleet, "gpu-1")["engine_build"] == "auto"

    page.fill("#f-build-version", "0.11.0")
    page.locator("#act-ok").click()
    expect(page.locator("#act")).to_be_hidden()
    expect(row.locator(".chosen")).to_have_text("chosen: cu129, vLLM 0.11.0")
    got = conf(fleet, "gpu-1")
    assert (got["engine_build"], got["vllm_version"]) == ("cu129", "0.11.0")
    # And back to the default.
    row.get_by_role("button", name="Engine build…").click()
    expect(page.locator("#f-build-version")).to_have_value("0.11.0")
    page.select_option("#f-build-choice", "auto")
    page.fill("#f-build-version", "")
    confirm(page, "Engine build of node gpu-1")
    expect(row.locator(".chosen")).to_have_text("chosen: auto, vLLM default")
    unreloaded(page)


def test_a_key_is_made_shown_once_used_and_revoked(fleet: Fleet, page: Page) -> None:
    sign_in(page, fleet.gw)
    mark(page)
    page.locator("#new-key").click()
    page.fill("#f-key-name", "page-key")
    page.fill("#f-key-models", "chat-m")
    page.fill("#f-key-rpm", "60")
    page.fill("#f-key-days", "1")
    confirm(page, "New client key")
    shown = page.locator("#shown-key")
    expect(shown).to_be_visible()
    expect(shown.locator("#shown-key-value")).to_have_text(re.compile(r"^sk-llmgw-\S{20,}$"))
    shot(shown, "key-shown", mask=[shown.locator("#shown-key-value")])
    key = shown.locator("#shown-key-value").inner_text()
    # Shown once: gone from the page the moment it is dismissed (read in the
    # click's own turn, before any queued event), and never listed.
    still_there = page.evaluate(
        "key => { document.getElementById('shown-key-done').click();"
        " return [document.getElementById('shown-key').open,"
        " document.documentElement.outerHTML.includes(key)]; }", key)
    assert still_there == [False, False]
    expect(shown).to_be_hidden()
    assert key not in page.content()
    row = page.locator("#keys tbody tr", has_text="page-key")
    expect(row).to_have_count(1)
    cells = row.locator("td")
    expect(cells.nth(2)).to_have_text(key[:16] + "…")
    expect(cells.nth(3)).to_have_text("chat-m")
    expect(cells.nth(4)).to_have_text("60 req/min")
    expect(cells.nth(5)).not_to_have_text("never")
    shot(page.locator("#keys"), "keys")

    client = openai.OpenAI(base_url=fleet.gw.url + "/v1", api_key=key, max_retries=0)
    answer = client.chat.completions.create(
        model="chat-m", messages=[{"role": "user", "content": "hi"}])
    assert answer.choices[0].message.content

    key_id = cells.nth(1).inner_text()
    row.get_by_role("button", name="Revoke").click()
    confirm(page, f"Revoke key page-key ({key_id})?")
    expect(row).to_have_count(0)

    def refused() -> bool:
        try:
            client.chat.completions.create(
                model="chat-m", messages=[{"role": "user", "content": "hi"}])
        except openai.AuthenticationError:
            return True
        return False

    wait_for(refused, 5, "the revoked key refused")
    unreloaded(page)


def test_replica_range_changed_and_a_stale_edit_refused(fleet: Fleet, page: Page) -> None:
    gw = fleet.gw
    sign_in(page, gw)
    model = page.locator("#models tbody tr", has_text="chat-m")
    mark(page)
    model.get_by_role("button", name="Replicas…").click()
    expect(page.locator("#f-range-min")).to_have_value("1")
    expect(page.locator("#f-range-max")).to_have_value("1")
    page.fill("#f-range-max", "2")
    confirm(page, "Replicas of chat-m")
    expect(model.locator("td.range")).to_have_text("1\u20132")
    with gw.admin() as admin:
        stored = admin.get("/admin/models/chat-m").json()
    assert stored["replicas"] == {"min": 1, "max": 2}
    assert stored["model"] == "acme/m"  # the rest of the spec kept

    # Another admin changes the model after this page read it: the page's
    # edit, conditioned on what it read, is refused (412) and says so.
    model.get_by_role("button", name="Replicas…").click()
    page.fill("#f-range-max", "4")
    with gw.admin() as admin:
        r = admin.put("/admin/models/chat-m",
                      json={"model": "acme/m", "gpus": 1, "replicas": {"min": 1, "max": 3}})
        assert r.status_code == 200, r.text
    confirm(page, "Replicas of chat-m")
    error = page.locator("#act-error")
    expect(error).to_contain_text("412 Precondition Failed: model 'chat-m': If-Match does not "
                                  "hold (its ETag is now ")
    shot(page.locator("#act"), "refused-stale-range")
    page.locator("#act-cancel").click()
    expect(model.locator("td.range")).to_have_text("1\u20133")
    with gw.admin() as admin:
        assert admin.get("/admin/models/chat-m").json()["replicas"] == {"min": 1, "max": 3}
    unreloaded(page)
