#!/usr/bin/env python3
"""A key's limits across three gateways (docs/architecture.md, "Client keys").

Starts etcd, the stand-in (bench/standin.py) as an external model's provider
and three `llmgw serve` on that etcd, then drives fresh keys through the
traffic patterns a load balancer makes:

* sticky: all on gw0 for 3 s, 12 requests a minute (asked every 50 ms) and
  4 streams at once (retried every 50 ms): the fraction of each limit got;
* round robin over the three for 3 s: admitted beyond the limit;
* moved: 4 streams on gw0, then the client on gw1: seconds until 4 there;
* killed: 4 streams on gw0, gw0 SIGKILLed, the client on gw1: seconds
  until 4 there (the lease is LLMGW_LEASE_TTL=4 here; its part is held
  a TTL after the lease went).

Last line: `limits: sticky_share=X cluster_overshoot=Y`: X the smaller of the
two sticky fractions, Y the most admitted beyond a limit by all gateways
together in any pattern, in requests. Run from the repository root:
`python bench/limits.py`.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from http.client import HTTPException
from pathlib import Path

for _p in (str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)):
    if _p not in sys.path:
        sys.path.insert(0, _p)
from peers import ROOT, Process, free_port, http, wait_for  # noqa: E402

TTL = 4
PROVIDER_KEY = "bench-provider-key-0123456789"


class Fleet:
    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.admin = "bench-admin-0123456789abcdef"
        self.procs: list[Process] = []
        self.gws: list[tuple[Process, str]] = []

    def start(self) -> None:
        etcd = shutil.which("etcd") or "/usr/bin/etcd"
        cport, pport = free_port(), free_port()
        client, peer = f"http://127.0.0.1:{cport}", f"http://127.0.0.1:{pport}"
        self.procs.append(Process("etcd", [
            etcd, "--name", "bench", "--data-dir", str(self.tmp / "etcd"),
            "--listen-client-urls", client, "--advertise-client-urls", client,
            "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
            "--initial-cluster", f"bench={peer}", "--unsafe-no-fsync", "--log-level", "warn"],
            self.tmp / "etcd.log").start())
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
            "LLMGW_LOG_LEVEL": "warning", "LLMGW_ETCD_ENDPOINTS": f"127.0.0.1:{cport}",
            "LLMGW_LEASE_TTL": str(TTL), "LLMGW_ETCD_TIMEOUT": "2",
            "LLMGW_PROVIDER_KEY_DIR": str(keys)}
        for i in range(3):
            port = free_port()
            proc = Process(f"gw{i}", [sys.executable, "-m", "app.cli", "serve"],
                           self.tmp / f"gw{i}.log", base | {
                               "LLMGW_PORT": str(port), "LLMGW_GATEWAY_ID": f"gw{i}",
                               "LLMGW_DATA_DIR": str(self.tmp / f"gw{i}"),
                               "LLMGW_WORKERS": "1"}).start()
            self.procs.append(proc)
            url = f"http://127.0.0.1:{port}"
            wait_for(functools.partial(ready, url), 40, "readyz", proc.alive)
            self.gws.append((proc, url))
        spec = {"external": {"url": f"http://127.0.0.1:{sport}", "model": "m",
                             "api_key_file": str(keys / "provider")}}
        status, body = http("PUT", self.gws[0][1] + "/admin/models/m", spec, self.admin)
        assert status in (200, 201), body
        free = self.key({})
        for _, url in self.gws:
            wait_for(functools.partial(routed, url, free), 30, "m routed")

    def key(self, limits: dict[str, int]) -> str:
        status, body = http("POST", self.gws[0][1] + "/admin/keys",
                            {"name": "bench", "limits": limits}, self.admin)
        assert status == 201, body
        time.sleep(0.5)  # every gateway's mirror has it (a watch: milliseconds)
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


def hold(url: str, key: str, want: int, within: float, tokens: int) -> tuple[int, float]:
    """`want` clients each retry a stream every 50 ms until admitted or
    `within` s pass: (admitted, seconds until the last was)."""
    start = time.monotonic()
    times: list[float] = []

    def one() -> None:
        while time.monotonic() - start < within:
            if ask(url, key, tokens) == 200:
                times.append(time.monotonic() - start)
                return
            time.sleep(0.05)

    threads = [threading.Thread(target=one) for _ in range(want)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return len(times), max(times, default=within)


def main() -> None:
    with tempfile.TemporaryDirectory(prefix="llmgw-limits-") as tmp:
        fleet = Fleet(Path(tmp))
        try:
            fleet.start()
            urls = [u for _, u in fleet.gws]
            # Sticky.
            key = fleet.key({"requests_per_minute": 12})
            start, ok = time.monotonic(), 0
            while time.monotonic() - start < 3:
                ok += ask(urls[0], key) == 200
                time.sleep(0.05)
            rpm_share = ok / 12
            got, _ = hold(urls[0], fleet.key({"concurrent_requests": 4}), 4, 3.0, 200)
            conc_share = got / 4
            print(f"sticky: {ok}/12 requests per minute, {got}/4 concurrent, in 3 s")
            # Round robin.
            key = fleet.key({"requests_per_minute": 12})
            ok = 0
            for i in range(45):
                ok += ask(urls[i % 3], key) == 200
                time.sleep(1 / 15)
            key = fleet.key({"concurrent_requests": 4})
            admitted = [0]
            lock = threading.Lock()

            def one(i: int) -> None:
                if ask(urls[i % 3], key, 200) == 200:
                    with lock:
                        admitted[0] += 1

            threads = []
            for i in range(60):
                threads.append(threading.Thread(target=one, args=(i,)))
                threads[-1].start()
                time.sleep(0.05)
            for t in threads:
                t.join()
            overshoot = max(ok - 12, admitted[0] - 4)
            print(f"round robin: {ok} admitted of 12 a minute, {admitted[0]} at once of 4")
            # Moved, then killed.
            key = fleet.key({"concurrent_requests": 4})
            hold(urls[0], key, 4, 3.0, 40)  # ~2 s streams
            got, took = hold(urls[1], key, 4, 12.0, 40)
            print(f"moved: {got}/4 on gw1 after {took:.1f} s")
            key = fleet.key({"concurrent_requests": 4})
            hold(urls[0], key, 4, 3.0, 400)
            os.kill(fleet.gws[0][0].pid, signal.SIGKILL)
            got, took = hold(urls[1], key, 4, 2 * TTL + 8.0, 40)
            print(f"killed: {got}/4 on gw1 {took:.1f} s after gw0 was (lease {TTL} s)")
            print(f"limits: sticky_share={min(rpm_share, conc_share):.2f} "
                  f"cluster_overshoot={max(0, overshoot)}")
        finally:
            fleet.stop()


if __name__ == "__main__":
    main()
