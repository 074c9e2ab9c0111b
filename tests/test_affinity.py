"""Prompt affinity behind a load balancer: three gateways on one etcd, four
vLLM stand-ins, each turn of a conversation sent to the next gateway. Every
gateway must send the conversation to the same replica, whose prefix cache
holds it (docs/design/routing.md, "Choosing a replica"). The choice itself is
tested in-process in tests/test_choice.py; here, what only several real
gateways show: each judges the engines on its own scrapes and in-flight."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

import openai
import pytest

from tests.support.procs import Cluster, GatewayProc, make_key, put_model, replicas, wait_for

GATEWAYS = ("gw-a", "gw-b", "gw-c")


@pytest.fixture
def fleet(cluster: Cluster) -> tuple[list[GatewayProc], str]:
    gws = [cluster.gateway(n) for n in GATEWAYS]
    # Answers of about 50 ms (5 words, 10 ms each): a turn is still running
    # in an engine's counts when the next turn arrives at another gateway.
    cluster.agent("node-1", gws, "--gpus", "4",
                  env_extra={"FAKE_VLLM_TOKEN_DELAY": "0.01"})
    key = make_key(gws[0])
    put_model(gws[0], "m", {"model": "acme/m", "gpus": 1, "replicas": {"min": 4, "max": 4}})
    wait_for(lambda: sum(r["phase"] == "ready" for r in replicas(gws[0])) == 4, 60,
             "four ready replicas")

    def all_routed(gw: GatewayProc) -> bool:
        with gw.admin() as admin:
            r = admin.get("/admin/routes", params={"model": "m"})
        rows = r.json()["endpoints"] if r.status_code == 200 else []
        return len(rows) == 4 and all(row["engine"] for row in rows)

    wait_for(lambda: all(all_routed(g) for g in gws), 30,
             "every gateway routing to four replicas with their engine loads")
    return gws, key


def test_each_turn_through_another_gateway_lands_on_one_replica(
    fleet: tuple[list[GatewayProc], str],
) -> None:
    gws, key = fleet
    clients = [openai.OpenAI(base_url=g.url + "/v1", api_key=key, max_retries=0)
               for g in gws]

    def turn(n: int, t: int, messages: list[dict[str, str]], session: str | None) -> str:
        extra = {"X-Session-Id": session} if session else {}
        raw = clients[(n + t) % 3].chat.completions.with_raw_response.create(
            model="m", messages=messages, max_tokens=5,  # type: ignore[arg-type]
            extra_headers=extra)
        reply = raw.parse().choices[0].message.content or ""
        messages.append({"role": "assistant", "content": reply})
        return str(raw.headers["x-llmgw-replica"])

    def conversation(n: int) -> set[str]:
        # Half keyed by a session id, half by their messages' prefix.
        session = f"user-{n}" if n % 2 else None
        messages: list[dict[str, Any]] = [
            {"role": "system", "content": f"You are assistant number {n}."}]
        served = set()
        for t in range(4):
            messages.append({"role": "user", "content": f"question {t}"})
            served.add(turn(n, t, messages, session))
        return served

    # Eight conversations at a time: the replicas are busy, none saturated.
    with ThreadPoolExecutor(8) as pool:
        served = list(pool.map(conversation, range(24)))
    split = {n: sorted(s) for n, s in enumerate(served) if len(s) != 1}
    print(f"conversations on more than one replica: {len(split)} of 24")
    assert not split, split
    # And the conversations spread over the replicas (each owns a quarter of the ring).
    assert len({s.pop() for s in served}) >= 3
