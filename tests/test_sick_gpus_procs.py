"""GPUs that fall sick, across real processes: a gateway, an agent whose
NVML is the stand-in replaying a recording (tests/fakes/nvml/pynvml.py,
edited by the test while the agent runs), the vLLM stand-in, `llmgw ctl`,
and the cluster page in a real Chromium."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from playwright.sync_api import Page, expect

from tests.support.cluster_page import browser, page, shot, sign_in
from tests.support.procs import (
    ROOT,
    Cluster,
    GatewayProc,
    put_model,
    replicas,
    serve_one,
    wait_for,
)
from tests.support.scrape import samples, scrape_text
from tests.test_ctl import admin_get, ctl, ok_on

__all__ = ["browser", "page"]  # fixtures

NODE = "gpu-1"
FAKE_NVML = ROOT / "tests" / "fakes" / "nvml"


@dataclass
class Rig:
    gw: GatewayProc
    nvml: Path  # the recording the agent's NVML replays
    rec: dict[str, Any]

    def save(self) -> None:
        tmp = self.nvml.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.rec))
        tmp.replace(self.nvml)  # the agent never reads half a file

    def xid(self, gpu: int, xid: int) -> None:
        self.rec["events"].append({"device": gpu, "eventType": 8, "eventData": xid})
        self.save()

    def gpus(self) -> list[dict[str, Any]]:
        node = next(n for n in admin_get(self.gw, "/admin/nodes") if n["name"] == NODE)
        return list(node["gpus"])

    def unhealthy_gauge(self) -> float:
        return samples(scrape_text(self.gw.url)).get(
            ("llmgw_node_gpus_unhealthy", (("node", NODE),)), -1.0)


@pytest.fixture(scope="module")
def rig(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Rig]:
    tmp = tmp_path_factory.mktemp("sick-gpus")
    rec = json.loads((ROOT / "tests" / "data" / "nvml-2xh100-health.json").read_text())
    c = Cluster(tmp, None, "")
    try:
        gw = c.gateway("gw-sick", local_agent="false")
        r = Rig(gw, tmp / "nvml.json", rec)
        r.save()
        c.agent(NODE, [gw], env_extra={"PYTHONPATH": str(FAKE_NVML), "FAKE_NVML": str(r.nvml)})
        wait_for(lambda: admin_get(gw, "/admin/nodes"), 30, "the agent heard from")
        yield r
    finally:
        c.close()


def ready_on(gw: GatewayProc, model: str) -> list[tuple[str, list[int]]]:
    return [(r["id"], r["gpus"]) for r in replicas(gw)
            if r["model"] == model and r["phase"] == "ready"]


def test_a_sick_gpu_loses_its_replica_and_placement_until_an_admin_clears_it(rig: Rig) -> None:
    gw = rig.gw
    gpus = rig.gpus()
    assert [(g["name"], g["health"], g["unhealthy"]) for g in gpus] == [
        ("NVIDIA H100 80GB HBM3", "ok", False)] * 2
    served = serve_one(gw, "m")
    sick = served.replica["gpus"][0]
    well = 1 - sick
    assert rig.unhealthy_gauge() == 0

    rig.xid(sick, 79)
    wait_for(lambda: rig.gpus()[sick]["unhealthy"], 30, "the GPU reported unhealthy")
    reason = rig.gpus()[sick]["health_reason"]
    assert re.fullmatch(r"XID 79: GPU has fallen off the bus \(at [0-9T:-]+Z\)", reason)
    # Its replica moves to the healthy GPU: the new one first, then the old goes.
    wait_for(lambda: [g for _, g in ready_on(gw, "m")] == [[well]]
             and len([r for r in replicas(gw) if r["model"] == "m"]) == 1,
             60, "the replica moved off the sick GPU")
    assert rig.unhealthy_gauge() == 1
    listed = ctl("nodes", gateway=gw.url, COLUMNS="400")  # one line per node
    assert listed.returncode == 0, listed.stderr
    assert f"GPU {sick} UNHEALTHY: XID 79: GPU has fallen off the bus" in listed.stdout

    # Nothing is placed on it: a second model finds no room, and says why.
    put_model(gw, "n", {"model": "acme/n", "gpus": 1})
    wait_for(lambda: admin_get(gw, "/admin/models/n")["status"]["health"]["state"]
             == "unplaceable", 20, "n unplaceable")
    why = admin_get(gw, "/admin/models/n")["status"]["health"]["reasons"][NODE]
    assert why == f"needs 1 free GPUs, has 0 of 2; GPU {sick} unhealthy"

    said = ok_on(gw, "node", "gpu-clear", NODE, str(sick))
    assert said == f"node {NODE}: GPU {sick} fault cleared ({reason}); placement may use it\n"
    wait_for(lambda: [g for _, g in ready_on(gw, "n")] == [[sick]], 60,
             "n placed on the cleared GPU")
    assert rig.unhealthy_gauge() == 0
    gpu = rig.gpus()[sick]
    # As its agent reports it still; the gateways no longer hold it out.
    assert (gpu["health"], gpu["unhealthy"]) == ("unhealthy", False)


def test_the_page_marks_a_sick_gpu_with_its_reason(rig: Rig, page: Page) -> None:
    # A GPU whose uncorrected ECC count grows (after the test above, or alone).
    gpu = 1
    rig.rec["devices"][gpu]["nvmlDeviceGetTotalEccErrors"] = 2
    rig.save()
    sign_in(page, rig.gw)
    node = page.locator("#nodes tbody tr", has_text=NODE)
    cell = node.locator(".grid .cell").nth(gpu)
    expect(cell).to_have_class(re.compile(r"\bsick\b"), timeout=30_000)
    reason = rig.gpus()[gpu]["health_reason"]
    assert re.fullmatch(r"2 uncorrected ECC errors since the GPU's last reset "
                        r"\(at [0-9T:-]+Z\)", reason), reason
    expect(cell).to_have_attribute("title", re.compile(re.escape(f"unhealthy: {reason}")))
    line = node.locator(".gpu").nth(gpu)
    expect(line).to_have_class(re.compile(r"\bsick\b"))
    expect(line).to_have_attribute("title", f"unhealthy: {reason}")
    expect(node.locator(".gpu").nth(1 - gpu)).not_to_have_class(re.compile(r"\bsick\b"))
    expect(node.locator(".count")).to_contain_text("1 unhealthy")
    expect(page.locator("#legend")).to_contain_text("unhealthy")
    shot(node, "sick-gpu")
    # Cleared from the page: the marker and the button go.
    node.get_by_role("button", name=f"Clear GPU {gpu}").click()
    dialog = page.locator("#act")
    expect(dialog.locator("#act-title")).to_have_text(f"Clear GPU {gpu} of node {NODE}?")
    expect(dialog.locator("#act-text")).to_contain_text(f"Its fault: {reason}.")
    dialog.locator("#act-ok").click()
    expect(dialog).to_be_hidden()
    expect(cell).not_to_have_class(re.compile(r"\bsick\b"), timeout=15_000)
    expect(node.get_by_role("button", name=f"Clear GPU {gpu}")).to_have_count(0)
    conf = admin_get(rig.gw, f"/admin/nodes/{NODE}/conf")
    assert conf["gpu_cleared"][str(gpu)] == reason
