"""Each GPU's health through NVML: fatal XID events, uncorrected ECC errors,
retired pages and row remapping, a GPU that stops answering
(docs/design/gpu-health.md).

A GPU's health is the latest fault seen on it, kept: once unhealthy it is
reported so (with the reason) until another fault replaces the reason.
The agent never forgets one by itself; the gateways keep a GPU out of
placement until an admin clears that reason (app/control/gpus.py), and a
new fault, a new reason, puts it out again. Faults are kept in the work
directory, so an agent restart neither forgets an XID (NVML delivers an
event once) nor takes a standing ECC count for a new fault.

What counts as new: an XID event whose number NVIDIA's Xid catalog sends
to a GPU reset or a node restart (`FATAL_XIDS`); an uncorrected volatile
ECC count that grew (volatile counts start again at a GPU reset); retired
pages pending, or row remapping failed, turning true; NVML answering a GPU
"GPU is lost" or timing out. Every reason carries the time it was seen, so
that the same fault seen again after a clear is a new reason. The NVML
values used are the library's documented enum values (nvml.h), so any
pynvml that has the functions works.

`step()` blocks (NVML calls, waiting for events): the agent runs it in a
thread (app/agent/nodeops.py). A call that never returns is the caller's
to notice: `stalled()` marks the GPU being checked.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

logger = logging.getLogger(__name__)

# NVIDIA's Xid catalog ("Analyzing Xid Errors with the Xid Catalog",
# docs.nvidia.com/deploy/xid-errors/analyzing-xid-catalog.html): the XIDs
# whose immediate action is a GPU reset or a node restart. Others (13, 31,
# 43, 45: an application's fault; 63, 92: worth watching; 94: an ECC error
# contained to the application that touched it, which dies and is
# restarted) do not make a GPU unhealthy here: a growing ECC count does.
FATAL_XIDS: dict[int, str] = {
    48: "double-bit ECC error",
    62: "internal micro-controller halt",
    64: "ECC page retirement or row remapping failure",
    74: "NVLink error",
    79: "GPU has fallen off the bus",
    95: "uncontained ECC error",
    119: "GSP RPC timeout",
    120: "GSP error",
}

# nvml.h values.
XID_CRITICAL_EVENT = 0x8  # nvmlEventTypeXidCriticalError
MEMORY_ERROR_UNCORRECTED = 1  # NVML_MEMORY_ERROR_TYPE_UNCORRECTED
VOLATILE_ECC = 0  # NVML_VOLATILE_ECC
ERROR_NOT_SUPPORTED = 3
ERROR_TIMEOUT = 10
ERROR_GPU_IS_LOST = 15
MAX_EVENTS_PER_STEP = 64


class HealthNvml(Protocol):
    """The part of `pynvml` the health watch calls. Tests replay recordings
    through a stand-in (tests/fakes/nvml/pynvml.py)."""

    NVMLError: type[Exception]

    def nvmlInit(self) -> None: ...
    def nvmlDeviceGetCount(self) -> int: ...
    def nvmlDeviceGetHandleByIndex(self, index: int, /) -> Any: ...
    def nvmlDeviceGetIndex(self, handle: Any, /) -> int: ...
    def nvmlDeviceGetTotalEccErrors(self, handle: Any, error_type: int, counter: int, /) -> int: ...
    def nvmlDeviceGetRetiredPagesPendingStatus(self, handle: Any, /) -> int: ...
    def nvmlDeviceGetRemappedRows(self, handle: Any, /) -> tuple[int, int, int, int]: ...
    def nvmlEventSetCreate(self) -> Any: ...
    def nvmlDeviceRegisterEvents(self, handle: Any, types: int, event_set: Any, /) -> None: ...
    def nvmlEventSetWait(self, event_set: Any, timeout_ms: int, /) -> Any: ...


def load_pynvml() -> HealthNvml:
    import pynvml  # type: ignore[import-untyped]  # nvidia-ml-py ships no types

    module: HealthNvml = pynvml
    return module


@dataclass
class GpuState:
    """What was last seen of one GPU, and its latest fault ("": none yet)."""

    ecc: int | None = None  # uncorrected volatile ECC errors; None: not read
    pending: bool = False  # retired pages pending
    remap_failed: bool = False
    lost: str = ""  # why NVML does not answer for it
    reason: str = ""


def _code(exc: Exception) -> int | None:
    value = getattr(exc, "value", None)
    return value if isinstance(value, int) else None


def _when(t: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))


def xid_fault(xid: int, at: float) -> str | None:
    """The reason a fatal XID gives (its time in it: a second XID 79 after a
    clear is a new fault), or None for one that is not fatal."""
    meaning = FATAL_XIDS.get(xid)
    return None if meaning is None else f"XID {xid}: {meaning} (at {_when(at)})"


def condition_faults(before: GpuState, now: GpuState) -> list[str]:
    """The faults a check shows against the one before: conditions that
    turned bad, and an ECC count that grew."""
    out = []
    if now.lost and now.lost != before.lost:
        out.append(now.lost)
    if now.ecc is not None and now.ecc > (before.ecc or 0):
        out.append(f"{now.ecc} uncorrected ECC errors since the GPU's last reset")
    if now.pending and not before.pending:
        out.append("retired pages pending: the GPU needs a reset")
    if now.remap_failed and not before.remap_failed:
        out.append("row remapping failed: the GPU's memory cannot repair itself")
    return out


class GpuHealth:
    def __init__(self, nvml: Callable[[], HealthNvml], path: Path | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        self._load = nvml
        self._path = path
        self._clock = clock
        self._nvml: HealthNvml | None = None
        self._handles: dict[int, Any] = {}
        self._events: Any = None
        self.gpus: dict[int, GpuState] = self._read()
        # The GPU whose NVML call is running now: the one a stall is blamed on.
        self.checking: int | None = None
        self._failing = False
        # Steps run in a worker thread; `stalled()` and `reasons()` on the
        # event loop.
        self._lock = threading.Lock()

    # --- kept across restarts --------------------------------------------------------

    def _read(self) -> dict[int, GpuState]:
        if self._path is None or not self._path.exists():
            return {}
        try:
            raw = json.loads(self._path.read_text()[:1_000_000])
            return {int(i): GpuState(**v) for i, v in raw.get("gpus", {}).items()}
        except (OSError, ValueError, TypeError, AttributeError) as exc:
            logger.warning("GPU health record %s unreadable (%s): starting afresh",
                           self._path, exc)
            return {}

    def _save(self) -> None:
        if self._path is None:
            return
        tmp = self._path.with_suffix(".tmp")
        try:
            self._path.parent.mkdir(parents=True, exist_ok=True)
            with self._lock:
                kept = {str(i): asdict(g) for i, g in sorted(self.gpus.items())}
            tmp.write_text(json.dumps({"gpus": kept}))
            os.replace(tmp, self._path)
        except OSError as exc:
            logger.warning("GPU health record %s not saved: %s", self._path, exc)

    # --- what the inventory reports --------------------------------------------------

    def reasons(self) -> dict[int, str]:
        """GPU index -> its latest fault, for the GPUs that had one."""
        with self._lock:
            return {i: g.reason for i, g in self.gpus.items() if g.reason}

    def _fault(self, index: int, reason: str) -> None:
        with self._lock:
            gpu = self.gpus.setdefault(index, GpuState())
            if gpu.reason != reason:
                logger.error("GPU %d is unhealthy: %s", index, reason)
                gpu.reason = reason

    # --- one step ----------------------------------------------------------------------

    def _start(self) -> HealthNvml:
        if self._nvml is not None:
            return self._nvml
        nvml = self._load()
        nvml.nvmlInit()  # reference-counted: discovery's init/shutdown leave it up
        try:
            self._events = nvml.nvmlEventSetCreate()
        except nvml.NVMLError as exc:
            logger.warning("XID events not delivered on this node (%s)", exc)
            self._events = None
        for i in range(int(nvml.nvmlDeviceGetCount())):
            try:
                handle = nvml.nvmlDeviceGetHandleByIndex(i)
            except nvml.NVMLError as exc:
                self._observe(nvml, i, None, exc)
                continue
            self._handles[i] = handle
            if self._events is None:
                continue
            try:
                nvml.nvmlDeviceRegisterEvents(handle, XID_CRITICAL_EVENT, self._events)
            except nvml.NVMLError as exc:
                # Not supported on some boards and in some containers: the
                # ECC counts and lost GPUs are still watched.
                logger.warning("GPU %d: XID events not delivered (%s)", i, exc)
        self._nvml = nvml
        return nvml

    def step(self, wait_ms: int) -> bool:
        """Checks each GPU once, then waits up to `wait_ms` for XID events.
        Returns whether a GPU's reason changed. Raises nothing NVML does:
        an NVML that cannot start is tried again next step."""
        before = self.reasons()
        try:
            nvml = self._start()
        except Exception:  # ImportError, NVMLError, OSError: the library's trouble
            # Once per streak with its traceback; then quietly, every step.
            logger.log(logging.DEBUG if self._failing else logging.WARNING,
                       "GPU health: NVML unusable; trying again next step", exc_info=True)
            self._failing = True
            return False
        self._failing = False
        for i, handle in sorted(self._handles.items()):
            self._observe(nvml, i, handle, None)
        self._wait_events(nvml, wait_ms)
        changed = self.reasons() != before
        if changed:
            self._save()
        return changed

    def _observe(self, nvml: HealthNvml, index: int, handle: Any,
                 failed: Exception | None) -> None:
        prev = self.gpus.get(index, GpuState())
        now = GpuState(reason=prev.reason)
        self.checking = index
        try:
            if failed is not None:
                raise failed
            now.ecc = self._optional(nvml, lambda: int(nvml.nvmlDeviceGetTotalEccErrors(
                handle, MEMORY_ERROR_UNCORRECTED, VOLATILE_ECC)), prev.ecc)
            now.pending = bool(self._optional(
                nvml, lambda: int(nvml.nvmlDeviceGetRetiredPagesPendingStatus(handle)),
                int(prev.pending)))
            now.remap_failed = bool(self._optional(
                nvml, lambda: int(nvml.nvmlDeviceGetRemappedRows(handle)[3]),
                int(prev.remap_failed)))
        except nvml.NVMLError as exc:
            code = _code(exc)
            if code == ERROR_GPU_IS_LOST:
                now.lost = f"GPU is lost: NVML cannot reach it ({exc})"
            elif code == ERROR_TIMEOUT:
                now.lost = f"NVML timed out reading the GPU ({exc})"
            else:
                logger.warning("GPU %d: NVML could not read its health (%s)", index, exc)
                now = GpuState(**{**asdict(prev)})
        finally:
            self.checking = None
        with self._lock:
            # A stall reported meanwhile (`stalled()`, from the event loop)
            # is kept: the reason is read again, not taken from before.
            now.reason = self.gpus.get(index, GpuState()).reason
            for reason in condition_faults(prev, now):
                now.reason = f"{reason} (at {_when(self._clock())})"
                logger.error("GPU %d is unhealthy: %s", index, now.reason)
            self.gpus[index] = now

    @staticmethod
    def _optional(nvml: HealthNvml, read: Callable[[], int], last: int | None) -> int | None:
        """A reading, or the last one where the board does not support it
        (no ECC on a consumer board, no row remapping before Ampere)."""
        try:
            return read()
        except nvml.NVMLError as exc:
            if _code(exc) == ERROR_NOT_SUPPORTED:
                return last
            raise

    def _wait_events(self, nvml: HealthNvml, wait_ms: int) -> None:
        if self._events is None:
            time.sleep(wait_ms / 1000)  # the step's pace, without events
            return
        timeout = wait_ms
        for _ in range(MAX_EVENTS_PER_STEP):
            try:
                data = nvml.nvmlEventSetWait(self._events, timeout)
            except nvml.NVMLError as exc:
                if _code(exc) != ERROR_TIMEOUT:
                    logger.warning("GPU health: waiting for XID events failed (%s)", exc)
                    time.sleep(wait_ms / 1000)  # no busy loop on a broken event set
                return
            timeout = 0  # drain what is queued, then check the GPUs again
            if int(data.eventType) != XID_CRITICAL_EVENT:
                continue
            xid = int(data.eventData)
            reason = xid_fault(xid, self._clock())
            if reason is None:
                logger.info("XID %d seen: not one that needs a GPU reset", xid)
                continue
            try:
                index = int(nvml.nvmlDeviceGetIndex(data.device))
            except nvml.NVMLError as exc:
                logger.error("XID %d on a GPU NVML cannot name (%s)", xid, exc)
                continue
            self._fault(index, reason)

    def stalled(self, seconds: float) -> bool:
        """The running step has not returned in `seconds`: the GPU it was
        reading stops answering. Returns whether a reason changed."""
        index = self.checking
        if index is None:
            return False
        reason = f"NVML did not answer within {seconds:g} s reading the GPU"
        with self._lock:
            gpu = self.gpus.setdefault(index, GpuState())
            if gpu.lost == reason:
                return False
            gpu.lost = reason
        self._fault(index, f"{reason} (at {_when(self._clock())})")
        self._save()
        return True
