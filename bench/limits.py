#!/usr/bin/env python3
"""A key's limits across three gateways (docs/design/client-keys.md and docs/design/workers.md).

Starts etcd, the stand-in (bench/standin.py) as an external model's provider
and three `llmgw serve --workers W` on that etcd (W = 2 unless `--workers`),
then drives fresh keys through the traffic patterns a load balancer makes,
each request on a new connection (any worker of its gateway):

* sticky: on each of `--bursts` keys (4 at once, 30 a minute), all on gw0:
  3 requests one after another, then 4 streams at once. Every one fits the
  key's limits: any refusal is a refusal below them. Then the fraction of
  each limit got within 3 s (12 a minute asked every 50 ms, 4 streams
  retried every 50 ms);
* round robin over the three for 3 s: admitted beyond the limit (12 a
  minute; 4 at once), bound N - 1 = 2;
* workers: streams of a key of 1 at once, asked round robin over the three
  gateways' workers for 3 s: admitted at once beyond 1, bound N - 1 = 2
  however many workers (the issue saw 3 with W = 2, the old bound W x N - 1);
* spill: bench/spill_overspend.py's `measure` on this fleet (a local model
  with no replica spilling to the stand-in, a burst of spills at once over
  the three gateways): the tokens billed past the key's external budget;
* moved: 4 streams on gw0, then the client on gw1: seconds until 4 there;
* killed: 4 streams on gw0, gw0 SIGKILLed, the client on gw1: seconds
  until 4 there (the lease is LLMGW_LEASE_TTL=4 here; its part is held
  a TTL after the lease went).

Last line: `limits: sticky_refused_below_limit=A cluster_overshoot=B
workers_overshoot=C spill_overspend_tokens=D`: A the sticky refusals (goal
0), B the most admitted beyond a limit by round robin (requests), C the most
beyond 1 at once, D the external tokens beyond the budget. Run from the
repository root: `python bench/limits.py [--workers W] [--bursts N]`.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

for _p in (str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)):
    if _p not in sys.path:
        sys.path.insert(0, _p)
from limits_fleet import TTL, Fleet, ask  # noqa: E402
from spill_overspend import measure  # noqa: E402


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


def at_once(n: int, one: Callable[[int], None], spacing: float = 0.0) -> None:
    """`one(i)` for i < n, each on a thread of its own, `spacing` s apart."""
    threads = []
    for i in range(n):
        threads.append(threading.Thread(target=one, args=(i,)))
        threads[-1].start()
        time.sleep(spacing)
    for t in threads:
        t.join()


def sticky_refusals(fleet: Fleet, url: str, bursts: int) -> int:
    """The issue's client on `bursts` new keys: 3 requests one after
    another, then 4 streams at once (~1 s each, so all four are open
    together): the refusals, all below the key's limits."""
    keys = [fleet.key({"concurrent_requests": 4, "requests_per_minute": 30}, wait=False)
            for _ in range(bursts)]
    time.sleep(0.5)  # every worker's mirror has them
    refused = 0
    lock = threading.Lock()
    for key in keys:
        refused += sum(ask(url, key) != 200 for _ in range(3))

        def one(_: int, key: str = key) -> None:
            nonlocal refused
            if ask(url, key, 20) != 200:
                with lock:
                    refused += 1

        at_once(4, one)
    return refused


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=2, help="workers of each gateway")
    parser.add_argument("--bursts", type=int, default=100, help="sticky bursts, one key each")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="llmgw-limits-") as tmp:
        fleet = Fleet(Path(tmp), args.workers)
        try:
            fleet.start()
            urls = [u for _, u in fleet.gws]
            n = len(urls)
            # Sticky.
            refused = sticky_refusals(fleet, urls[0], args.bursts)
            print(f"sticky: {refused} refused below the key's limits in {args.bursts} "
                  f"rounds of 3 requests then 4 at once ({args.workers} workers a gateway)")
            key = fleet.key({"requests_per_minute": 12})
            start, ok = time.monotonic(), 0
            while time.monotonic() - start < 3:
                ok += ask(urls[0], key) == 200
                time.sleep(0.05)
            got, _ = hold(urls[0], fleet.key({"concurrent_requests": 4}), 4, 3.0, 200)
            print(f"sticky: {ok}/12 requests per minute, {got}/4 concurrent, in 3 s")
            # Round robin.
            key = fleet.key({"requests_per_minute": 12})
            ok = 0
            for i in range(45):
                ok += ask(urls[i % n], key) == 200
                time.sleep(1 / 15)
            lock = threading.Lock()

            def streams(limit: int) -> int:
                """Streams of a new key of `limit` at once, one every 50 ms
                round robin for 3 s, none ending before the last: admitted."""
                key = fleet.key({"concurrent_requests": limit})
                admitted = [0]

                def one(i: int) -> None:
                    if ask(urls[i % n], key, 200) == 200:
                        with lock:
                            admitted[0] += 1

                at_once(60, one, 0.05)
                return admitted[0]

            conc = streams(4)
            overshoot = max(0, ok - 12, conc - 4)
            print(f"round robin: {ok} admitted of 12 a minute, {conc} at once of 4 "
                  f"(bound {n - 1} over)")
            one_at_once = streams(1)
            print(f"workers: {one_at_once} at once of 1 over {n} gateways of "
                  f"{args.workers} workers (bound {n - 1} over)")
            # Spill: measured as bench/spill_overspend.py does, on this fleet.
            spend = measure(urls, fleet.admin, "m")
            print(spend.line())
            # Moved, then killed.
            key = fleet.key({"concurrent_requests": 4})
            hold(urls[0], key, 4, 3.0, 40)  # ~2 s streams
            got, took = hold(urls[1], key, 4, 12.0, 40)
            print(f"moved: {got}/4 on gw1 after {took:.1f} s")
            key = fleet.key({"concurrent_requests": 4})
            hold(urls[0], key, 4, 3.0, 400)
            os.kill(fleet.gws[0][0].pid, signal.SIGKILL)  # its workers die with it
            got, took = hold(urls[1], key, 4, 2 * TTL + 8.0, 40)
            print(f"killed: {got}/4 on gw1 {took:.1f} s after gw0 was (lease {TTL} s)")
            print(f"limits: sticky_refused_below_limit={refused} "
                  f"cluster_overshoot={overshoot} workers_overshoot={max(0, one_at_once - 1)} "
                  f"spill_overspend_tokens={spend.overspend}")
        finally:
            fleet.stop()


if __name__ == "__main__":
    main()
