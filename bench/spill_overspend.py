#!/usr/bin/env python3
"""Spill overspend: how far a burst of spills passes a key's external budget
(docs/design/catalog.md, "Spill-over", and docs/design/client-keys.md).

`measure(urls, admin, external)` takes running gateways (one store) whose
catalog has the external model `external`; it adds a local model with no
replica (`replicas: {min: 0, max: 0}`) overflowing to it, so that every
request spills at once (`no_replica`), creates a key with
`external_tokens_per_day` = `budget`, and sends `requests` chats at once,
round robin over the gateways, each with `max_tokens`, in `bursts` a
`pause` apart (the first meets a fresh key's claims of 0, the later ones
the claims its refusals raised). The provider's
bill is the sum of the served answers' `usage.total_tokens` (what the
provider reported, what the budget is charged). The bound: each gateway
spends at most its claim and one reservation, so all together at most
`budget + len(urls) * reservation`.

For bench/limits.py's last line: `spill_overspend_tokens=` is
`Spend.overspend`, the tokens billed past the budget (0 when within it);
`Spend.bound_over` is what the bound allows past it. Standalone, from the
repository root: `python bench/spill_overspend.py` (three gateways,
bench/limits.py's fleet).
"""

from __future__ import annotations

import functools
import json
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

for _p in (str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)):
    if _p not in sys.path:
        sys.path.insert(0, _p)
from limits_fleet import Fleet  # noqa: E402
from peers import http, wait_for  # noqa: E402

from app.router.usage.estimates import DEFAULT_RESERVE, reservation  # noqa: E402


@dataclass(frozen=True)
class Spend:
    budget: int
    billed: int  # tokens the provider reported for the answers served
    served: int
    refused: int  # 429 external_budget_exceeded
    reservation: int  # one request's
    gateways: int

    @property
    def overspend(self) -> int:
        return max(0, self.billed - self.budget)

    @property
    def bound_over(self) -> int:
        return self.gateways * self.reservation

    def line(self) -> str:
        return (f"spill: {self.served} served, {self.refused} refused, billed {self.billed} "
                f"on a budget of {self.budget} (bound {self.budget + self.bound_over}: "
                f"{self.gateways} x one reservation of {self.reservation}); "
                f"spill_overspend_tokens={self.overspend}")


def _chat(url: str, key: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    req = urllib.request.Request(url + "/v1/chat/completions", json.dumps(body).encode(), {
        "Authorization": f"Bearer {key}", "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return int(resp.status), json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")


def measure(urls: list[str], admin: str, external: str, budget: int = 300,
            requests: int = 50, max_tokens: int = 8, model: str = "spill-m",
            bursts: int = 3, pause: float = 1.5) -> Spend:
    """Spends a fresh key's external budget with `bursts` of `requests`
    spills at once, `pause` seconds apart."""
    status, answer = http("PUT", urls[0] + f"/admin/models/{model}", {
        "model": "acme/spill", "gpus": 1, "replicas": {"min": 0, "max": 0},
        "overflow": external}, admin)
    assert status in (200, 201), answer

    def routed(url: str) -> bool:
        status, route = http("GET", url + f"/admin/routes?model={model}", token=admin)
        return status == 200 and route.get("overflow") == external

    for url in urls:
        wait_for(functools.partial(routed, url), 30, f"{model} overflowing on {url}")
    status, created = http("POST", urls[0] + "/admin/keys", {
        "name": "spill-bench", "limits": {"external_tokens_per_day": budget}}, admin)
    assert status == 201, created
    time.sleep(0.5)  # every gateway's mirror has the key (a watch: milliseconds)
    body = {"model": model, "max_tokens": max_tokens,
            "messages": [{"role": "user", "content": "how much does this cost?"}]}
    results: list[tuple[int, dict[str, Any]]] = []
    lock = threading.Lock()

    def burst() -> None:
        go = threading.Event()

        def one(i: int) -> None:
            go.wait()
            got = _chat(urls[i % len(urls)], created["key"], body)
            with lock:
                results.append(got)

        threads = [threading.Thread(target=one, args=(i,)) for i in range(requests)]
        for t in threads:
            t.start()
        go.set()  # all at once
        for t in threads:
            t.join()

    # A fresh key's first burst meets claims of 0 (each gateway admits its
    # floor: one spill); the refusals raise them, so the next burst meets
    # the claims a busy key has.
    for _ in range(bursts):
        burst()
        time.sleep(pause)
    served = [a for s, a in results if s == 200]
    refused = [a for s, a in results
               if s == 429 and a.get("error", {}).get("code") == "external_budget_exceeded"]
    assert len(served) + len(refused) == len(results), [s for s, _ in results]
    return Spend(budget, sum(int(a["usage"]["total_tokens"]) for a in served), len(served),
                 len(refused), reservation(body, len(json.dumps(body).encode()),
                                           DEFAULT_RESERVE), len(urls))


def main() -> None:
    with tempfile.TemporaryDirectory(prefix="llmgw-spill-") as tmp:
        fleet = Fleet(Path(tmp))
        try:
            fleet.start()
            print(measure([u for _, u in fleet.gws], fleet.admin, "m").line())
        finally:
            fleet.stop()


if __name__ == "__main__":
    main()
