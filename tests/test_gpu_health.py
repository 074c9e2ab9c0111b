"""The agent's GPU health rules (app/agent/gpuhealth.py), in process: NVML
is the stand-in pynvml replaying a recording in NVML's formats
(tests/fakes/nvml/pynvml.py), which the test edits between steps; the
clock is injected."""

from __future__ import annotations

import copy
import importlib.util
import json
import threading
from pathlib import Path
from typing import Any

import pytest

from app.agent.gpuhealth import FATAL_XIDS, GpuHealth, HealthNvml
from app.agent.gpus import Hardware
from app.agent.nodeops import NodeOps, NodeOpsConfig
from app.wire.nodes import GpuInfo, NodeInfo

DATA = Path(__file__).parent / "data"
FAKE = Path(__file__).parent / "fakes" / "nvml" / "pynvml.py"
T0 = 1_795_000_000.0
AT = " (at 2026-11-18T11:06:40Z)"  # T0, as each reason ends


class Replay:
    """The recording in a file the stand-in reads at every call."""

    def __init__(self, tmp: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        self.path = tmp / "nvml.json"
        self.rec: dict[str, Any] = json.loads((DATA / "nvml-2xh100-health.json").read_text())
        self.save()
        monkeypatch.setenv("FAKE_NVML", str(self.path))
        spec = importlib.util.spec_from_file_location("replayed_pynvml", FAKE)
        assert spec is not None and spec.loader is not None
        self.module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(self.module)

    def save(self) -> None:
        self.path.write_text(json.dumps(self.rec))

    def device(self, i: int, **answers: Any) -> None:
        self.rec["devices"][i].update(answers)
        self.save()

    def xid(self, gpu: int, xid: int) -> None:
        self.rec["events"].append({"device": gpu, "eventType": 8, "eventData": xid})
        self.save()

    def nvml(self) -> HealthNvml:
        module: HealthNvml = self.module  # type: ignore[assignment]
        return module


@pytest.fixture
def replay(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Replay:
    return Replay(tmp_path, monkeypatch)


def watch(replay: Replay, path: Path | None = None, at: float = T0) -> GpuHealth:
    return GpuHealth(replay.nvml, path, clock=lambda: at)


def test_healthy_gpus_have_no_fault(replay: Replay, tmp_path: Path) -> None:
    h = watch(replay, tmp_path / "health.json")
    assert h.step(0) is False
    assert h.reasons() == {}
    assert not (tmp_path / "health.json").exists()  # nothing to keep


def test_a_fatal_xid_makes_its_gpu_unhealthy_and_a_benign_one_does_not(replay: Replay) -> None:
    h = watch(replay)
    h.step(0)
    replay.xid(1, 13)  # a graphics engine exception: the application's fault
    replay.xid(0, 31)  # an MMU fault: the application's too
    assert h.step(0) is False
    assert h.reasons() == {}
    replay.xid(1, 79)
    assert h.step(0) is True
    assert h.reasons() == {1: "XID 79: GPU has fallen off the bus" + AT}
    assert {48, 64, 74, 79, 95} <= FATAL_XIDS.keys() and not {13, 31, 43, 94} & FATAL_XIDS.keys()


def test_a_growing_uncorrected_ecc_count_is_a_fault_a_standing_one_is_not(
        replay: Replay, tmp_path: Path) -> None:
    kept = tmp_path / "health.json"
    h = watch(replay, kept)
    h.step(0)
    replay.device(0, nvmlDeviceGetTotalEccErrors=2)
    assert h.step(0) is True
    assert h.reasons() == {0: "2 uncorrected ECC errors since the GPU's last reset" + AT}
    assert h.step(0) is False  # still 2: nothing new
    # An agent restart keeps the fault and the count: 2 is not news.
    again = watch(replay, kept)
    assert again.reasons() == h.reasons()
    assert again.step(0) is False
    replay.device(0, nvmlDeviceGetTotalEccErrors=3)
    assert again.step(0) is True
    assert again.reasons() == {0: "3 uncorrected ECC errors since the GPU's last reset" + AT}


def test_ecc_present_at_the_first_check_is_a_fault(replay: Replay) -> None:
    replay.device(1, nvmlDeviceGetTotalEccErrors=1)
    h = watch(replay)
    h.step(0)
    assert h.reasons() == {1: "1 uncorrected ECC errors since the GPU's last reset" + AT}


def test_retired_pages_pending_and_a_failed_row_remap(replay: Replay) -> None:
    h = watch(replay)
    h.step(0)
    replay.device(0, nvmlDeviceGetRetiredPagesPendingStatus=1)
    replay.device(1, nvmlDeviceGetRemappedRows=[0, 3, 0, 1])
    h.step(0)
    assert h.reasons() == {
        0: "retired pages pending: the GPU needs a reset" + AT,
        1: "row remapping failed: the GPU's memory cannot repair itself" + AT}


def test_what_a_board_does_not_support_is_not_a_fault(replay: Replay) -> None:
    # NVML_ERROR_NOT_SUPPORTED (3): no ECC on the board, no row remapping.
    replay.device(0, nvmlDeviceGetTotalEccErrors={"error": 3},
                  nvmlDeviceGetRemappedRows={"error": 3},
                  nvmlDeviceRegisterEvents={"error": 3})
    h = watch(replay)
    assert h.step(0) is False
    assert h.reasons() == {}


def test_a_lost_gpu_and_one_timing_out(replay: Replay) -> None:
    h = watch(replay)
    h.step(0)
    replay.device(0, all={"error": 15})  # NVML_ERROR_GPU_IS_LOST
    replay.device(1, nvmlDeviceGetTotalEccErrors={"error": 10})  # NVML_ERROR_TIMEOUT
    h.step(0)
    assert h.reasons() == {0: "GPU is lost: NVML cannot reach it (GPU is lost)" + AT,
                           1: "NVML timed out reading the GPU (Timeout)" + AT}


def test_a_gpu_lost_again_after_answering_is_a_new_reason(replay: Replay) -> None:
    clock = [T0]
    h = GpuHealth(replay.nvml, None, clock=lambda: clock[0])
    h.step(0)
    healthy = replay.rec["devices"][0].copy()
    replay.device(0, all={"error": 15})
    h.step(0)
    first = h.reasons()[0]
    replay.rec["devices"][0] = healthy  # back (a reset); the fault is kept
    replay.save()
    clock[0] += 60
    h.step(0)
    assert h.reasons() == {0: first}
    replay.device(0, all={"error": 15})
    h.step(0)
    assert h.reasons()[0] != first and h.reasons()[0].endswith("(at 2026-11-18T11:07:40Z)")


def test_a_gpu_lost_before_the_agent_started(replay: Replay) -> None:
    replay.device(1, all={"error": 15})
    h = watch(replay)
    h.step(0)
    assert h.reasons() == {1: "GPU is lost: NVML cannot reach it (GPU is lost)" + AT}


def test_a_cleared_xid_comes_back_as_a_new_reason(replay: Replay) -> None:
    clock = [T0]
    h = GpuHealth(replay.nvml, None, clock=lambda: clock[0])
    replay.xid(0, 48)
    h.step(0)
    first = h.reasons()[0]
    clock[0] += 3600
    replay.xid(0, 48)
    h.step(0)
    assert h.reasons()[0] != first and h.reasons()[0].startswith("XID 48: double-bit ECC")


def test_an_unreadable_record_starts_afresh(replay: Replay, tmp_path: Path) -> None:
    bad = tmp_path / "health.json"
    bad.write_text("{not json")
    assert watch(replay, bad).reasons() == {}


async def test_a_step_that_hangs_marks_the_gpu_it_reads(
        replay: Replay, tmp_path: Path) -> None:
    release = threading.Event()

    class Hanging:
        """NVML whose ECC read of GPU 1 never returns (until released)."""

        def __init__(self) -> None:
            self.inner = replay.nvml()

        def __getattr__(self, name: str) -> Any:
            return getattr(self.inner, name)

        def nvmlDeviceGetTotalEccErrors(self, handle: Any, kind: int, counter: int) -> int:
            if handle == 1:
                release.wait(10)
            return int(self.inner.nvmlDeviceGetTotalEccErrors(handle, kind, counter))

    h = GpuHealth(lambda: Hanging(), None, clock=lambda: T0)  # type: ignore[arg-type,return-value]
    ops = NodeOps(NodeOpsConfig(hardware=Hardware(), api_port=None, log_to_file=False,
                                gpu_health=h, health_interval=0.0, health_stall=0.3),
                  node="n", token="t", work_dir=tmp_path, gpus=[], view=None,  # type: ignore[arg-type]
                  clock=lambda: 0.0)
    step = __import__("asyncio").create_task(ops.health_step(h))
    await __import__("asyncio").sleep(0.6)
    assert h.reasons() == {1: "NVML did not answer within 0.3 s reading the GPU" + AT}
    release.set()
    assert await step is True
    # The step that hung, once it returns, keeps the fault it was blamed for.
    assert h.reasons() == {1: "NVML did not answer within 0.3 s reading the GPU" + AT}


def test_the_inventory_carries_each_gpus_health(replay: Replay, tmp_path: Path) -> None:
    h = watch(replay)
    replay.xid(1, 79)
    h.step(0)
    gpus = [GpuInfo(index=0, name="H100"), GpuInfo(index=1, name="H100")]
    ops = NodeOps(NodeOpsConfig(hardware=Hardware(gpus=gpus, source="nvml"), api_port=None,
                                log_to_file=False, gpu_health=h),
                  node="n", token="t", work_dir=tmp_path, gpus=[], view=None,  # type: ignore[arg-type]
                  clock=lambda: 0.0)
    sent = NodeInfo(name="n", **ops.node_fields()).model_dump(mode="json")
    assert [(g["health"], g["health_reason"]) for g in sent["gpus"]] == [
        ("ok", ""), ("unhealthy", h.reasons()[1])]
    # An older agent's GPU, without the fields, reads as healthy.
    old = copy.deepcopy(sent)
    for g in old["gpus"]:
        del g["health"], g["health_reason"]
    assert [g.health for g in NodeInfo.model_validate(old).gpus] == ["ok", "ok"]


def test_without_events_the_counts_are_still_watched(replay: Replay,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    def refused() -> None:
        raise replay.module.NVMLError(3)  # NVML_ERROR_NOT_SUPPORTED

    monkeypatch.setattr(replay.module, "nvmlEventSetCreate", refused)
    h = watch(replay)
    h.step(0)
    replay.device(0, nvmlDeviceGetTotalEccErrors=1)
    assert h.step(0) is True
    assert h.reasons() == {0: "1 uncorrected ECC errors since the GPU's last reset" + AT}


def test_an_nvml_that_cannot_start_is_tried_again(replay: Replay) -> None:
    replay.rec["nvmlInit"] = {"error": 9}  # NVML_ERROR_DRIVER_NOT_LOADED
    replay.save()
    h = watch(replay)
    assert h.step(0) is False and h.step(0) is False
    del replay.rec["nvmlInit"]
    replay.xid(1, 95)
    assert h.step(0) is True
    assert h.reasons()[1].startswith("XID 95: uncontained ECC error")
