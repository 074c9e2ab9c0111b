"""A throwaway etcd: one member (or a cluster) on free loopback ports.

Benchmarks (bench/control_scale.py) start it directly; tests through
tests/support/etcd.py (fixtures, skips, the shared etcd's guard), which
imports it from here. It imports neither pytest nor anything of tests/, so a
benchmark runs without tests/ and where pytest is not installed
(tests/test_bench_imports.py).
"""

from __future__ import annotations

import json
import logging
import shutil
import signal
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

_TREE = str(Path(__file__).resolve().parents[1])
if _TREE not in sys.path:  # run from bench/
    sys.path.insert(0, _TREE)

from app.ports import free_port as free_port  # noqa: E402  # tests import it from here

logger = logging.getLogger(__name__)

# A single member on loopback is healthy in under a second (restart on an
# existing data dir: under 2 s, measured on 2 cores); 10 s leaves room
# for a loaded CI machine without letting a broken etcd stall the suite.
START_TIMEOUT_S = 10.0
STOP_TIMEOUT_S = 5.0


def find_etcd_binary() -> str | None:
    found = shutil.which("etcd")
    if found:
        return found
    return "/usr/bin/etcd" if Path("/usr/bin/etcd").exists() else None


def _wait_stopped(pid: int, timeout: float = 2.0) -> None:
    """Returns once every thread of `pid` is stopped. SIGSTOP is delivered to
    each thread as it next leaves the kernel: a thread on another core can
    still answer a request sent in the meantime, which made a test's call to
    a paused etcd succeed now and then."""
    deadline = time.monotonic() + timeout
    tasks = Path(f"/proc/{pid}/task")
    while time.monotonic() < deadline:
        try:
            states = [(t / "stat").read_text().rsplit(")", 1)[1].split()[0]
                      for t in tasks.iterdir()]
        except (OSError, IndexError):
            return  # gone, or not Linux: nothing more to wait for
        if all(state in ("T", "t") for state in states):
            return
        time.sleep(0.005)


@dataclass(frozen=True)
class EtcdTlsFiles:
    """PEM files for an etcd serving its clients over TLS: its own `cert`
    and `key`, and `ca`, the only issuer of client certificates it accepts
    (--client-cert-auth). `client_cert`/`client_key` are what the health
    probe presents."""

    ca: Path
    cert: Path
    key: Path
    client_cert: Path
    client_key: Path

    def flags(self) -> list[str]:
        return ["--cert-file", str(self.cert), "--key-file", str(self.key),
                "--trusted-ca-file", str(self.ca), "--client-cert-auth"]

    def probe_context(self) -> ssl.SSLContext:
        ctx = ssl.create_default_context(cafile=str(self.ca))
        ctx.load_cert_chain(self.client_cert, self.client_key)
        # The probe only waits for etcd to be up, dialling its address; a
        # test may give it a certificate for another name on purpose.
        ctx.check_hostname = False
        return ctx


class EtcdServer:
    """One etcd member on a loopback `host` ("127.0.0.1" or "::1").
    `endpoint` is "127.0.0.1:P" (or "[::1]:P") for the store's client, or
    "https://127.0.0.1:P" when it serves clients over TLS (`tls`)."""

    def __init__(self, binary: str, data_dir: Path, host: str = "127.0.0.1",
                 tls: EtcdTlsFiles | None = None, flags: Sequence[str] = ()) -> None:
        self.binary = binary
        # More of etcd's own flags (a tiny --quota-backend-bytes, say).
        self.flags = list(flags)
        self.data_dir = data_dir
        self.client_port = free_port(host)
        self.peer_port = free_port(host)
        self.name = f"llmgw-test-{self.client_port}"
        self._host = f"[{host}]" if ":" in host else host
        self.tls = tls
        self._client_url = f"{'https' if tls else 'http'}://{self._host}:{self.client_port}"
        self.endpoint = self._client_url if tls else f"{self._host}:{self.client_port}"
        self.external = False
        # Set by EtcdCluster for a member of several; alone, a cluster of one.
        self.initial_cluster = f"{self.name}=http://{self._host}:{self.peer_port}"
        self._proc: subprocess.Popen[bytes] | None = None
        self._log_path = data_dir.parent / f"{self.name}.log"

    def _command(self) -> list[str]:
        client = self._client_url
        peer = f"http://{self._host}:{self.peer_port}"
        return [
            self.binary,
            "--name", self.name,
            "--data-dir", str(self.data_dir),
            "--listen-client-urls", client,
            "--advertise-client-urls", client,
            "--listen-peer-urls", peer,
            "--initial-advertise-peer-urls", peer,
            "--initial-cluster", self.initial_cluster,
            # Tests do not survive power loss; fsync would only slow them.
            "--unsafe-no-fsync",
            *(self.tls.flags() if self.tls else []),
            *self.flags,
        ]  # fmt: skip

    def start(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            return
        self.launch()
        self._wait_healthy()

    def launch(self) -> None:
        """Starts the process without waiting: a member of several is healthy
        only once enough of the others run too."""
        self._log_path.parent.mkdir(parents=True, exist_ok=True)
        log = self._log_path.open("ab")
        try:
            self._proc = subprocess.Popen(
                self._command(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        finally:
            log.close()  # the child keeps its own descriptor

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        url = f"{self._client_url}/health"
        context = self.tls.probe_context() if self.tls else None
        while time.monotonic() < deadline:
            assert self._proc is not None
            if self._proc.poll() is not None:
                raise RuntimeError(f"etcd exited with {self._proc.returncode}: {self.log_tail()}")
            try:
                with urllib.request.urlopen(url, timeout=1.0, context=context) as resp:
                    if resp.status == 200 and b'"true"' in resp.read():
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"etcd not healthy after {START_TIMEOUT_S}s: {self.log_tail()}")

    def pause(self) -> None:
        """SIGSTOP: etcd keeps its sockets open but answers nothing, like a hung
        or partitioned member. Calls must time out rather than fail fast."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.send_signal(signal.SIGSTOP)
            _wait_stopped(self._proc.pid)

    def resume(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.send_signal(signal.SIGCONT)

    def stop(self) -> None:
        """SIGTERM, then SIGKILL if it lingers (an etcd without quorum ignores SIGTERM)."""
        proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGCONT)  # a paused etcd would hold SIGTERM pending
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            logger.warning("etcd %s ignored SIGTERM; killing it", self.name)
            proc.kill()
            proc.wait(timeout=STOP_TIMEOUT_S)

    def kill(self) -> None:
        """SIGKILL, at once: etcd sends nothing more (no graceful shutdown that
        could still flush a pending watch response). The data dir survives."""
        proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.kill()
        proc.wait(timeout=STOP_TIMEOUT_S)

    def restart(self) -> None:
        """Stop and start on the same ports and data dir: the data survives."""
        self.stop()
        self.start()

    def log_tail(self, lines: int = 20) -> str:
        try:
            text = self._log_path.read_text(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])


class EtcdCluster:
    """Several members on loopback, for failover tests."""

    def __init__(self, binary: str, root: Path, size: int = 3) -> None:
        self.members = [EtcdServer(binary, root / f"member-{i}" / "data") for i in range(size)]
        initial = ",".join(m.initial_cluster for m in self.members)
        for m in self.members:
            m.initial_cluster = initial

    @property
    def endpoints(self) -> str:
        return ",".join(m.endpoint for m in self.members)

    def start(self) -> None:
        for m in self.members:
            m.launch()
        for m in self.members:
            m._wait_healthy()

    def leader(self) -> EtcdServer:
        """The member etcd's Raft elected, asked through its HTTP gateway."""
        for m in self.members:
            req = urllib.request.Request(
                f"http://{m.endpoint}/v3/maintenance/status", data=b"{}", method="POST")
            try:
                with urllib.request.urlopen(req, timeout=2.0) as resp:
                    status = json.loads(resp.read())
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                continue
            if status.get("leader") == status["header"]["member_id"]:
                return m
        raise RuntimeError("no etcd member says it leads")

    def stop(self) -> None:
        for m in self.members:
            m.stop()
