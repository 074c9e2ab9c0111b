"""A stand-in `pynvml` replaying a recording (tests/data/README.md), for an
agent process: put this directory first on PYTHONPATH and name the
recording in FAKE_NVML. The file is read again at each call, so a test
changes what NVML answers (an ECC count grows, a GPU is lost, an XID event
arrives) while the agent runs. Errors are the real nvidia-ml-py's
`NVMLError` classes for the recorded codes (`{"error": N}`)."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import json
import os
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any


def _real() -> Any:
    here = str(Path(__file__).parent)
    spec = importlib.machinery.PathFinder.find_spec(
        "pynvml", [p for p in sys.path if p and str(Path(p).resolve()) != here])
    assert spec is not None and spec.loader is not None, "nvidia-ml-py is not installed"
    module = importlib.util.module_from_spec(spec)
    # It registers its error classes on sys.modules["pynvml"] (itself).
    before = sys.modules.get("pynvml")
    sys.modules["pynvml"] = module
    try:
        spec.loader.exec_module(module)
    finally:
        if before is None:
            del sys.modules["pynvml"]
        else:
            sys.modules["pynvml"] = before
    return module


_REAL = _real()
NVMLError = _REAL.NVMLError
NVML_ERROR_TIMEOUT = _REAL.NVML_ERROR_TIMEOUT
_delivered = 0  # events of the recording already delivered


def _rec() -> dict[str, Any]:
    rec: dict[str, Any] = json.loads(Path(os.environ["FAKE_NVML"]).read_text())
    return rec


def _answer(value: Any) -> Any:
    if isinstance(value, dict) and "error" in value:
        raise NVMLError(value["error"])
    return SimpleNamespace(**value) if isinstance(value, dict) else value


def _device(handle: int, call: str, default: Any = None) -> Any:
    dev = _rec()["devices"][handle]
    if "all" in dev:  # every call of this device fails alike (a lost GPU)
        return _answer(dev["all"])
    return _answer(dev.get(call, default))


def nvmlInit() -> None:
    _answer(_rec().get("nvmlInit"))


def nvmlShutdown() -> None:
    pass


def nvmlSystemGetDriverVersion() -> str:
    return str(_answer(_rec()["nvmlSystemGetDriverVersion"]))


def nvmlSystemGetCudaDriverVersion() -> int:
    return int(_answer(_rec()["nvmlSystemGetCudaDriverVersion"]))


def nvmlDeviceGetCount() -> int:
    return len(_rec()["devices"])


def nvmlDeviceGetHandleByIndex(index: int) -> int:
    if "all" in _rec()["devices"][index]:
        _device(index, "")
    return index


def nvmlDeviceGetIndex(handle: int) -> int:
    return handle


def nvmlDeviceGetName(handle: int) -> str:
    return str(_device(handle, "nvmlDeviceGetName"))


def nvmlDeviceGetUUID(handle: int) -> str:
    return str(_device(handle, "nvmlDeviceGetUUID"))


def nvmlDeviceGetMemoryInfo(handle: int) -> Any:
    return _device(handle, "nvmlDeviceGetMemoryInfo")


def nvmlDeviceGetUtilizationRates(handle: int) -> Any:
    return _device(handle, "nvmlDeviceGetUtilizationRates")


def nvmlDeviceGetTotalEccErrors(handle: int, errorType: int, counterType: int) -> int:
    assert (errorType, counterType) == (_REAL.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
                                        _REAL.NVML_VOLATILE_ECC)
    return int(_device(handle, "nvmlDeviceGetTotalEccErrors", 0))


def nvmlDeviceGetRetiredPagesPendingStatus(device: int) -> int:
    return int(_device(device, "nvmlDeviceGetRetiredPagesPendingStatus", 0))


def nvmlDeviceGetRemappedRows(device: int) -> tuple[int, int, int, int]:
    corr, unc, pending, failed = _device(device, "nvmlDeviceGetRemappedRows", [0, 0, 0, 0])
    return int(corr), int(unc), int(pending), int(failed)


def nvmlEventSetCreate() -> str:
    return "event-set"


def nvmlDeviceRegisterEvents(handle: int, eventTypes: int, eventSet: str) -> None:
    assert eventTypes == _REAL.nvmlEventTypeXidCriticalError and eventSet == "event-set"
    _device(handle, "nvmlDeviceRegisterEvents")


def nvmlEventSetWait(eventSet: str, timeoutms: int) -> Any:
    """The recording's next undelivered event, else NVML_ERROR_TIMEOUT after
    a short wait (a real one blocks `timeoutms`)."""
    global _delivered
    events = _rec().get("events", [])
    if _delivered < len(events):
        ev = events[_delivered]
        _delivered += 1
        return SimpleNamespace(device=ev["device"], eventType=ev["eventType"],
                               eventData=ev["eventData"], gpuInstanceId=0xFFFFFFFF,
                               computeInstanceId=0xFFFFFFFF)
    time.sleep(min(timeoutms, 200) / 1000)
    raise NVMLError(NVML_ERROR_TIMEOUT)
