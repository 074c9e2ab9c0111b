"""The fleet bench/chaos.py breaks, all real processes on loopback: a
3-member etcd, three `llmgw serve` behind haproxy (compose/haproxy.cfg with
loopback addresses, a third server and a log of which gateway served each
request), two agents whose engines are the vLLM stand-in
(tests/fakes/bin/vllm, run as a program). Each process runs in a session of
its own; every one (engines included) carries `CHAOS_TAG` in its environment
so `stop()` ends exactly what this rig started.

It also gathers the evidence: a live watch on the prefix from revision 1
(the time each event was seen) and a poller asking etcd whether each leader
lease is still alive (the revision at which it was not).
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from chaos_checks import Event
from peers import ROOT, Process, free_port, http, wait_for

FAKE_BIN = ROOT / "tests" / "fakes" / "bin"
PREFIX = "/llmgw/"
TTL = 4  # LLMGW_LEASE_TTL: a paused leader is past it within seconds
NODE_TTL = 6  # LLMGW_NODE_TTL
MODEL = "chat"
REPLICAS = 3  # of 4 GPUs on two nodes: the engines needed


def b64(s: str) -> str:
    return base64.b64encode(s.encode()).decode()


class Member:
    def __init__(self, tmp: Path, i: int) -> None:
        self.name, self.tmp = f"etcd{i}", tmp
        self.cport, self.pport = free_port(), free_port()
        self.url = f"http://127.0.0.1:{self.cport}"
        self.proc: Process | None = None
        self.cluster = ""

    def start(self, env: dict[str, str]) -> None:
        etcd = shutil.which("etcd") or "/usr/bin/etcd"
        peer = f"http://127.0.0.1:{self.pport}"
        self.proc = Process(self.name, [
            etcd, "--name", self.name, "--data-dir", str(self.tmp / self.name),
            "--listen-client-urls", self.url, "--advertise-client-urls", self.url,
            "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
            "--initial-cluster", self.cluster, "--unsafe-no-fsync", "--log-level", "warn"],
            self.tmp / f"{self.name}.log", env).start()

    def kill(self) -> None:
        if self.proc is not None and self.proc.alive():
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.popen.wait(5)  # type: ignore[union-attr]

    def signal(self, sig: int) -> None:
        if self.proc is not None and self.proc.alive():
            os.killpg(self.proc.pid, sig)

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=1) as r:
                return b'"true"' in r.read()
        except OSError:
            return False


class Slot:
    """One gateway or agent: the same name, port and data dir across restarts."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str], log: Path,
                 port: int = 0) -> None:
        self.name, self.argv, self.env, self.log, self.port = name, argv, env, log, port
        self.proc: Process | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        self.proc = Process(self.name, self.argv, self.log, self.env).start()

    def signal(self, sig: int, group: bool = True) -> None:
        if self.proc is not None and self.proc.alive():
            with contextlib.suppress(ProcessLookupError):
                if group:  # engines live in sessions of their own: they stay
                    os.killpg(self.proc.pid, sig)
                else:
                    os.kill(self.proc.pid, sig)

    def wait_exit(self, timeout: float) -> None:
        if self.proc is not None and self.proc.popen is not None:
            self.proc.popen.wait(timeout)

    def ready(self) -> bool:
        return self.proc is not None and self.proc.alive() and \
            http("GET", self.url + "/readyz", timeout=2)[0] == 200


class Rig:
    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.tag = f"CHAOS_TAG={tmp}"
        self.admin = "chaos-admin-0123456789abcdef"
        self.secret = "chaos-secret-0123456789abcdef"
        self.provider_key = "sk-chaos-provider-0123456789abcdef"
        (tmp / "keys").mkdir(parents=True, exist_ok=True)
        (tmp / "keys" / "provider.key").write_text(self.provider_key + "\n")
        self.members = [Member(tmp, i) for i in range(3)]
        cluster = ",".join(f"{m.name}=http://127.0.0.1:{m.pport}" for m in self.members)
        for m in self.members:
            m.cluster = cluster
        self.gws: list[Slot] = []
        self.agents: list[Slot] = []
        self.haproxy: subprocess.Popen[bytes] | None = None
        self.haproxy_url = ""
        self.seen: dict[tuple[int, str], float] = {}
        self.leases: set[int] = set()
        self.dead: dict[int, int] = {}
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("LLMGW_")}
        return env | {"CHAOS_TAG": str(self.tmp), "PYTHONUNBUFFERED": "1",
                      "PATH": f"{FAKE_BIN}{os.pathsep}{env.get('PATH', '')}",
                      "FAKE_VLLM_PYTHON": sys.executable, "FAKE_VLLM_TOKEN_DELAY": "0.2",
                      "LLMGW_ADMIN_TOKEN": self.admin, "LLMGW_LOG_LEVEL": "info"}

    # --- starting ---------------------------------------------------------

    def start(self) -> None:
        for m in self.members:
            m.start(self.env())
        for m in self.members:
            wait_for(m.healthy, 30, f"{m.name} healthy")
        self._spawn(self._watch)
        self._spawn(self._poll_leases)
        endpoints = ",".join(f"127.0.0.1:{m.cport}" for m in self.members)
        for i in range(3):
            port = free_port()
            env = self.env() | {
                "LLMGW_SECRET": self.secret, "LLMGW_ETCD_ENDPOINTS": endpoints,
                "LLMGW_PORT": str(port), "LLMGW_GATEWAY_ID": f"gw{i}", "LLMGW_WORKERS": "1",
                "LLMGW_DATA_DIR": str(self.tmp / f"gw{i}"), "LLMGW_LEASE_TTL": str(TTL),
                "LLMGW_ETCD_TIMEOUT": "2", "LLMGW_PROVIDER_KEY_DIR": str(self.tmp / "keys"),
                # Shorter than the short form's etcd outage (8 s), so that every
                # node's key goes at etcd's return too (agents beat every 2 s).
                "LLMGW_NODE_TTL": str(NODE_TTL),
                # The history is the evidence: the leader must not compact it.
                "LLMGW_ETCD_COMPACTION_INTERVAL": "0"}
            slot = Slot(f"gw{i}", [sys.executable, "-m", "app.cli", "serve"], env,
                        self.tmp / f"gw{i}.log", port)
            slot.start()
            self.gws.append(slot)
        for g in self.gws:
            wait_for(g.ready, 90, f"{g.name} ready", lambda g=g: g.proc is not None and
                     g.proc.alive())  # type: ignore[misc]
        from app.wire.tokens import node_token

        for i in range(2):
            node = f"node-{i + 1}"
            env = self.env() | {"LLMGW_AGENT_TOKEN": node_token(self.secret, node)}
            slot = Slot(f"agent-{node}", [
                sys.executable, "-m", "app.cli", "agent", "--node", node, "--gpus", "2",
                "--gateway", ",".join(g.url for g in self.gws),
                "--work-dir", str(self.tmp / f"agent-{node}")], env,
                self.tmp / f"agent-{node}.log")
            slot.start()
            self.agents.append(slot)
        self.start_haproxy()

    def start_haproxy(self) -> None:
        exe = shutil.which("haproxy") or "/usr/sbin/haproxy"
        port = free_port()
        text = (ROOT / "compose" / "haproxy.cfg").read_text()
        text = text.replace("bind :8080", f"bind 127.0.0.1:{port}\n"
                            "  capture request header X-Chaos-Id len 40")
        text = text.replace("global\n", "global\n  log stderr format raw local0\n", 1)
        text = text.replace("defaults\n", "defaults\n  log global\n  option httplog\n", 1)
        line = re.search(r"  server gateway2 gateway2:8080.*\n", text)
        assert line, "compose/haproxy.cfg no longer names gateway2:8080"
        text = text.replace(line.group(0), line.group(0) + line.group(0).replace("2", "3"))
        for i, g in enumerate(self.gws, start=1):
            text, n = re.subn(rf"gateway{i}:8080", f"127.0.0.1:{g.port}", text)
            assert n == 1, f"compose/haproxy.cfg no longer names gateway{i}:8080"
        cfg = self.tmp / "haproxy.cfg"
        cfg.write_text(text)
        with open(self.tmp / "haproxy.log", "wb") as out:
            self.haproxy = subprocess.Popen([exe, "-db", "-f", str(cfg)], stdout=out,
                                            stderr=subprocess.STDOUT, start_new_session=True)
        self.haproxy_url = f"http://127.0.0.1:{port}"
        wait_for(lambda: http("GET", self.haproxy_url + "/readyz", timeout=2)[0] == 200, 30,
                 "haproxy up")

    def haproxy_log(self) -> str:
        return (self.tmp / "haproxy.log").read_text(errors="replace")

    # --- etcd, read from outside -------------------------------------------

    def etcd(self, path: str, body: dict[str, Any], timeout: float = 3) -> dict[str, Any]:
        last: Exception | None = None
        for m in self.members:
            if m.proc is None or not m.proc.alive():
                continue
            req = urllib.request.Request(m.url + path, json.dumps(body).encode(), method="POST")
            try:
                with urllib.request.urlopen(req, timeout=timeout) as r:
                    return dict(json.loads(r.read()))
            except OSError as exc:
                last = exc
        raise OSError(f"no etcd member answered {path}: {last}")

    def get(self, key: str) -> dict[str, Any] | None:
        kvs = self.etcd("/v3/kv/range", {"key": b64(PREFIX + key)}).get("kvs") or []
        return dict(json.loads(base64.b64decode(kvs[0]["value"]))) if kvs else None

    def range(self, prefix: str) -> dict[str, dict[str, Any]]:
        end = PREFIX + prefix[:-1] + chr(ord(prefix[-1]) + 1)
        got = self.etcd("/v3/kv/range", {"key": b64(PREFIX + prefix), "range_end": b64(end)})
        return {base64.b64decode(kv["key"]).decode().removeprefix(PREFIX):
                json.loads(base64.b64decode(kv["value"])) for kv in got.get("kvs") or []}

    def dump(self) -> dict[str, str]:
        """Every key under the prefix and its value as stored, now."""
        end = PREFIX[:-1] + chr(ord(PREFIX[-1]) + 1)
        got = self.etcd("/v3/kv/range", {"key": b64(PREFIX), "range_end": b64(end)})
        return {base64.b64decode(kv["key"]).decode(errors="replace"):
                base64.b64decode(kv.get("value", "")).decode(errors="replace")
                for kv in got.get("kvs") or []}

    def live_leader(self) -> str:
        """The leader's id if the `leader` key is there and etcd says its
        lease is alive; "" otherwise."""
        with contextlib.suppress(OSError, ValueError, KeyError):
            kvs = self.etcd("/v3/kv/range", {"key": b64(PREFIX + "leader")}).get("kvs") or []
            if kvs and int(kvs[0].get("lease", 0)):
                got = self.etcd("/v3/lease/timetolive", {"ID": kvs[0]["lease"]})
                if int(got.get("TTL", -1)) > 0:
                    return str(json.loads(base64.b64decode(kvs[0]["value"])).get("id") or "?")
        return ""

    def leader_id(self) -> str:
        return str((self.get("leader") or {}).get("id") or "")

    def history(self, timeout: float = 30, start: int = 1) -> list[Event]:
        """Every event under the prefix from revision `start`, by a watch
        read to the revision etcd is at now."""
        target = int(self.etcd("/v3/kv/range", {"key": b64(PREFIX)})["header"]["revision"])
        events: list[Event] = []
        if start > target:
            return []
        for m in self.members:
            if m.proc is None or not m.proc.alive():
                continue
            events = []
            with contextlib.suppress(OSError, ValueError):
                # Whole answers: etcd sends a revision's events in one, so the
                # last revision read is whole (breaking at its first event
                # left out the rest of its transaction: a replica delete
                # read without the leader-write beside it).
                for batch in self._stream(m, start, time.monotonic() + timeout):
                    events.extend(batch)
                    if events and events[-1].rev >= target:
                        break
            if events and events[-1].rev >= target:
                break
        if not events or events[-1].rev < target:  # checks on part of it would prove nothing
            raise RuntimeError(f"etcd's history read to {events[-1].rev if events else 0}, "
                               f"not to its revision {target}")
        return [Event(e.rev, e.key, e.kind, e.value, e.lease, e.create_rev,
                      self.seen.get((e.rev, e.key), 0.0), e.raw) for e in events]

    def _stream(self, m: Member, start: int, deadline: float) -> Any:
        """etcd's watch from `start`: each answer's events, as a list."""
        end = PREFIX[:-1] + chr(ord(PREFIX[-1]) + 1)
        body = {"create_request": {"key": b64(PREFIX), "range_end": b64(end),
                                   "start_revision": start}}
        req = urllib.request.Request(m.url + "/v3/watch", json.dumps(body).encode(),
                                     method="POST")
        with urllib.request.urlopen(req, timeout=5) as r:
            while time.monotonic() < deadline and not self._stop.is_set():
                line = r.readline()
                if not line:
                    return
                batch = []
                for ev in json.loads(line).get("result", {}).get("events") or []:
                    kv = ev["kv"]
                    raw = base64.b64decode(kv.get("value", "")) if kv.get("value") else b""
                    value = None
                    with contextlib.suppress(ValueError):
                        value = json.loads(raw) if raw else None
                    batch.append(Event(int(kv["mod_revision"]),
                                       base64.b64decode(kv["key"]).decode().removeprefix(PREFIX),
                                       "delete" if ev.get("type") == "DELETE" else "put",
                                       value if isinstance(value, dict) else None,
                                       int(kv.get("lease", 0)), int(kv.get("create_revision", 0)),
                                       raw=raw.decode(errors="replace")))
                if batch:
                    yield batch

    def _watch(self) -> None:
        """The live watch: when each event was seen; the leases of `leader`."""
        nxt, i = 1, 0
        while not self._stop.is_set():
            m = self.members[i % 3]
            i += 1
            try:
                for batch in self._stream(m, nxt, float("inf")):
                    for e in batch:
                        self.seen.setdefault((e.rev, e.key), time.monotonic())
                        if e.key == "leader" and e.kind == "put" and e.lease:
                            self.leases.add(e.lease)
                        nxt = max(nxt, e.rev)  # a revision split across lines is read again
            except (OSError, ValueError):
                time.sleep(0.05)

    def _poll_leases(self) -> None:
        while not self._stop.wait(0.2):
            for lease in sorted(self.leases - set(self.dead)):
                with contextlib.suppress(OSError, ValueError, KeyError):
                    got = self.etcd("/v3/lease/timetolive", {"ID": str(lease)}, timeout=1)
                    if int(got.get("TTL", 0)) == -1:
                        self.dead[lease] = int(got["header"]["revision"])

    def _spawn(self, fn: Any) -> None:
        t = threading.Thread(target=fn, daemon=True)
        t.start()
        self._threads.append(t)

    # --- stopping -----------------------------------------------------------

    def stop(self) -> None:
        self._stop.set()
        if self.haproxy is not None:
            self.haproxy.kill()
            self.haproxy.wait(5)
        for slot in [*self.agents, *self.gws]:
            if slot.proc is not None:
                slot.proc.stop()
        for m in self.members:
            if m.proc is not None:
                m.proc.stop()
        kill_tagged(self.tag)
        # The engines killed leave their sockets' folders, as on a crashed
        # node: removed as their agents' next start would.
        from app.agent.engines import sweep_gone

        sweep_gone(self.tmp, 5)


def kill_tagged(tag: str) -> None:
    """SIGKILLs what this rig started that outlived it (engines), found by
    `tag` in their environment: never a process of anyone else's."""
    needle = tag.encode()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            env = (proc / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if needle in env:
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(proc.name), signal.SIGKILL)
