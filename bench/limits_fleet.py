"""The fleet bench/limits.py and bench/spill_overspend.py drive: etcd, the
stand-in (bench/standin.py) as an external model's provider, and three
`llmgw serve --workers W` on that etcd, the model `m` routed on each."""

from __future__ import annotations

import contextlib
import functools
import json
import os
import sys
import threading
import time
import urllib.error
import urllib.request
from http.client import HTTPException
from pathlib import Path

from peers import ROOT, Process, etcd_argv, free_port, http, wait_for

TTL = 4
PROVIDER_KEY = "bench-provider-key-0123456789"


class Fleet:
    def __init__(self, tmp: Path, workers: int = 1) -> None:
        self.tmp = tmp
        self.workers = workers
        self.admin = "bench-admin-0123456789abcdef"
        self.procs: list[Process] = []
        self.gws: list[tuple[Process, str]] = []

    def start(self) -> None:
        argv, endpoint = etcd_argv(self.tmp / "etcd")
        self.procs.append(Process("etcd", argv, self.tmp / "etcd.log").start())
        sport = free_port()
        env = dict(os.environ) | {"VLLM_API_KEY": PROVIDER_KEY, "STANDIN_CHUNK_MS": "50"}
        self.procs.append(Process("standin", [
            sys.executable, str(ROOT / "bench" / "standin.py"), "serve", "bench/m", "--host",
            "127.0.0.1", "--port", str(sport), "--served-model-name", "m"],
            self.tmp / "standin.log", env).start())
        keys = self.tmp / "keys"
        keys.mkdir()
        (keys / "provider").write_text(PROVIDER_KEY)
        base = {k: v for k, v in os.environ.items() if not k.startswith("LLMGW_")} | {
            "LLMGW_SECRET": "bench-secret-0123456789abcdef", "LLMGW_ADMIN_TOKEN": self.admin,
            "LLMGW_LOG_LEVEL": "warning", "LLMGW_ETCD_ENDPOINTS": endpoint,
            "LLMGW_LEASE_TTL": str(TTL), "LLMGW_ETCD_TIMEOUT": "2",
            "LLMGW_PROVIDER_KEY_DIR": str(keys)}
        for i in range(3):
            port = free_port()
            proc = Process(f"gw{i}", [sys.executable, "-m", "app.cli", "serve"],
                           self.tmp / f"gw{i}.log", base | {
                               "LLMGW_PORT": str(port), "LLMGW_GATEWAY_ID": f"gw{i}",
                               "LLMGW_DATA_DIR": str(self.tmp / f"gw{i}"),
                               "LLMGW_WORKERS": str(self.workers)}).start()
            self.procs.append(proc)
            url = f"http://127.0.0.1:{port}"
            wait_for(functools.partial(ready, url), 40 * self.workers, "readyz", proc.alive)
            self.gws.append((proc, url))
        spec = {"external": {"url": f"http://127.0.0.1:{sport}", "model": "m",
                             "api_key_file": str(keys / "provider")}}
        status, body = http("PUT", self.gws[0][1] + "/admin/models/m", spec, self.admin)
        assert status in (200, 201), body
        free = self.key({})
        for _, url in self.gws:
            # Each worker: new connections reach any of them.
            for _ in range(8 * self.workers):
                wait_for(functools.partial(routed, url, free), 30, "m routed")

    def key(self, limits: dict[str, int], wait: bool = True) -> str:
        status, body = http("POST", self.gws[0][1] + "/admin/keys",
                            {"name": "bench", "limits": limits}, self.admin)
        assert status == 201, body
        if wait:
            time.sleep(0.5)  # every worker's mirror has it (a watch: milliseconds)
        return str(body["key"])

    def stop(self) -> None:
        for p in reversed(self.procs):
            p.stop()


def ready(url: str) -> bool:
    return http("GET", url + "/readyz")[0] == 200


def routed(url: str, key: str) -> bool:
    return ask(url, key) == 200


def ask(url: str, key: str, stream_tokens: int = 0) -> int:
    """One chat completion: its status. A stream (`stream_tokens` chunks, 50
    ms apart) is read to its end on a thread of its own once admitted."""
    body: dict[str, object] = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    if stream_tokens:
        body |= {"stream": True, "max_tokens": stream_tokens}
    req = urllib.request.Request(url + "/v1/chat/completions", json.dumps(body).encode(),
                                 {"Authorization": f"Bearer {key}",
                                  "Content-Type": "application/json"})
    try:
        resp = urllib.request.urlopen(req, timeout=60)
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError:
        return 0
    if not stream_tokens:
        resp.read()
        resp.close()
        return int(resp.status)

    def drain() -> None:
        with contextlib.suppress(OSError, HTTPException), resp:
            resp.read()

    threading.Thread(target=drain, daemon=True).start()
    return int(resp.status)
