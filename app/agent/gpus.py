"""What a node has: its GPUs (through NVML, else `nvidia-smi`), CPUs and memory.

NVML (`nvidia-ml-py`, imported as `pynvml`) is the driver's own library and
the interface NVIDIA keeps backward compatible; `nvidia-smi`'s text is
not guaranteed to be. It is asked first. Where NVML cannot load (no
`libnvidia-ml.so` on the library path: some containers mount the tool but
not the library) `nvidia-smi` is run instead. A node where both fail has no
GPUs: a CPU node, and `Hardware.source` says why, so that `llmgw ctl nodes`
shows "none (NVML: Driver Not Loaded; nvidia-smi: ...)" instead of a silent
CPU node. `--gpus N` declares N GPUs instead (tests, or nodes where
discovery is not wanted).

Everything here blocks (NVML calls, a subprocess): callers on an event loop
run it in a thread (docs/design/node-operations.md).
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import subprocess
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from app.wire.nodes import MAX_GPUS, MAX_TEXT, GpuInfo, fit

logger = logging.getLogger(__name__)

# `nvidia-smi --query-gpu` fields, in this order. The CUDA version is not a
# query field: it is read from the plain `nvidia-smi` banner.
SMI_FIELDS = "index,uuid,name,memory.total,memory.free,utilization.gpu,driver_version"
_CUDA_BANNER = re.compile(r"CUDA Version:\s*([0-9][0-9.]*)")


@dataclass(frozen=True)
class Hardware:
    """A node's hardware, as discovered (or declared)."""

    gpus: list[GpuInfo] = field(default_factory=list)
    driver_version: str = ""
    cuda_version: str = ""
    cpus: int = 0
    memory_mib: int = 0
    # "nvml", "nvidia-smi", "declared", or "none (why)".
    source: str = ""

    def node_fields(self) -> dict[str, Any]:
        """The NodeInfo fields this fills, within the gateways' caps (a node
        with more GPUs reports the first MAX_GPUS; docs/design/security.md)."""
        return {"gpus": self.gpus[:MAX_GPUS], "driver_version": self.driver_version[:64],
                "cuda_version": self.cuda_version[:64], "cpus": self.cpus,
                "memory_mib": self.memory_mib, "gpu_discovery": fit(self.source, MAX_TEXT)}


class Nvml(Protocol):
    """The part of `pynvml` discovery calls. Tests pass a stand-in module."""

    NVMLError: type[Exception]

    def nvmlInit(self) -> None: ...
    def nvmlShutdown(self) -> None: ...
    def nvmlSystemGetDriverVersion(self) -> str | bytes: ...
    def nvmlSystemGetCudaDriverVersion(self) -> int: ...
    def nvmlDeviceGetCount(self) -> int: ...
    def nvmlDeviceGetHandleByIndex(self, index: int) -> Any: ...
    def nvmlDeviceGetName(self, handle: Any) -> str | bytes: ...
    def nvmlDeviceGetUUID(self, handle: Any) -> str | bytes: ...
    def nvmlDeviceGetMemoryInfo(self, handle: Any) -> Any: ...
    def nvmlDeviceGetUtilizationRates(self, handle: Any) -> Any: ...


def _text(value: str | bytes) -> str:
    # nvidia-ml-py before 11.515 returned bytes; later ones str.
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def cuda_version(code: int) -> str:
    """NVML's CUDA driver version (12040) as CUDA writes it ("12.4")."""
    return f"{code // 1000}.{code % 1000 // 10}" if code > 0 else ""


def from_nvml(nvml: Nvml) -> Hardware:
    """The GPUs NVML sees. Raises `nvml.NVMLError` when NVML is unusable.

    A GPU whose utilisation is not available (MIG mode, some older boards:
    "Not Supported") is reported without it, not dropped; one whose name or
    memory cannot be read (a GPU fallen off the bus: "GPU is lost") is left
    out with a warning, since nothing can be placed on it.
    """
    nvml.nvmlInit()
    try:
        driver = _text(nvml.nvmlSystemGetDriverVersion())
        try:
            cuda = cuda_version(int(nvml.nvmlSystemGetCudaDriverVersion()))
        except nvml.NVMLError:
            cuda = ""
        gpus = []
        for i in range(int(nvml.nvmlDeviceGetCount())):
            try:
                handle = nvml.nvmlDeviceGetHandleByIndex(i)
                name = _text(nvml.nvmlDeviceGetName(handle))
                uuid = _text(nvml.nvmlDeviceGetUUID(handle))
                mem = nvml.nvmlDeviceGetMemoryInfo(handle)
            except nvml.NVMLError as exc:
                logger.warning("GPU %d left out: NVML could not read it (%s)", i, exc)
                continue
            try:
                util: int | None = int(nvml.nvmlDeviceGetUtilizationRates(handle).gpu)
            except nvml.NVMLError:
                util = None
            gpus.append(GpuInfo(
                index=i, uuid=uuid, name=name, memory_mib=int(mem.total) // 2**20,
                memory_free_mib=int(mem.free) // 2**20, utilization=util))
        return Hardware(gpus=gpus, driver_version=driver, cuda_version=cuda, source="nvml")
    finally:
        try:
            nvml.nvmlShutdown()
        except nvml.NVMLError:
            pass


def _int(value: str) -> int | None:
    # nvidia-smi writes "[N/A]" or "[Not Supported]" where it has no value.
    return int(value) if value.isdigit() else None


def parse_nvidia_smi(query: str, banner: str = "") -> Hardware:
    """Parses `nvidia-smi --query-gpu=SMI_FIELDS --format=csv,noheader,nounits`
    and, for the CUDA version, the plain `nvidia-smi` banner. Lines that are
    not a GPU's (a warning, "Unable to determine the device handle for GPU
    0000:41:00.0: Unknown Error") are skipped."""
    gpus, driver = [], ""
    for line in query.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) != 7 or not parts[0].isdigit():
            continue
        index, uuid, name, total, free, util, drv = parts
        gpus.append(GpuInfo(index=int(index), uuid=uuid, name=name,
                            memory_mib=_int(total) or 0, memory_free_mib=_int(free),
                            utilization=_int(util)))
        driver = driver or drv
    found = _CUDA_BANNER.search(banner)
    return Hardware(gpus=gpus, driver_version=driver, cuda_version=found.group(1) if found else "",
                    source="nvidia-smi")


class SmiFailed(Exception):
    """nvidia-smi is missing, failed, or found no GPU; the message says which."""


def run_nvidia_smi(exe: str = "nvidia-smi", timeout: float = 10.0) -> tuple[str, str]:
    """(query output, banner) from `exe`; raises SmiFailed."""
    path = shutil.which(exe)
    if path is None:
        raise SmiFailed(f"{exe} not found")
    outs = []
    for args in ([f"--query-gpu={SMI_FIELDS}", "--format=csv,noheader,nounits"], []):
        try:
            done = subprocess.run([path, *args], capture_output=True, text=True,
                                  timeout=timeout, check=False)
        except (subprocess.SubprocessError, OSError) as exc:
            raise SmiFailed(f"{exe}: {exc}") from exc
        if done.returncode != 0:
            # "NVIDIA-SMI has failed because it couldn't communicate with the
            # NVIDIA driver..." (9), "No devices were found" (6), "Failed to
            # initialize NVML: Driver/library version mismatch" (18).
            said = (done.stdout.strip() or done.stderr.strip()).splitlines()
            raise SmiFailed(f"{exe} exited {done.returncode}: {said[0] if said else ''}")
        outs.append(done.stdout)
    return outs[0], outs[1]


def host_memory_mib(meminfo: str) -> int:
    """MemTotal from /proc/meminfo's text, in MiB."""
    found = re.search(r"^MemTotal:\s+(\d+)\s*kB", meminfo, re.MULTILINE)
    return int(found.group(1)) // 1024 if found else 0


def host() -> tuple[int, int]:
    """(CPUs this process may use, memory in MiB) of this host."""
    try:
        with open("/proc/meminfo") as f:
            mem = host_memory_mib(f.read())
    except OSError:
        mem = 0
    return len(os.sched_getaffinity(0)) or (os.cpu_count() or 0), mem


def _with_host(hw: Hardware, facts: tuple[int, int]) -> Hardware:
    return replace(hw, cpus=facts[0], memory_mib=facts[1])


def _load_pynvml() -> Nvml:
    import pynvml  # type: ignore[import-untyped]  # nvidia-ml-py ships no types

    module: Nvml = pynvml
    return module


def probe(
    nvml: Callable[[], Nvml] = _load_pynvml,
    smi: Callable[[], tuple[str, str]] = run_nvidia_smi,
    host: Callable[[], tuple[int, int]] = host,
) -> Hardware:
    """This node's hardware: NVML first, nvidia-smi next, else a CPU node
    whose `source` says why. Never raises: a broken driver makes a CPU node,
    not a dead agent. Blocking."""
    reasons = []
    try:
        module = nvml()
    except ImportError as exc:
        reasons.append(f"NVML: nvidia-ml-py not installed ({exc})")
    else:
        try:
            hw = from_nvml(module)
            if hw.gpus:
                return _with_host(hw, host())
            reasons.append("NVML: no GPU")
        # NVMLError's subclasses name the failure: "NVML Shared Library Not
        # Found", "Driver Not Loaded", "RM has detected an NVML/RM version
        # mismatch."; OSError: the library found but not loadable.
        except (module.NVMLError, OSError) as exc:
            reasons.append(f"NVML: {exc}")
    try:
        hw = parse_nvidia_smi(*smi())
        if hw.gpus:
            return _with_host(hw, host())
        reasons.append("nvidia-smi: no GPU listed")
    except SmiFailed as exc:
        reasons.append(f"nvidia-smi: {exc}")
    source = f"none ({'; '.join(reasons)})"
    if source != _told.source:  # not again at each rediscovery (nodeops.py, every minute)
        logger.info("no GPU found, a CPU node: %s", source)
        _told.source = source
    return _with_host(Hardware(source=source), host())


class _Told:
    """The last reason logged for finding no GPU: a CPU node is told so
    when it starts and when the reason changes, not every minute."""

    source = ""


_told = _Told()


def discover() -> list[GpuInfo]:
    """The GPUs alone (what callers older than `probe` take). Blocking."""
    return probe().gpus


def refreshed(previous: Hardware, found: Hardware) -> Hardware:
    """What to report after discovering again. A discovery that finds no GPU
    where there were some (a driver hiccup, NVML timing out) keeps the last
    GPUs, its failure in `source`: the leader must not see a GPU node turn
    into a CPU node for a moment. A different set of GPUs is taken as it is
    (a GPU fallen off the bus is real news)."""
    if not found.gpus and previous.gpus:
        logger.warning("GPU discovery found none this time (%s); keeping the last seen",
                       found.source)
        return replace(previous, source=found.source)
    return found


def declared(count: int) -> list[GpuInfo]:
    return [GpuInfo(index=i, name="declared") for i in range(count)]


def declared_hardware(count: int) -> Hardware:
    return _with_host(Hardware(gpus=declared(count), source="declared"), host())


def host_only(gpus: list[GpuInfo]) -> Hardware:
    """The host's CPUs and memory around GPUs given by the caller."""
    return _with_host(Hardware(gpus=gpus, source="declared" if gpus else ""), host())
