"""`llmgw serve --workers N`: N processes serving one gateway's port.

The supervisor (the process `llmgw serve` started, holding the pid file)
binds one socket per worker with SO_REUSEPORT, so the kernel spreads new
connections over the workers' sockets, and starts each worker as
`python -m app.cli serve --worker I --listen-fd FD` with that socket. Each
worker is a whole gateway with an id of its own (the first keeps the
gateway's, the others add `-wI`): its own mirror, lease, usage snapshot and
key-share claims, but no floor on client keys' limits (`claim_floors` in
app/gateway/key_shares.py: L + N - 1 over N gateways, not over their
workers); only the first campaigns for the lead. The supervisor
restarts a worker that dies (with backoff), forwards SIGTERM and SIGINT to
all, and ends once all have. docs/design/workers.md.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

from app.gateway import worker_loads, worker_metrics
from app.gateway.accept import bound
from app.gateway.settings import Settings
from app.logs import stop as stop_logging

logger = logging.getLogger(__name__)

# Restart backoff: doubled after each death that came within STEADY seconds
# of its start, up to MAX_BACKOFF; a worker that ran STEADY seconds starts
# again after FIRST_BACKOFF.
FIRST_BACKOFF = 0.5
MAX_BACKOFF = 30.0
STEADY = 60.0
# A worker exiting with this status refused its settings: restarting it
# would refuse them again, so the whole gateway stops (as `llmgw serve` does).
REFUSED = 2
_PR_SET_PDEATHSIG = 1
# Seconds a restarted worker waits for its mirror before its socket listens
# (new connections go to the other workers meanwhile); a first start does
# not wait, as a lone gateway does not (/readyz says "loading").
READY_FIRST = 10.0


class Refused(Exception):
    """What `llmgw serve` prints before exiting 2."""


def count(settings: Settings) -> int:
    """How many workers: LLMGW_WORKERS, else the cores this process may run
    on with etcd and 1 on the embedded store or with the in-process agent.
    Refused: more than one there (one SQLite file, opened exclusively, and
    the in-process agent belong to one process)."""
    if settings.workers is None:
        one = not settings.uses_etcd or settings.local_agent
        return 1 if one else len(os.sched_getaffinity(0))
    if settings.workers > 1 and not settings.uses_etcd:
        raise Refused(
            f"LLMGW_WORKERS={settings.workers} needs etcd (LLMGW_ETCD_ENDPOINTS): the embedded "
            "store and the in-process agent belong to one process; set 1 or unset it")
    if settings.workers > 1 and settings.local_agent:
        raise Refused(f"LLMGW_WORKERS={settings.workers} with LLMGW_LOCAL_AGENT=true: an "
                      "agent runs in one process; set 1, or run `llmgw agent` beside it")
    return settings.workers


def worker_id(gateway_id: str, index: int) -> str:
    """Worker 0 is the gateway (its records, its lead); the others add -wI."""
    return gateway_id if index == 0 else f"{gateway_id}-w{index}"


def die_with_parent(parent: int) -> None:
    """In a worker: SIGKILLed when the supervisor dies, however it dies (a
    SIGKILLed gateway stops at once, its workers with it); exits now if it
    already has."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:
        os._exit(1)


class WorkerTag(logging.Filter):
    """`worker=I` on every line a worker logs."""

    def __init__(self, index: int) -> None:
        super().__init__()
        self.index = index

    def filter(self, record: logging.LogRecord) -> bool:
        if not hasattr(record, "worker"):
            record.worker = self.index
        return True


def tag_logs(index: int) -> None:
    for h in logging.getLogger().handlers:
        h.addFilter(WorkerTag(index))


@dataclass
class Slot:
    index: int
    proc: subprocess.Popen[bytes] | None = None
    started: float = 0.0
    backoff: float = FIRST_BACKOFF
    restart_at: float | None = None


class Supervisor:
    """Starts, restarts and stops the workers of one `llmgw serve`."""

    def __init__(self, settings: Settings, n: int,
                 argv: Callable[[int, int, bool], list[str]]) -> None:
        self.settings, self.n, self._argv = settings, n, argv
        self.slots = [Slot(i) for i in range(n)]
        self.signals: list[int] = []  # caught, not yet forwarded
        self.status = 0

    def _start(self, slot: Slot, sock: socket.socket | None = None) -> None:
        st = self.settings
        restart = sock is None
        if sock is None:
            try:
                sock = bound(st.host, st.port, reuse_port=True)
            except OSError as exc:
                self._later(slot, f"cannot bind {st.host}:{st.port}: {exc.strerror or exc}")
                return
        env = os.environ | {"LLMGW_GATEWAY_ID": worker_id(st.gateway_id, slot.index),
                            "LLMGW_HOST": st.host, "LLMGW_PORT": str(st.port),
                            "LLMGW_PUBLIC_URL": st.public_url, "LLMGW_WORKERS": "1"}
        try:
            # A process group of its own: a terminal's Ctrl-C reaches the
            # supervisor only, which forwards it once.
            slot.proc = subprocess.Popen(self._argv(slot.index, sock.fileno(), restart), env=env,
                                         pass_fds=[sock.fileno()], process_group=0)
        except OSError as exc:  # out of processes or descriptors: later, not the others' end
            self._later(slot, f"could not start: {exc.strerror or exc}")
            return
        finally:
            sock.close()  # the worker's now: it goes with the worker
        slot.started = time.monotonic()
        slot.restart_at = None
        logger.info("worker %d started (pid %d, gateway id %s)", slot.index, slot.proc.pid,
                    worker_id(st.gateway_id, slot.index))

    def _later(self, slot: Slot, why: str) -> None:
        if time.monotonic() - slot.started >= STEADY:
            slot.backoff = FIRST_BACKOFF
        slot.restart_at = time.monotonic() + slot.backoff
        logger.warning("worker %d %s; restarting in %g s", slot.index, why, slot.backoff)
        slot.backoff = min(2 * slot.backoff, MAX_BACKOFF)

    def _on_signal(self, sig: int, _frame: object) -> None:
        self.signals.append(sig)

    def run(self) -> int:
        """Until every worker has stopped after a signal: the signal caught
        (the caller ends the process with it), or 2 when a worker refused
        its settings."""
        # Bound before any worker starts: a taken port is said once, here.
        socks = [bound(self.settings.host, self.settings.port, reuse_port=True)
                 for _ in self.slots]
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_signal)
        for slot, sock in zip(self.slots, socks, strict=True):
            self._start(slot, sock)
        stopping = 0
        while True:
            while self.signals:
                stopping = self.signals.pop(0)
                live = [s for s in self.slots if s.proc is not None]
                logger.info("stopping %d workers (signal %s)", len(live),
                            signal.Signals(stopping).name)
                for s in live:
                    assert s.proc is not None
                    with contextlib.suppress(ProcessLookupError):
                        s.proc.send_signal(signal.SIGTERM)  # a second one: at once
            for slot in self.slots:
                code = slot.proc.poll() if slot.proc is not None else None
                if slot.proc is not None and code is not None:
                    pid, slot.proc = slot.proc.pid, None
                    if stopping:
                        logger.info("worker %d (pid %d) stopped", slot.index, pid)
                        continue
                    if code == REFUSED:
                        logger.error("worker %d (pid %d) refused its settings: stopping",
                                     slot.index, pid)
                        self.status = REFUSED
                        self.signals.append(signal.SIGTERM)
                        continue
                    self._later(slot, f"(pid {pid}) ended "
                                + (f"by signal {signal.Signals(-code).name}" if code < 0
                                   else f"with status {code}"))
                if (not stopping and slot.proc is None and slot.restart_at is not None
                        and time.monotonic() >= slot.restart_at):
                    self._start(slot)
            if stopping and all(s.proc is None for s in self.slots):
                return stopping
            time.sleep(0.05)


def worker_argv(args: list[str], index: int, fd: int, restart: bool, n: int) -> list[str]:
    """The command line of worker `index` of `n` on descriptor `fd`."""
    return [sys.executable, "-m", "app.cli", *args, "serve", "--worker", str(index),
            "--of", str(n), "--listen-fd", str(fd), "--supervisor", str(os.getpid()),
            *(["--restart"] if restart else [])]


def supervise(level: str, fmt: str, settings: Settings, n: int,
              stopped: Callable[[], None]) -> None:
    """`llmgw serve` with N workers on one port; ends as `llmgw serve` does:
    killed by the signal that stopped it, once every worker has stopped
    (`stopped()` first: the pid file goes with a clean stop)."""
    log = ["--log-level", level, "--log-format", fmt]
    sup = Supervisor(settings, n, lambda i, fd, again: worker_argv(log, i, fd, again, n))
    try:
        # The workers' folders made 0700, or checked: one that is a link or
        # another user's is refused here, before any worker starts
        # (app/gateway/private_files.py). Emptied: an earlier run's figures
        # are not summed, nor its engine loads read.
        worker_metrics.clear(settings.data_dir)
        worker_loads.clear(settings.data_dir)
    except OSError as exc:  # Refused says its path; others name theirs
        print(f"llmgw serve: {exc}", file=sys.stderr)
        raise SystemExit(REFUSED) from None
    logger.info("gateway %s: %d workers on port %d", settings.gateway_id, n, settings.port)
    try:
        sig = sup.run()
    except OSError as exc:
        print(f"llmgw serve: cannot bind {settings.host}:{settings.port}: "
              f"{exc.strerror or exc}", file=sys.stderr)
        raise SystemExit(REFUSED) from None
    stopped()
    if sup.status:
        raise SystemExit(sup.status)
    stop_logging()
    signal.signal(sig, signal.SIG_DFL)
    os.kill(os.getpid(), sig)
