"""The load bench/chaos.py keeps on its fleet while it breaks it: client
threads with the official `openai` client (retries off), streaming and not,
through haproxy and straight to each gateway; one key with a concurrency
limit asked past it; an admin editing the catalog and client keys through
haproxy. Each records what it was answered (chaos_checks.Call, Edit).
"""

from __future__ import annotations

import hashlib
import threading
import time
from typing import Any

import openai
from chaos_checks import Call, Edit
from chaos_rig import MODEL, REPLICAS, Rig
from fleet import http
from peers import wait_for

CLIENTS = 3
LIMIT = 2  # the limited key's concurrent_requests
# What the gateways together may admit of it at once: L + N - 1 with N = 3
# gateways (docs/design/client-keys.md); its client asks one more.
BOUND = LIMIT + 3 - 1


class Load:
    def __init__(self, rig: Rig) -> None:
        self.rig = rig
        self.calls: list[Call] = []
        self.edits: list[Edit] = []
        self.key = ""
        self.limited = ""
        self.client_keys: list[str] = []  # every key the admin was given
        self.answers: list[tuple[str, str]] = []  # (request, body) of every admin answer
        self.admin_idle = threading.Event()  # set while the admin holds off (pause_admin)
        self._admin_hold = threading.Event()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()

    def prepare(self) -> None:
        """Keys made, and every gateway routing to all the replicas."""
        url = self.rig.haproxy_url
        status, body = self.call("POST", url + "/admin/keys", {"name": "chaos"})
        assert status == 201, body
        self.key = str(body["key"])
        status, body = self.call("POST", url + "/admin/keys", {
            "name": "chaos-limited", "limits": {"concurrent_requests": LIMIT}})
        assert status == 201, body
        self.limited = str(body["key"])

        def routed() -> bool:
            for g in self.rig.gws:
                status, body = self.call("GET", f"{g.url}/admin/routes?model={MODEL}")
                if status != 200 or len(body["endpoints"]) != REPLICAS:
                    return False
            return True

        wait_for(routed, 180, f"every gateway routing to {REPLICAS} replicas")

    def call(self, method: str, url: str, body: Any = None,
             timeout: float = 15) -> tuple[int, Any]:
        """An admin request, its answer kept for the secrets grep (a created
        key's one showing, in its `key` field, kept aside as that key)."""
        status, got = http(method, url, body, self.rig.admin, timeout=timeout)
        shown = got
        if isinstance(got, dict) and "key" in got and method == "POST":
            self.client_keys.append(str(got["key"]))
            shown = {k: v for k, v in got.items() if k != "key"}
        with self._lock:
            self.answers.append((f"{method} {url.split('/', 3)[-1]} -> {status}",
                                 shown if isinstance(shown, str) else repr(shown)))
        return status, got

    def pause_admin(self) -> None:
        """The admin holds off its next edit; returns once none is in flight."""
        self.admin_idle.clear()
        self._admin_hold.set()
        if self._threads:
            self.admin_idle.wait(60)

    def resume_admin(self) -> None:
        self._admin_hold.clear()

    def start(self) -> None:
        for i in range(CLIENTS):
            self._spawn(self._client, i)
        self._spawn(self._limited)
        self._spawn(self._admin)

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(90)
        self._threads = []

    def _spawn(self, fn: Any, *args: Any) -> None:
        t = threading.Thread(target=fn, args=args, daemon=True)
        t.start()
        self._threads.append(t)

    def record(self, c: Call) -> None:
        with self._lock:
            self.calls.append(c)

    def ask(self, client: openai.OpenAI, cid: str, target: str, stream: bool) -> Call:
        c = Call(cid, target, stream, time.monotonic(), 0.0)
        started = False
        msgs: Any = [{"role": "user", "content": f"chaos {cid}"}]
        try:
            if stream:
                finished = False
                chunks = client.chat.completions.create(
                    model=MODEL, messages=msgs, stream=True, max_tokens=20,
                    extra_headers={"X-Chaos-Id": cid})
                started = True  # answered 200: from here on a failure cuts it
                c.answered = time.monotonic()
                parts = []
                for chunk in chunks:
                    parts.append(chunk.model_dump_json())
                    if chunk.choices and chunk.choices[0].finish_reason:
                        finished = True
                        c.finished = time.monotonic()
                c.body = "\n".join(parts)
                c.cut = not finished
            else:
                got = client.chat.completions.create(
                    model=MODEL, messages=msgs, max_tokens=4, extra_headers={"X-Chaos-Id": cid})
                c.answered, c.body = time.monotonic(), got.model_dump_json()
        except openai.APIStatusError as exc:
            c.status = exc.status_code
            body = exc.body if isinstance(exc.body, dict) else {}
            c.reason = str(body.get("message") or "")
            c.body = exc.response.text
        except Exception as exc:  # a connection failed or cut: the class says which
            c.status, c.cut = 0, started
            c.error = f"{exc!r} {exc.__cause__!r}"[:200]
        c.end = time.monotonic()
        return c

    def _client(self, i: int) -> None:
        with openai.DefaultHttpxClient(timeout=60) as h:
            targets = {"haproxy": self.rig.haproxy_url} | {g.name: g.url for g in self.rig.gws}
            clients = {t: openai.OpenAI(base_url=u + "/v1", api_key=self.key, max_retries=0,
                                        http_client=h) for t, u in targets.items()}
            n = 0
            while not self._stop.is_set():
                n += 1
                target = "haproxy" if n % 3 else f"gw{(i + n) % 3}"
                self.record(self.ask(clients[target], f"c{i}-{n}", target, n % 2 == 0))
                time.sleep(0.05)

    def _limited(self) -> None:
        """BOUND + 1 streams at once, again and again: at least one is refused
        each time, wherever haproxy sends them."""
        with openai.DefaultHttpxClient(timeout=60) as h:
            client = openai.OpenAI(base_url=self.rig.haproxy_url + "/v1", api_key=self.limited,
                                   max_retries=0, http_client=h)
            n = 0
            while not self._stop.is_set():
                threads = []
                for _ in range(BOUND + 1):
                    n += 1
                    t = threading.Thread(target=lambda k=n: self.record(
                        self.ask(client, f"l-{k}", "haproxy", True)))
                    t.start()
                    threads.append(t)
                for t in threads:
                    t.join(90)
                time.sleep(0.5)

    def _admin(self) -> None:
        """Catalog puts and deletes (models at min 0: no engine; `churn`
        between one replica and none, every 5 s), key creates and revokes,
        through haproxy, one at a time."""
        url = self.rig.haproxy_url
        keys: list[tuple[str, str]] = []  # (id, etcd key) of acknowledged creates
        n = 0
        while not self._stop.wait(0.3):
            if self._admin_hold.is_set():
                self.admin_idle.set()
                continue
            n += 1
            name = f"edit-{n % 4}"
            if n % 16 == 5:  # `churn` at one replica, then none: the leader writes
                k = (n // 16) % 2
                status, _ = self.call("PUT", f"{url}/admin/models/churn", {
                    "model": "acme/churn", "gpus": 1, "replicas": {"min": k, "max": k},
                    "idle_timeout": 600 + n})
                self.edits.append(Edit("catalog/models/churn", 600 + n, status in (200, 201)))
            elif n % 7 == 0:
                status, _ = self.call("DELETE", f"{url}/admin/models/{name}")
                self.edits.append(Edit(f"catalog/models/{name}", None,
                                       status in (200, 204, 404)))
            elif n % 3 == 0:
                status, _ = self.call("PUT", f"{url}/admin/models/{name}", {
                    "model": "acme/edit", "gpus": 1, "replicas": {"min": 0, "max": 1},
                    "idle_timeout": 600 + n})
                self.edits.append(Edit(f"catalog/models/{name}", 600 + n,
                                       status in (200, 201)))
            elif n % 3 == 1 or not keys:
                status, body = self.call("POST", f"{url}/admin/keys", {"name": f"chaos-{n}"})
                if status == 201:
                    digest = hashlib.sha256(str(body["key"]).encode()).hexdigest()
                    keys.append((str(body["id"]), f"keys/{digest}"))
                    self.edits.append(Edit(keys[-1][1], 1, True))
            else:
                kid, ekey = keys.pop(0)
                status, _ = self.call("DELETE", f"{url}/admin/keys/{kid}")
                self.edits.append(Edit(ekey, None, status in (200, 204)))
