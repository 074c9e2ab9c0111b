"""DATA_DIR/llmgw.pid: the running gateway's pid, and `llmgw stop`.

The gateway holds an exclusive lock (flock) on the file for as long as it
runs; the kernel drops it when the process dies, however it dies. So "a
gateway runs on this data dir" is "the file's lock is held", never "the pid
in the file is alive": a file left by a killed gateway names a pid that may
belong to another process by then, and nothing signals it. The descriptor is
not inherited by engines (Python opens it non-inheritable), so an engine
that outlives its gateway holds no lock.
"""

from __future__ import annotations

import fcntl
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

NAME = "llmgw.pid"


class AlreadyRunning(Exception):
    def __init__(self, pid: int | None) -> None:
        super().__init__(pid)
        self.pid = pid


def _read_pid(fd: int) -> int | None:
    os.lseek(fd, 0, os.SEEK_SET)
    text = os.read(fd, 32).decode(errors="replace").strip()
    return int(text) if text.isdigit() else None


def hold(data_dir: Path) -> Held:
    """Locks and writes DATA_DIR/llmgw.pid, kept open while the gateway
    runs. AlreadyRunning when another process holds it."""
    data_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(data_dir / NAME, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        pid = _read_pid(fd)
        os.close(fd)
        raise AlreadyRunning(pid) from None
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()}\n".encode())
    return Held(data_dir, fd)


class Held:
    """The locked file of a running gateway."""

    def __init__(self, data_dir: Path, fd: int) -> None:
        self.data_dir, self._fd = data_dir, fd

    def release(self) -> None:
        """At a clean exit: the file goes, then the lock. Once."""
        if self._fd < 0:
            return
        try:
            os.unlink(self.data_dir / NAME)
        except FileNotFoundError:
            pass
        os.close(self._fd)
        self._fd = -1


def running(data_dir: Path) -> int | None:
    """The pid of the gateway running on `data_dir`, None when none runs.
    (A gateway starting during this check's instant takes the lock a moment
    later: it may be refused then, and says so.)"""
    try:
        fd = os.open(data_dir / NAME, os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        for _ in range(20):
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                pid = _read_pid(fd)
                if pid is not None:
                    return pid
                time.sleep(0.05)  # locked, pid not written yet: the gateway is starting
                continue
            return None  # nobody holds it: a file left by a killed gateway
        return None
    finally:
        os.close(fd)


def stop(data_dir: Path, timeout: float, say: Callable[[str], None],
         sleep: Callable[[float], None] = time.sleep,
         clock: Callable[[], float] = time.monotonic) -> int:
    """SIGTERM to the gateway on `data_dir`, then waits for it to exit.
    Exit status: 0 stopped, 1 none running or still running at `timeout`."""
    pid = running(data_dir)
    if pid is None:
        say(f"llmgw stop: no gateway is running on {data_dir} (no {NAME} held)")
        return 1
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        say(f"llmgw stop: the gateway (pid {pid}) had already exited")
        return 0
    started = clock()
    print(f"sent SIGTERM to the gateway (pid {pid}) on {data_dir}; waiting up to "
          f"{timeout:g} s for it to stop", flush=True)
    while running(data_dir) == pid:
        if clock() - started >= timeout:
            say(f"llmgw stop: the gateway (pid {pid}) is still running after {timeout:g} s "
                "(open requests have LLMGW_SHUTDOWN_GRACE_SECONDS to end); run `llmgw stop` "
                "again to stop it at once (a second SIGTERM cuts what is open)")
            return 1
        sleep(0.1)
    print(f"stopped the gateway (pid {pid}) after {clock() - started:.1f} s", flush=True)
    return 0
