"""The processes bench/router_overhead.py starts: llmgw in cluster mode (etcd,
a gateway, an agent that starts the stand-in as its vLLM), and the proxies it
is measured beside. Each runs in a session of its own, pinned with taskset,
and `stop()` kills its whole process group by id.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"
if str(ROOT) not in sys.path:  # whichever script imported this first
    sys.path.insert(0, str(ROOT))

from app.ports import free_port as free_port  # noqa: E402  # the rigs' one picker

MODEL = "bench-chat"


def interpreter(python: str | None = None, tree: Path | None = None) -> str:
    """The CPython a Python proxy runs on: its version and the executable a
    venv was made from, which tells how it was built (docs/design/hot-path.md,
    "The interpreter": a build without PGO and LTO costs 14-32% more CPU a
    request)."""
    # The router too (docs/design/hot-path.md, "The router compiled"), as
    # `tree` runs it on that interpreter (by default the tree the venv
    # lies in): compiled or pure Python, why.
    if tree is None:
        tree = Path(python).parent.parent.parent if python else ROOT
    out = subprocess.run(
        [python or sys.executable, "-c",
         "import sys, platform; print(platform.python_implementation(), "
         "platform.python_version(), getattr(sys, '_base_executable', sys.executable))\n"
         "try:\n    from app import compiled; print(compiled.state())\n"
         "except ImportError:\n    print('pure Python (no app.compiled)')"],
        capture_output=True, text=True, timeout=30, cwd=tree)
    first, _, router = out.stdout.partition("\n")
    impl, version, base = (first.split() + ["?"] * 3)[:3]
    home = str(Path.home())
    if base.startswith(home + "/"):  # no path of this machine in RESULTS
        base = "~" + base[len(home):]
    return f"{impl} {version} ({base}), router {router.strip() or '?'}"


class Unavailable(Exception):
    """A peer that cannot run here (not installed, or it did not come up)."""


def etcd_argv(data_dir: Path) -> tuple[list[str], str]:
    """A throwaway one-member etcd on free loopback ports, for a `Process`:
    its command line and its client endpoint (host:port)."""
    etcd = shutil.which("etcd") or "/usr/bin/etcd"
    cport, pport = free_port(), free_port()
    client, peer = f"http://127.0.0.1:{cport}", f"http://127.0.0.1:{pport}"
    return [etcd, "--name", "bench", "--data-dir", str(data_dir),
            "--listen-client-urls", client, "--advertise-client-urls", client,
            "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
            "--initial-cluster", f"bench={peer}", "--unsafe-no-fsync",
            "--log-level", "warn"], f"127.0.0.1:{cport}"


def http(method: str, url: str, body: Any = None, token: str = "",
         timeout: float = 5.0) -> tuple[int, Any]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method)
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    if data is not None:
        req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            raw = resp.read()
            return resp.status, json.loads(raw) if raw else None
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(errors="replace")


def wait_for(pred: Callable[[], Any], timeout: float, what: str,
             alive: Callable[[], bool] = lambda: True) -> Any:
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        if not alive():
            raise Unavailable(f"exited while waiting for {what}")
        try:
            last = pred()
            if last:
                return last
        except (OSError, ValueError) as exc:
            last = exc
        time.sleep(0.1)
    raise Unavailable(f"timed out after {timeout:.0f} s waiting for {what} (last: {last!r})")


def chat_ok(url: str, token: str, model: str = MODEL) -> bool:
    status, _ = http("POST", url + "/v1/chat/completions", {
        "model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
    }, token)
    return status == 200


def pinned(core: int | None, argv: list[str]) -> list[str]:
    return argv if core is None else ["taskset", "-c", str(core), *argv]


@dataclass
class Process:
    """One child in a session of its own; its log in the run's temp dir."""

    name: str
    argv: list[str]
    log: Path
    env: dict[str, str] = field(default_factory=lambda: dict(os.environ))
    popen: subprocess.Popen[bytes] | None = None
    cwd: Path = ROOT  # a tree of llmgw: `python -m app.cli` there runs its code

    def start(self) -> Process:
        with open(self.log, "ab") as out:
            self.popen = subprocess.Popen(
                self.argv, cwd=self.cwd, env=self.env, stdout=out, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, start_new_session=True)
        return self

    @property
    def pid(self) -> int:
        assert self.popen is not None
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def stop(self) -> None:
        if self.popen is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.popen.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(3)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.popen.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(5)
        self.popen = None

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-1500:] if self.log.exists() else ""


def pid_with_port(port: int) -> int | None:
    """The live process whose command line has `--port PORT` (the agent's engine)."""
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            args = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if any(a == b"--port" and b == str(port).encode()
               for a, b in itertools.pairwise(args)):
            return int(proc.name)
    return None


class Llmgw:
    """etcd + `llmgw serve` (cluster mode) + `llmgw agent`, which starts the
    stand-in as its engine: the real path, engine key and client key included.
    `tree`: the llmgw its processes run (another checkout, for a before and
    after), this one by default."""

    def __init__(self, tmp: Path, proxy_core: int | None, other_core: int | None,
                 gateway_env: dict[str, str] | None = None, python: str | None = None,
                 tree: Path = ROOT) -> None:
        self.tmp = tmp
        self.tree = tree.resolve()
        # The gateway's interpreter (a venv's python holding llmgw's
        # dependencies); the agent and the stand-in run on this one.
        self.python = python or sys.executable
        self.gateway_env = gateway_env or {}
        self.proxy_core, self.other_core = proxy_core, other_core
        self.secret = "bench-secret-" + secrets.token_hex(16)
        self.admin = "bench-admin-" + secrets.token_hex(16)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.procs: list[Process] = []
        self.engine_pid: int | None = None
        self.engine_url = ""
        self.engine_key = ""
        self.client_key = ""
        self._gw_env: dict[str, str] = {}  # the gateway's, for a second one (start_granian)

    @property
    def gateway(self) -> Process:
        return self.procs[1]

    def start(self) -> None:
        argv, endpoint = etcd_argv(self.tmp / "etcd")
        self.procs.append(Process("etcd", pinned(self.other_core, argv),
                                  self.tmp / "etcd.log", cwd=self.tree).start())
        base = {k: v for k, v in os.environ.items() if not k.startswith("LLMGW_")}
        base.update({"LLMGW_SECRET": self.secret, "LLMGW_ADMIN_TOKEN": self.admin,
                     "LLMGW_LOG_LEVEL": "warning", "PYTHONUNBUFFERED": "1"})
        gw_env = base | {"LLMGW_ETCD_ENDPOINTS": endpoint,
                         "LLMGW_PORT": str(self.port), "LLMGW_GATEWAY_ID": "bench-gw",
                         "LLMGW_WORKERS": "1",
                         "LLMGW_DATA_DIR": str(self.tmp / "gw")} | self.gateway_env
        self._gw_env = gw_env
        self.procs.append(Process("gateway", pinned(self.proxy_core, [
            self.python, "-m", "app.cli", "serve"]), self.tmp / "gateway.log",
            gw_env, cwd=self.tree).start())
        wait_for(lambda: http("GET", self.url + "/readyz")[0] == 200, 40, "llmgw /readyz",
                 self.gateway.alive)
        from app.wire.tokens import node_token

        agent_env = base | {"LLMGW_AGENT_TOKEN": node_token(self.secret, "bench"),
                            "LLMGW_VLLM_BIN": str(BENCH / "bin" / "vllm"),
                            "STANDIN_PYTHON": sys.executable}
        agent_env.pop("LLMGW_SECRET")
        self.procs.append(Process("agent", pinned(self.other_core, [
            sys.executable, "-m", "app.cli", "agent", "--gateway", self.url, "--node", "bench",
            "--gpus", "1", "--work-dir", str(self.tmp / "agent"), "--stop-engines-on-exit"]),
            self.tmp / "agent.log", agent_env, cwd=self.tree).start())
        spec = {"model": "bench/standin", "engine": "vllm", "gpus": 1,
                "replicas": {"min": 1, "max": 1}}
        status, body = http("PUT", f"{self.url}/admin/models/{MODEL}", spec, self.admin)
        if status not in (200, 201):
            raise Unavailable(f"PUT model: {status} {body}")
        status, body = http("POST", self.url + "/admin/keys", {"name": "bench"}, self.admin)
        if status != 201:
            raise Unavailable(f"POST key: {status} {body}")
        self.client_key = str(body["key"])

        def ready() -> dict[str, Any] | None:
            status, reps = http("GET", self.url + "/admin/replicas", token=self.admin)
            for r in reps if status == 200 else []:
                if r.get("phase") == "ready" and r.get("url"):
                    return dict(r)
            return None

        rep = wait_for(ready, 60, "a ready replica", self.gateway.alive)
        from app.control.keys import engine_key

        self.engine_url = str(rep["url"])
        self.engine_key = engine_key(self.secret, str(rep["id"]))
        self.engine_pid = pid_with_port(int(self.engine_url.rsplit(":", 1)[1]))
        wait_for(lambda: chat_ok(self.url, self.client_key), 20, "llmgw routing",
                 self.gateway.alive)

    def start_granian(self) -> Peer:
        """A second gateway of this cluster, served by granian
        (bench/granian_gateway.py) instead of uvicorn, on the proxy's core:
        the same app, etcd, replica and client key."""
        try:
            import granian
        except ImportError:
            raise Unavailable("granian not installed: pip install granian") from None
        port = free_port()
        env = self._gw_env | {"LLMGW_PORT": str(port), "LLMGW_GATEWAY_ID": "bench-gw-granian",
                              "LLMGW_DATA_DIR": str(self.tmp / "gw-granian")}
        proc = Process("llmgw-granian", pinned(self.proxy_core, [
            sys.executable, str(BENCH / "granian_gateway.py"), "--port", str(port)]),
            self.tmp / "gateway-granian.log", env, cwd=self.tree).start()
        peer = Peer("llmgw-granian", f"http://127.0.0.1:{port}", self.client_key, proc,
                    f"the same gateway served by granian {granian.__version__} "
                    "(ASGI, uvloop, one worker, one runtime thread) instead of uvicorn")
        wait_for(lambda: chat_ok(peer.url, self.client_key), 40, "llmgw on granian",
                 proc.alive)
        return peer

    def stop(self) -> None:
        for p in reversed(self.procs):
            p.stop()
        if self.engine_pid is not None:  # engines live in sessions of their own
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.engine_pid, signal.SIGKILL)


def did_not_come_up(exc: Unavailable, gw: Llmgw) -> int:
    """Says why llmgw did not start, with each of its processes' last lines;
    the exit status of a benchmark that could not measure it."""
    print(f"llmgw did not come up: {exc}\n" + "\n".join(
        f"--- {p.name}\n{p.tail()}" for p in gw.procs), file=sys.stderr)
    return 1


@dataclass
class Peer:
    """A proxy in front of the stand-in, started for its measurements only."""

    name: str
    url: str
    token: str  # what the load generator sends as its bearer token
    proc: Process | None = None
    note: str = ""

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.stop()


def start_floor(tmp: Path, core: int | None, upstream: str, key: str,
                extra_env: dict[str, str] | None = None) -> Peer:
    port = free_port()
    proc = Process("floor", pinned(core, [sys.executable, str(BENCH / "floor.py"), str(port),
                                          upstream]), tmp / "floor.log",
                   dict(os.environ) | {"FLOOR_ENGINE_KEY": key} | (extra_env or {})).start()
    peer = Peer("floor", f"http://127.0.0.1:{port}", "-", proc,
                "raw ASGI + aiohttp client, uvicorn (uvloop, httptools), no features")
    wait_for(lambda: chat_ok(peer.url, "-"), 20, "the floor proxy", proc.alive)
    return peer


def start_tcp_relay(tmp: Path, core: int | None, upstream: str, key: str) -> Peer:
    port = free_port()
    proc = Process("relay", pinned(core, [sys.executable, str(BENCH / "tcp_relay.py"), str(port),
                                          upstream]), tmp / "relay.log").start()
    # Bytes through as they are: the load generator sends the engine key.
    peer = Peer("relay", f"http://127.0.0.1:{port}", key, proc,
                "bytes from one socket to the other on uvloop, nothing parsed (bench/tcp_relay.py)")
    wait_for(lambda: chat_ok(peer.url, key), 20, "the byte relay", proc.alive)
    return peer


NGINX_CONF = """worker_processes 1;
daemon off;
pid {tmp}/nginx.pid;
error_log {tmp}/nginx-error.log warn;
events {{ worker_connections 4096; }}
http {{
  access_log off;
  client_body_temp_path {tmp}/nginx-body;
  proxy_temp_path {tmp}/nginx-proxy;
  upstream standin {{ server {upstream}; keepalive 512; }}
  server {{
    listen 127.0.0.1:{port} backlog=4096;
    keepalive_requests 1000000;
    location / {{
      proxy_pass http://standin;
      proxy_http_version 1.1;
      proxy_set_header Connection "";
      proxy_set_header Authorization "Bearer {key}";
      proxy_buffering off;
    }}
  }}
}}
"""


def start_nginx(tmp: Path, core: int | None, upstream: str, key: str) -> Peer:
    nginx = shutil.which("nginx") or "/usr/sbin/nginx"
    if not Path(nginx).exists():
        raise Unavailable("nginx is not installed (apt-get install nginx)")
    port = free_port()
    conf = tmp / "nginx.conf"
    conf.write_text(NGINX_CONF.format(tmp=tmp, port=port, key=key,
                                      upstream=upstream.removeprefix("http://")))
    version = subprocess.run([nginx, "-v"], capture_output=True, text=True).stderr.strip()
    proc = Process("nginx", pinned(core, [nginx, "-c", str(conf), "-p", str(tmp)]),
                   tmp / "nginx.log").start()
    peer = Peer("nginx", f"http://127.0.0.1:{port}", "-", proc,
                version.removeprefix("nginx version: ") + ", one worker, upstream keepalive")
    wait_for(lambda: chat_ok(peer.url, "-"), 20, "nginx", proc.alive)
    return peer


def _venv_bin(venv: Path, name: str) -> Path:
    exe = venv / "bin" / name
    if not exe.exists():
        raise Unavailable(f"{exe} not found: see bench/README.md to install it")
    return exe


def _version(venv: Path, dist: str) -> str:
    out = subprocess.run([str(venv / "bin" / "python"), "-c",
                          f"import importlib.metadata as m; print(m.version('{dist}'))"],
                         capture_output=True, text=True)
    return out.stdout.strip() or "?"


def start_litellm(tmp: Path, core: int | None, upstream: str, key: str,
                  venv: Path) -> Peer:
    exe = _venv_bin(venv, "litellm")
    port = free_port()
    cfg = tmp / "litellm.yaml"
    cfg.write_text(
        "model_list:\n"
        f"  - model_name: {MODEL}\n"
        "    litellm_params:\n"
        f"      model: openai/{MODEL}\n"
        f"      api_base: {upstream}/v1\n"
        f"      api_key: {key}\n"
        "litellm_settings:\n"
        "  telemetry: false\n")
    # A master key (it refuses to start without one, and it is llmgw's
    # counterpart: the client authenticates); no database behind it.
    master = "sk-bench-" + secrets.token_hex(16)
    env = dict(os.environ) | {"LITELLM_LOCAL_MODEL_COST_MAP": "True", "LITELLM_LOG": "ERROR",
                              "NO_DOCS": "True", "LITELLM_MASTER_KEY": master}
    proc = Process("litellm", pinned(core, [
        str(exe), "--config", str(cfg), "--host", "127.0.0.1", "--port", str(port),
        "--num_workers", "1"]), tmp / "litellm.log", env).start()
    peer = Peer("litellm", f"http://127.0.0.1:{port}", master, proc,
                f"litellm[proxy] {_version(venv, 'litellm')}, one worker, master key, "
                "no database")
    wait_for(lambda: chat_ok(peer.url, master), 90, "litellm", proc.alive)
    return peer


def start_vllm_router(tmp: Path, core: int | None, upstream: str, key: str,
                      venv: Path, threads: int | None = 1) -> Peer:
    """vllm-router with `threads` runtime threads (None: as many as it
    sizes itself to, the machine's cores)."""
    exe = _venv_bin(venv, "vllm-router")
    port = free_port()
    proc = Process("vllm-router", pinned(core, [
        str(exe), "--host", "127.0.0.1", "--port", str(port), "--worker-urls", upstream,
        "--policy", "round_robin", "--log-level", "warning", "--log-dir", str(tmp / "vr"),
        # Its metrics on a port of its own: the default (29000) held by any
        # other copy makes it exit at start.
        "--prometheus-port", str(free_port()),
        # One core by default, like every proxy here (its runtime otherwise
        # sizes itself to the machine).
        ]), tmp / "vllm-router.log",
        dict(os.environ) | ({"TOKIO_WORKER_THREADS": str(threads)} if threads else {})).start()
    # It passes the client's Authorization header through: the load generator
    # sends the engine key (as a client of a bare vLLM would).
    peer = Peer("vllm-router", f"http://127.0.0.1:{port}", key, proc,
                f"vllm-router {_version(venv, 'vllm-router')} (Rust), round_robin")
    wait_for(lambda: chat_ok(peer.url, key), 60, "vllm-router", proc.alive)
    return peer


def add_before_options(ap: argparse.ArgumentParser, example: str) -> None:
    """The options of a run that sets another gateway beside this tree's
    (bench/before_after.py, bench/idle.py): its interpreter and its settings."""
    ap.add_argument("--before-python", default=sys.executable,
                    help="the 'before' gateway's interpreter (default: this one; a venv "
                    "holding that tree's compiled router)")
    ap.add_argument("--before-env", action="append", default=[], metavar="NAME=VALUE",
                    type=lambda kv: tuple(kv.split("=", 1)),
                    help="a setting of the 'before' gateway alone (repeatable), e.g. "
                    f"{example}: the same tree, another setting")


def py_spy() -> str:
    """py-spy: on PATH, beside this interpreter, or in /tmp/bench-spy (a
    venv of its own: `python3 -m venv /tmp/bench-spy && /tmp/bench-spy/bin/pip
    install py-spy`)."""
    for spy in (shutil.which("py-spy"), str(Path(sys.executable).parent / "py-spy"),
                "/tmp/bench-spy/bin/py-spy"):
        if spy and Path(spy).exists():
            return spy
    raise Unavailable("py-spy not found: pip install py-spy (or into /tmp/bench-spy)")


@contextlib.contextmanager
def signals_raise() -> Iterator[None]:
    """SIGTERM behaves like Ctrl-C, so a benchmark's `finally` always cleans up
    what it started."""
    def handler(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    old = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


@contextlib.contextmanager
def running(gw: Llmgw, tmp: Path, keep: bool = False,
            others: Callable[[], Iterable[Peer | None]] = tuple) -> Iterator[None]:
    """A benchmark's body with llmgw's stack (started inside it): SIGTERM
    as Ctrl-C; on the way out, the peers `others` names and the stack
    stopped, and `tmp` removed (kept with `keep`, and said). Ctrl-C exits
    130; a stack that did not come up exits 1, with its processes' last
    lines."""
    with signals_raise():
        try:
            yield
        except KeyboardInterrupt:
            print("interrupted; stopping everything", file=sys.stderr)
            raise SystemExit(130) from None
        except Unavailable as exc:
            raise SystemExit(did_not_come_up(exc, gw)) from None
        finally:
            for peer in others():
                if peer is not None:
                    peer.stop()
            gw.stop()
            if keep:
                print(f"kept {tmp}", file=sys.stderr)
            else:
                shutil.rmtree(tmp, ignore_errors=True)
