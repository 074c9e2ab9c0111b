"""Real gateway and agent processes for tests, as an operator would run them.

Each process runs `python -m app.cli ...` in its own session so that a test
can SIGKILL or SIGTERM it, and teardown kills whatever it left. Engines run in
sessions of their own (app/agent/engines.py): they are found by a tag in
their environment, inherited from the agent or gateway that started them.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import os
import signal
import ssl
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from app.agent.engines import sweep_gone
from app.ports import free_port as free_port  # the tests' one picker

ROOT = Path(__file__).resolve().parents[2]
FAKE_BIN = ROOT / "tests" / "fakes" / "bin"
SECRET = "test-secret-0123456789abcdef"
ADMIN = "test-admin-token-0123456789"


TAG = "TESTS_PROC_TAG"


def kill_tagged(tag: str) -> None:
    """SIGKILLs every process whose environment holds `tag` (NAME=VALUE),
    and every process of their sessions: real vLLM's workers retitle
    themselves (VLLM::EngineCore), which overwrites the memory
    /proc/PID/environ reads, so only their session (the engine's, started
    in one of its own) still names them."""
    needle, mine = tag.encode(), os.getsid(0)
    sessions = set()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            env = (proc / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if needle in env:
            with contextlib.suppress(ProcessLookupError):
                sessions.add(os.getsid(int(proc.name)))
                os.kill(int(proc.name), signal.SIGKILL)
    sessions.discard(mine)
    if not sessions:
        return
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit() and int(proc.name) != os.getpid():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                if os.getsid(int(proc.name)) in sessions:
                    os.kill(int(proc.name), signal.SIGKILL)


def wait_for(pred: Callable[[], Any], timeout: float, what: str, interval: float = 0.05) -> Any:
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = pred()
            if last:
                return last
        except (httpx.HTTPError, OSError) as exc:
            last = exc
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout} s waiting for {what} (last: {last!r})")


async def until(pred: Callable[[], Any], what: str, timeout: float = 10.0) -> None:
    """`wait_for` for in-process tests: polls `pred` on the running loop."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not pred():
        assert loop.time() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)


@contextlib.contextmanager
def outside_provider(log: Path, **env: str) -> Iterator[str]:
    """The vLLM stand-in as an outside provider serving "other-model" and
    demanding key sk-good, `env` added to its environment, its output in
    `log`; yields its URL once it is healthy, and kills it after."""
    port = free_port()
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, str(ROOT / "tests/fakes/fake_vllm.py"), "serve", "other-model",
             "--host", "127.0.0.1", "--port", str(port), "--api-key", "sk-good"],
            stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env=os.environ | env)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: httpx.get(url + "/health", timeout=1).status_code == 200,
                 10, "the provider")
        yield url
    finally:
        proc.kill()
        proc.wait(5)


@dataclass
class Proc:
    name: str
    args: list[str]
    env: dict[str, str]
    log: Path
    popen: subprocess.Popen[bytes] | None = None

    @property
    def tag(self) -> str:
        """In the environment of this process and of every engine it starts."""
        return f"{TAG}={self.log}"

    def start(self) -> Proc:
        env = self.env | dict([self.tag.split("=", 1)])
        with open(self.log, "ab") as out:
            self.popen = subprocess.Popen(
                [sys.executable, "-m", "app.cli", *self.args], cwd=ROOT, env=env,
                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        return self

    def signal(self, sig: int) -> None:
        assert self.popen is not None
        with contextlib.suppress(ProcessLookupError):
            if sig == signal.SIGKILL:
                os.killpg(self.popen.pid, sig)
                kill_tagged(self.tag)  # engines too, as a node crash would
            else:
                self.popen.send_signal(sig)

    def wait(self, timeout: float) -> int:
        assert self.popen is not None
        return self.popen.wait(timeout)

    def kill_alone(self) -> None:
        """SIGKILL for this process only: its children (engines) live on."""
        assert self.popen is not None
        self.popen.kill()
        self.popen.wait(5)

    def kill(self) -> None:
        if self.popen is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.popen.pid, signal.SIGKILL)
        kill_tagged(self.tag)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(5)

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def logged(self, text: str, timeout: float = 5.0) -> str:
        """The output once it holds `text`. A process's log lines reach its
        file in batches, a writer thread's every 50 ms (app/logs.py): a
        line an event was logged with can come after the event is seen
        through the API."""
        def holding() -> str | None:
            out = self.output()
            return out if text in out else None
        found: str = wait_for(holding, timeout, f"{text!r} in {self.name}'s output")
        return found


@dataclass
class GatewayProc(Proc):
    port: int = 0
    gateway_id: str = ""
    # "https" with LLMGW_TLS_CERT_FILE; `verify` then trusts the test CA.
    scheme: str = "http"
    verify: ssl.SSLContext | bool = True

    @property
    def url(self) -> str:
        return f"{self.scheme}://127.0.0.1:{self.port}"

    def admin(self) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=10, verify=self.verify,
                            headers={"Authorization": f"Bearer {ADMIN}"})

    def leader(self) -> dict[str, Any]:
        with self.admin() as c:
            r = c.get("/admin/leader")
            r.raise_for_status()
            return dict(r.json())


@dataclass
class Cluster:
    """Gateways (and agents) under one tmp dir, all killed at teardown."""

    tmp: Path
    etcd: str | None
    prefix: str
    procs: list[Proc] = field(default_factory=list)
    ttl: int = 10

    def base_env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("LLMGW_")}
        env.update({"LLMGW_SECRET": SECRET, "LLMGW_ADMIN_TOKEN": ADMIN,
                    "PYTHONUNBUFFERED": "1", "LLMGW_LOG_LEVEL": "info",
                    # One process, which tests signal and whose id and log
                    # they read, unless a test asks for workers=N
                    # (tests/test_workers.py).
                    "LLMGW_WORKERS": "1"})
        env["PATH"] = f"{FAKE_BIN}{os.pathsep}{env.get('PATH', '')}"
        env["FAKE_VLLM_PYTHON"] = sys.executable  # the fake needs this venv's aiohttp
        return env

    def gateway(self, name: str, ca: str | None = None, ready_within: float = 20,
                **settings: str) -> GatewayProc:
        """A gateway process, ready. With `tls_cert_file` (and `tls_key_file`)
        among the settings it serves https, verified against `ca` (a PEM file)."""
        port = free_port()
        env = self.base_env()
        env.update({"LLMGW_PORT": str(port), "LLMGW_GATEWAY_ID": name,
                    "LLMGW_LEASE_TTL": str(self.ttl),
                    "LLMGW_DATA_DIR": str(self.tmp / name)})
        if self.etcd:
            env.update({"LLMGW_ETCD_ENDPOINTS": self.etcd, "LLMGW_ETCD_PREFIX": self.prefix})
        env.update({f"LLMGW_{k.upper()}": v for k, v in settings.items()})
        tls = "tls_cert_file" in settings
        gw = GatewayProc(name, ["serve"], env, self.tmp / f"{name}.log", port=port,
                         gateway_id=name, scheme="https" if tls else "http",
                         verify=ssl.create_default_context(cafile=ca) if tls and ca else True)
        gw.start()
        self.procs.append(gw)
        wait_for(lambda: httpx.get(gw.url + "/readyz", timeout=1,
                                   verify=gw.verify).status_code == 200,
                 ready_within, f"gateway {name} ready")
        return gw

    def agent(self, node: str, gateways: list[GatewayProc], *extra: str,
              env_extra: dict[str, str] | None = None) -> Proc:
        from app.wire.tokens import node_token

        env = self.base_env() | (env_extra or {})
        env.pop("LLMGW_SECRET")
        env["LLMGW_AGENT_TOKEN"] = node_token(SECRET, node)
        args = ["agent", "--gateway", ",".join(g.url for g in gateways), "--node", node,
                "--work-dir", str(self.tmp / f"agent-{node}"), *extra]
        proc = Proc(f"agent-{node}", args, env, self.tmp / f"agent-{node}.log").start()
        self.procs.append(proc)
        return proc

    def close(self) -> None:
        for p in reversed(self.procs):
            p.kill()
        # Killed with their agents (in-process ones too), engines leave their
        # sockets' folders, as on a node that crashed: removed as the agents'
        # next start would.
        sweep_gone(self.tmp, 5)


def make_key(gw: GatewayProc, name: str = "tests") -> str:
    with gw.admin() as admin:
        r = admin.post("/admin/keys", json={"name": name})
        assert r.status_code == 201, r.text
        return str(r.json()["key"])


def replicas(gw: GatewayProc) -> list[dict[str, Any]]:
    with gw.admin() as admin:
        r = admin.get("/admin/replicas")
        r.raise_for_status()
        return list(r.json())


def put_model(gw: GatewayProc, name: str, spec: dict[str, Any]) -> None:
    with gw.admin() as admin:
        r = admin.put(f"/admin/models/{name}", json=spec)
        assert r.status_code in (200, 201), r.text


def wait_ready(gw: GatewayProc, timeout: float = 30) -> dict[str, Any]:
    """The first ready replica, as /admin/replicas shows it."""
    ready = wait_for(lambda: [r for r in replicas(gw) if r["phase"] == "ready"],
                     timeout, "a ready replica")
    return dict(ready[0])


def routes(gw: GatewayProc, key: str, model: str) -> bool:
    """Whether `gw` answers a chat completion for `model` (False on 503).
    Two tokens at most: a real engine would otherwise write to its context's
    end (seconds on a CPU)."""
    r = httpx.post(gw.url + "/v1/chat/completions", timeout=10, verify=gw.verify,
                   headers={"Authorization": f"Bearer {key}"},
                   json={"model": model, "messages": [{"role": "user", "content": "hi"}],
                         "max_tokens": 2})
    if r.status_code == 503:
        return False
    assert r.status_code == 200, r.text
    return True


def engine_pids(flag: str, value: str) -> list[int]:
    """Pids of live processes whose command line has `flag value` (e.g. --port 8123)."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            args = (proc / "cmdline").read_bytes().split(b"\0")
            state = (proc / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        pairs = itertools.pairwise(args)
        if state != "Z" and any(a == flag.encode() and b == value.encode() for a, b in pairs):
            found.append(int(proc.name))
    return found


def engine_pid(url: str) -> int:
    """The pid of the engine serving `url` (found by its --port argument)."""
    pids = engine_pids("--port", url.rsplit(":", 1)[1])
    assert len(pids) == 1, f"expected one engine serving {url}, found {pids}"
    return pids[0]


def kill_engine(url: str) -> int:
    """SIGKILLs the engine serving `url`; returns its pid."""
    pid = engine_pid(url)
    os.kill(pid, signal.SIGKILL)
    return pid


@dataclass
class Served:
    """One model served through one gateway: what a restart test starts from."""

    key: str
    replica: dict[str, Any]
    pid: int  # the engine's


def serve_one(gw: GatewayProc, model: str = "m", timeout: float = 30) -> Served:
    """Puts `model` (one GPU, fake vLLM weights) in the catalog and waits
    until `gw` routes to its ready replica."""
    key = make_key(gw)
    put_model(gw, model, {"model": "acme/m", "gpus": 1})
    rep = wait_ready(gw, timeout)
    wait_for(lambda: routes(gw, key, model), 10, "routing")
    return Served(key, rep, engine_pid(rep["url"]))


def restart_gateway(cluster: Cluster, gw: GatewayProc, key: str, model: str = "chat",
                    **env: str | None) -> GatewayProc:
    """Stops `gw` cleanly and starts it again on its port with `env` changed
    (None: unset), as an operator's rolling restart does; returns once it
    routes `key`'s requests for `model`."""
    gw.signal(signal.SIGTERM)
    gw.wait(30)
    changed = {k: v for k, v in gw.env.items() if env.get(k, "") is not None}
    changed.update({k: v for k, v in env.items() if v is not None})
    new = dataclasses.replace(gw, env=changed, popen=None)
    new.start()
    cluster.procs.append(new)
    wait_for(lambda: httpx.get(new.url + "/readyz", timeout=1).status_code == 200,
             20, f"gateway {new.name} ready again")
    wait_for(lambda: routes(new, key, model), 10, f"{new.name} routing again")
    return new
