"""The processes bench/affinity.py starts: an etcd of its own, gateways in
cluster mode on it, and one agent whose four vLLM stand-ins
(tests/fakes/bin/vllm, run as a program, never imported) keep a prefix cache.
Each process runs in a session of its own; `stop()` ends them by id.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import subprocess
import sys
import time
import urllib.error
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from peers import etcd_argv, free_port
from peers import http as peers_http

ROOT = Path(__file__).resolve().parents[1]
FAKE_VLLM = ROOT / "tests" / "fakes" / "bin" / "vllm"
MODEL = "chat"


def http(method: str, url: str, body: Any = None, token: str = "",
         timeout: float = 5.0) -> tuple[int, Any]:
    """peers.http, with a connection that fails answered as status 0."""
    try:
        return peers_http(method, url, body, token, timeout)
    except (urllib.error.URLError, OSError) as exc:
        return 0, str(exc)


def wait_for(pred: Callable[[], Any], timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = pred()
        if got:
            return got
        time.sleep(0.2)
    raise TimeoutError(f"{what}: not within {timeout} s")


@dataclass
class Proc:
    name: str
    args: list[str]
    log: Path
    env: dict[str, str] = field(default_factory=dict)
    popen: subprocess.Popen[bytes] | None = None

    def start(self) -> Proc:
        with open(self.log, "ab") as out:
            self.popen = subprocess.Popen(
                self.args, cwd=ROOT, env=self.env or None, stdout=out,
                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        return self

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.popen is not None and self.popen.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.popen.pid, sig)

    def stop(self) -> None:
        if self.popen is None:
            return
        self.kill(signal.SIGTERM)
        try:
            self.popen.wait(20)
        except subprocess.TimeoutExpired:
            self.kill()
            self.popen.wait(5)


@dataclass
class Gateway:
    name: str
    url: str
    proc: Proc


class Fleet:
    """etcd, gateways (`affinity` says which route with prompt affinity),
    one agent with four GPUs, and the model `chat` at four replicas."""

    def __init__(self, tmp: Path, engine_env: dict[str, str]) -> None:
        self.tmp = tmp
        self.engine_env = engine_env
        self.secret = "bench-secret-" + secrets.token_hex(16)
        self.admin = "bench-admin-" + secrets.token_hex(16)
        self.procs: list[Proc] = []
        self.gateways: list[Gateway] = []
        self.key = ""
        self.etcd = ""

    def base_env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("LLMGW_")}
        return env | {"LLMGW_SECRET": self.secret, "LLMGW_ADMIN_TOKEN": self.admin,
                      "LLMGW_LOG_LEVEL": "warning", "PYTHONUNBUFFERED": "1"}

    def start_etcd(self) -> None:
        argv, self.etcd = etcd_argv(self.tmp / "etcd")
        self.procs.append(Proc("etcd", argv, self.tmp / "etcd.log").start())

    def start_gateway(self, name: str, affinity: bool) -> Gateway:
        port = free_port()
        env = self.base_env() | {
            "LLMGW_ETCD_ENDPOINTS": self.etcd, "LLMGW_PORT": str(port),
            "LLMGW_GATEWAY_ID": name, "LLMGW_WORKERS": "1", "LLMGW_DATA_DIR": str(self.tmp / name),
            "LLMGW_ROUTER_AFFINITY": "true" if affinity else "false"}
        proc = Proc(name, [sys.executable, "-m", "app.cli", "serve"],
                    self.tmp / f"{name}.log", env).start()
        self.procs.append(proc)
        gw = Gateway(name, f"http://127.0.0.1:{port}", proc)
        wait_for(lambda: http("GET", gw.url + "/readyz")[0] == 200, 60, f"{name} ready")
        self.gateways.append(gw)
        return gw

    def start_agent(self) -> None:
        from app.wire.tokens import node_token

        env = self.base_env() | {"LLMGW_AGENT_TOKEN": node_token(self.secret, "node-1"),
                                 "LLMGW_VLLM_BIN": str(FAKE_VLLM),
                                 "FAKE_VLLM_PYTHON": sys.executable} | self.engine_env
        env.pop("LLMGW_SECRET")
        self.procs.append(Proc("agent", [
            sys.executable, "-m", "app.cli", "agent", "--node", "node-1", "--gpus", "4",
            "--gateway", ",".join(g.url for g in self.gateways),
            "--work-dir", str(self.tmp / "agent"), "--stop-engines-on-exit"],
            self.tmp / "agent.log", env).start())

    def serve_model(self, max_num_seqs: int) -> list[str]:
        """Puts `chat` at four replicas and waits until every gateway routes
        to all four with their engine loads; returns the replica ids."""
        url = self.gateways[0].url
        spec = {"model": "acme/chat", "replicas": {"min": 4, "max": 4}, "profiles": [
            {"gpus": 1, "engine_args": [f"--max-num-seqs={max_num_seqs}"]}]}
        status, body = http("PUT", f"{url}/admin/models/{MODEL}", spec, self.admin)
        if status not in (200, 201):
            raise RuntimeError(f"PUT model: {status} {body}")
        status, body = http("POST", url + "/admin/keys", {"name": "bench"}, self.admin)
        if status != 201:
            raise RuntimeError(f"POST key: {status} {body}")
        self.key = str(body["key"])

        def routed(gw: Gateway) -> list[str]:
            status, body = http("GET", f"{gw.url}/admin/routes?model={MODEL}", token=self.admin)
            rows = body["endpoints"] if status == 200 else []
            ok = len(rows) == 4 and all(r["engine"] for r in rows)
            return sorted(r["replica"] for r in rows) if ok else []

        wait_for(lambda: all(routed(g) for g in self.gateways), 120,
                 "every gateway routing to four replicas")
        return routed(self.gateways[0])

    def stop(self) -> None:
        for p in reversed(self.procs):
            p.stop()
