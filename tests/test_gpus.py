"""GPU discovery: NVML through a stand-in pynvml replaying recorded answers,
nvidia-smi through a real executable printing recorded outputs, and the
real pynvml on this GPU-less machine (tests/data/README.md)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pynvml  # type: ignore[import-untyped]
import pytest

from app.agent import gpus
from app.agent.gpus import Hardware, SmiFailed, parse_nvidia_smi, probe, run_nvidia_smi
from app.control.state import GpuInfo, NodeInfo

DATA = Path(__file__).parent / "data"
HOST = (16, 64_000)


class RecordedNvml:
    """The pynvml functions gpus.from_nvml calls, answering from a recording;
    errors are the real pynvml.NVMLError subclasses for the recorded codes."""

    NVMLError = pynvml.NVMLError

    def __init__(self, name: str) -> None:
        self.rec = json.loads((DATA / name).read_text())
        self.calls: list[str] = []

    def _answer(self, value: Any) -> Any:
        if isinstance(value, dict) and "error" in value:
            raise pynvml.NVMLError(value["error"])
        return SimpleNamespace(**value) if isinstance(value, dict) else value

    def nvmlInit(self) -> None:
        self.calls.append("init")
        self._answer(self.rec.get("nvmlInit", None))

    def nvmlShutdown(self) -> None:
        self.calls.append("shutdown")

    def nvmlSystemGetDriverVersion(self) -> str:
        return str(self._answer(self.rec["nvmlSystemGetDriverVersion"]))

    def nvmlSystemGetCudaDriverVersion(self) -> int:
        return int(self._answer(self.rec["nvmlSystemGetCudaDriverVersion"]))

    def nvmlDeviceGetCount(self) -> int:
        return len(self.rec["devices"])

    def nvmlDeviceGetHandleByIndex(self, index: int) -> dict[str, Any]:
        return dict(self.rec["devices"][index])

    def nvmlDeviceGetName(self, handle: dict[str, Any]) -> bytes:
        return str(self._answer(handle["nvmlDeviceGetName"])).encode()  # as older pynvml

    def nvmlDeviceGetUUID(self, handle: dict[str, Any]) -> str:
        return str(self._answer(handle["nvmlDeviceGetUUID"]))

    def nvmlDeviceGetMemoryInfo(self, handle: dict[str, Any]) -> Any:
        return self._answer(handle["nvmlDeviceGetMemoryInfo"])

    def nvmlDeviceGetUtilizationRates(self, handle: dict[str, Any]) -> Any:
        return self._answer(handle["nvmlDeviceGetUtilizationRates"])


def smi_tool(tmp_path: Path, query: str, banner: str, code: int = 0) -> str:
    """A real `nvidia-smi` stand-in printing recorded files; it refuses any
    other query than the one discovery is meant to send."""
    exe = tmp_path / "nvidia-smi"
    exe.write_text(f"""#!/bin/sh
if [ "$1" = "--query-gpu={gpus.SMI_FIELDS}" ] && [ "$2" = "--format=csv,noheader,nounits" ]; then
  cat '{DATA / query}'; exit {code}
elif [ "$#" -eq 0 ]; then
  cat '{DATA / banner}'; exit {code}
fi
echo "unexpected arguments: $*" >&2; exit 2
""")
    exe.chmod(0o755)
    return str(exe)


def no_smi() -> tuple[str, str]:
    raise SmiFailed("nvidia-smi not found")


def test_nvml_on_an_8xh100_machine() -> None:
    nvml = RecordedNvml("nvml-8xh100.json")
    hw = probe(nvml=lambda: nvml, smi=no_smi, host=lambda: HOST)
    assert (hw.source, hw.driver_version, hw.cuda_version) == ("nvml", "550.90.07", "12.4")
    assert (hw.cpus, hw.memory_mib) == HOST
    assert len(hw.gpus) == 8
    assert {g.name for g in hw.gpus} == {"NVIDIA H100 80GB HBM3"}
    assert [g.index for g in hw.gpus] == list(range(8))
    assert hw.gpus[0].memory_mib == 81559  # bytes to MiB, as nvidia-smi says it
    assert [g.memory_free_mib for g in hw.gpus] == [8769] * 4 + [81007] * 4
    assert [g.utilization for g in hw.gpus] == [98, 97, 99, 98, 0, 0, 0, 0]
    assert all(g.uuid.startswith("GPU-") for g in hw.gpus)
    assert len({g.uuid for g in hw.gpus}) == 8
    assert nvml.calls == ["init", "shutdown"]


def test_nvml_on_a_mixed_machine_with_mig_and_a_lost_gpu() -> None:
    nvml = RecordedNvml("nvml-mixed.json")
    hw = probe(nvml=lambda: nvml, smi=no_smi, host=lambda: HOST)
    assert hw.cuda_version == "12.2"
    # The lost GPU (index 2) is left out; the others keep their NVML index.
    assert [(g.index, g.name, g.memory_mib, g.utilization) for g in hw.gpus] == [
        (0, "NVIDIA RTX A6000", 49140, 0),
        (1, "NVIDIA RTX A6000", 49140, 63),
        (3, "NVIDIA A100 80GB PCIe", 81920, None),  # MIG: "Not Supported"
    ]


def test_nvml_failing_falls_back_to_nvidia_smi(tmp_path: Path) -> None:
    nvml = RecordedNvml("nvml-no-driver.json")
    exe = smi_tool(tmp_path, "nvidia-smi-8xh100.csv", "nvidia-smi-8xh100.txt")
    hw = probe(nvml=lambda: nvml, smi=lambda: run_nvidia_smi(exe), host=lambda: HOST)
    assert hw.source == "nvidia-smi"
    assert (hw.driver_version, hw.cuda_version) == ("550.90.07", "12.4")
    assert [g.index for g in hw.gpus] == list(range(8))
    assert hw.gpus[7].memory_free_mib == 81007


def test_nvidia_smi_on_a_mixed_machine() -> None:
    hw = parse_nvidia_smi((DATA / "nvidia-smi-mixed.csv").read_text(),
                          (DATA / "nvidia-smi-mixed.txt").read_text())
    assert (hw.driver_version, hw.cuda_version) == ("535.183.01", "12.2")
    assert [(g.name, g.memory_mib, g.memory_free_mib, g.utilization) for g in hw.gpus] == [
        ("NVIDIA RTX A6000", 49140, 48663, 0),
        ("NVIDIA RTX A6000", 49140, 2411, 63),
        ("NVIDIA A100 80GB PCIe", 81920, None, None),  # "[N/A]" in MIG mode
    ]


@pytest.mark.parametrize(("recorded", "code", "said"), [
    ("nvidia-smi-no-driver.txt", 9, "couldn't communicate with the NVIDIA driver"),
    ("nvidia-smi-mismatch.txt", 18, "Driver/library version mismatch"),
    ("nvidia-smi-no-devices.txt", 6, "No devices were found"),
])
def test_a_failed_driver_makes_a_cpu_node_that_says_why(
    tmp_path: Path, recorded: str, code: int, said: str
) -> None:
    nvml = RecordedNvml("nvml-no-driver.json")
    exe = smi_tool(tmp_path, recorded, recorded, code)
    hw = probe(nvml=lambda: nvml, smi=lambda: run_nvidia_smi(exe), host=lambda: HOST)
    assert hw.gpus == []
    assert (hw.cpus, hw.memory_mib) == HOST  # a CPU node reports its cores and memory
    assert hw.source.startswith("none (NVML: Driver Not Loaded; nvidia-smi: ")
    assert f"exited {code}: " in hw.source and said in hw.source


def test_the_real_pynvml_without_a_driver_says_so() -> None:
    """This machine has no NVIDIA driver: the real pynvml fails to load its
    library, and a missing nvidia-smi is named."""
    hw = probe(smi=lambda: run_nvidia_smi("no-such-nvidia-smi"))
    assert hw.gpus == []
    assert "NVML: NVML Shared Library Not Found" in hw.source
    assert "no-such-nvidia-smi not found" in hw.source
    assert hw.cpus >= 1 and hw.memory_mib > 0


def test_a_refresh_that_loses_every_gpu_keeps_the_last_seen() -> None:
    before = Hardware(gpus=[GpuInfo(index=0, name="H100")], driver_version="550.90.07",
                      source="nvml")
    failed = Hardware(source="none (NVML: Timeout; nvidia-smi: nvidia-smi exited 9: ...)")
    kept = gpus.refreshed(before, failed)
    assert kept.gpus == before.gpus and kept.driver_version == "550.90.07"
    assert kept.source == failed.source
    fewer = Hardware(gpus=[GpuInfo(index=1, name="H100")], source="nvml")
    assert gpus.refreshed(before, fewer) == fewer


def test_inventory_fields_are_optional_for_older_readers_and_writers() -> None:
    hw = probe(nvml=lambda: RecordedNvml("nvml-8xh100.json"), smi=no_smi, host=lambda: HOST)
    node = NodeInfo(name="gpu-01", **hw.node_fields())
    data = json.loads(node.model_dump_json())
    assert data["cuda_version"] == "12.4" and data["gpus"][0]["memory_free_mib"] == 8769
    # What an older agent wrote still reads, the new fields at their defaults.
    old = NodeInfo.model_validate({"name": "gpu-01", "gpus": [{"index": 0, "name": "H100"}]})
    assert (old.api_url, old.cpus, old.gpus[0].utilization) == ("", 0, None)


def test_declared_gpus() -> None:
    hw = gpus.declared_hardware(2)
    assert [g.index for g in hw.gpus] == [0, 1] and hw.source == "declared"


class Beats:
    """The agent's gateway, in memory: records heartbeats."""

    def __init__(self) -> None:
        self.inventories: list[dict[str, Any]] = []

    async def start(self) -> None: ...

    async def close(self) -> None: ...

    async def heartbeat(self, inventory: dict[str, Any]) -> dict[str, Any]:
        self.inventories.append(inventory)
        return {"ttl": 15}

    async def assignments(self, since: str, wait: float) -> dict[str, Any]:
        raise NotImplementedError

    async def report(self, replicas: list[dict[str, Any]]) -> None: ...

    def move_on(self) -> None: ...


async def test_the_agent_discovers_again_now_and_then_off_the_event_loop(
    tmp_path: Path,
) -> None:
    from app.agent.agent import Agent
    from app.agent.config import AgentConfig
    from app.agent.nodeops import NodeOpsConfig

    now = [0.0]
    first = probe(nvml=lambda: RecordedNvml("nvml-8xh100.json"), smi=no_smi, host=lambda: HOST)
    later = RecordedNvml("nvml-8xh100.json")
    for dev in later.rec["devices"]:
        dev["nvmlDeviceGetMemoryInfo"]["free"] = 1 << 30  # 1 GiB free on each
    loop_thread: list[bool] = []

    def rediscover() -> Hardware:
        import threading

        loop_thread.append(threading.current_thread() is threading.main_thread())
        return probe(nvml=lambda: later, smi=no_smi, host=lambda: HOST)

    beats = Beats()
    agent = Agent(AgentConfig(
        gateways=["http://127.0.0.1:9"], node="gpu-01", token="t", gpus=first.gpus,
        engines=["vllm"], work_dir=tmp_path, advertise_host="127.0.0.1",
        ops=NodeOpsConfig(hardware=first, rediscover=rediscover, rediscover_interval=60)),
        clock=lambda: now[0], client=beats)
    await agent.heartbeat()
    now[0] = 59.0
    await agent.heartbeat()
    assert loop_thread == []
    now[0] = 60.0
    await agent.heartbeat()
    assert loop_thread == [False]  # run in a worker thread
    sent = [[g["memory_free_mib"] for g in inv["gpus"]] for inv in beats.inventories]
    assert sent == [[8769] * 4 + [81007] * 4] * 2 + [[1024] * 8]
    assert beats.inventories[-1]["driver_version"] == "550.90.07"
    assert beats.inventories[-1]["gpu_discovery"] == "nvml"


def test_a_cpu_node_says_it_found_no_gpu_once_not_at_every_rediscovery(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The agent discovers again every minute (nodeops.py): a CPU node's
    unchanged answer is logged once, a changed one again."""
    reason = [f"nvidia-smi not found ({id(caplog)})"]  # this test's own reason

    def smi() -> tuple[str, str]:
        raise SmiFailed(reason[0])

    def told() -> list[str]:
        return [r.getMessage() for r in caplog.records
                if r.name == "app.agent.gpus" and r.levelno >= 20 and "no GPU" in r.getMessage()]

    caplog.set_level("DEBUG", logger="app.agent.gpus")
    nvml = RecordedNvml("nvml-no-driver.json")
    for _ in range(3):
        assert probe(nvml=lambda: nvml, smi=smi, host=lambda: HOST).gpus == []
    assert len(told()) == 1 and reason[0] in told()[0], told()
    reason[0] += ", then another"
    probe(nvml=lambda: nvml, smi=smi, host=lambda: HOST)
    assert len(told()) == 2 and told()[1].endswith(f"{reason[0]})"), told()
