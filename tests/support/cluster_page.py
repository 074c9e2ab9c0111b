"""The cluster page's test rig: a real gateway, two real agents whose GPUs
a stand-in `nvidia-smi` reports (memory, utilisation), the vLLM stand-in,
and Debian's Chromium driven by Playwright. Screenshots go to
$LLMGW_TEST_ARTIFACTS/cluster (default: test-artifacts/ at the repository root)."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from playwright.sync_api import Browser, Locator, Page, expect, sync_playwright

from tests.support.procs import ADMIN, ROOT, Cluster, GatewayProc, serve_one, wait_for

# Debian's Chromium (scripts/install-test.sh installs it); Playwright's own
# browser downloads are not reachable from CI.
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
# Without the background-networking flags Chromium keeps trying hosts that
# this network refuses; no sandbox: the tests run as root.
FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]

# Two H100s per node as nvidia-smi lists them: GPU 0 with 60 GiB of its
# 79.6 free (25% used) at 37% busy, GPU 1 with 20 GiB free (75% used) at 88%.
NVIDIA_SMI = """#!/bin/sh
case "$1" in
  --query-gpu=*)
    echo "0, GPU-$LLMGW_TEST_NODE-0, NVIDIA H100 80GB HBM3, 81559, 61440, 37, 550.54.15"
    echo "1, GPU-$LLMGW_TEST_NODE-1, NVIDIA H100 80GB HBM3, 81559, 20480, 88, 550.54.15" ;;
  *) echo "| NVIDIA-SMI 550.54.15   Driver Version: 550.54.15   CUDA Version: 12.4 |" ;;
esac
"""
# Each engine reports 1 running and 2 waiting requests (its queue) at rest.
BASE_LOAD = "1,2"
NODES = ("gpu-1", "gpu-2")


def artifacts() -> Path:
    root = Path(os.environ.get("LLMGW_TEST_ARTIFACTS") or ROOT / "test-artifacts")
    out = root / "cluster"
    out.mkdir(parents=True, exist_ok=True)
    return out


def shot(target: Page | Locator, name: str, mask: list[Locator] | None = None) -> Path:
    """Saves a screenshot of the page (whole) or of one element, with the
    elements in `mask` (a client key shown once) covered: artifacts leave
    the machine, secrets must not."""
    path = artifacts() / f"{name}.png"
    if isinstance(target, Page):
        target.screenshot(path=str(path), full_page=True, mask=mask or [])
    else:
        target.screenshot(path=str(path), mask=mask or [])
    return path


@dataclass
class Fleet:
    gw: GatewayProc
    key: str  # a client key made by the rig


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    tmp = tmp_path_factory.mktemp("cluster-page")
    smi = tmp / "smi"
    smi.mkdir()
    (smi / "nvidia-smi").write_text(NVIDIA_SMI)
    (smi / "nvidia-smi").chmod(0o755)
    c = Cluster(tmp, None, "")
    try:
        gw = c.gateway("gw-page", local_agent="false")
        for node in NODES:
            c.agent(node, [gw], env_extra={
                "PATH": f"{smi}{os.pathsep}{c.base_env()['PATH']}",
                "LLMGW_TEST_NODE": node, "FAKE_VLLM_BASE_LOAD": BASE_LOAD})
        with gw.admin() as admin:
            wait_for(lambda: len(admin.get("/admin/nodes").json()) == len(NODES), 30,
                     "both agents heard from")
        served = serve_one(gw, "chat-m")
        yield Fleet(gw, served.key)
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
    context = browser.new_context(viewport={"width": 1600, "height": 1000})
    pg = context.new_page()
    errors: list[str] = []
    pg.on("pageerror", lambda exc: errors.append(str(exc)))
    # A Content-Security-Policy refusal is a console error, not a page
    # error; so is a refused request (the tests' 401s, 412s and 422s).
    pg.on("console", lambda msg: errors.append(msg.text) if msg.type == "error" else None)
    yield pg
    context.close()
    assert not [e for e in errors if "the server responded with a status of 4" not in e], errors


def sign_in(page: Page, gw: GatewayProc, token: str = ADMIN) -> None:
    page.goto(gw.url + "/")  # redirected to /cluster
    expect(page).to_have_url(gw.url + "/cluster")
    page.fill("#token", token)
    page.click("#signin button[type=submit]")


def mark(page: Page) -> None:
    """Marks the loaded document: `unreloaded` later says it is still the same one."""
    page.evaluate("window.llmgwTestMark = 1")


def unreloaded(page: Page) -> None:
    assert page.evaluate("window.llmgwTestMark") == 1, "the page was reloaded"
