"""With etcd unreachable, routing goes on from the mirror; writes answer 503
and lose nothing; when etcd returns, everything resumes (DESIGN invariant 2).
Runs on an etcd of its own (`own_etcd`), never the session's shared one."""

from __future__ import annotations

from pathlib import Path

import httpx
import openai

from tests.support.etcd import EtcdServer
from tests.support.procs import (
    ADMIN,
    Cluster,
    make_key,
    put_model,
    routes,
    wait_for,
    wait_ready,
)


def test_routing_survives_etcd_down_and_writes_refuse_cleanly(
    own_etcd: EtcdServer, tmp_path: Path
) -> None:
    cluster = Cluster(tmp_path, own_etcd.endpoint, "/llmgw/")
    try:
        gw = cluster.gateway("gw-a", etcd_timeout="1")
        cluster.agent("node-1", [gw], "--gpus", "1")
        key = make_key(gw)
        put_model(gw, "m", {"model": "acme/m", "aliases": ["alias-m"], "gpus": 1})
        wait_ready(gw)
        wait_for(lambda: routes(gw, key, "alias-m"), 5, "routing")

        own_etcd.stop()
        client = openai.OpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0)
        for _ in range(3):
            chat = client.chat.completions.create(
                model="alias-m", messages=[{"role": "user", "content": "etcd is down"}])
            assert "etcd is down" in (chat.choices[0].message.content or "")
        assert [m.id for m in client.models.list()] == ["m", "alias-m"]

        admin = {"Authorization": f"Bearer {ADMIN}"}
        r = httpx.put(gw.url + "/admin/models/other", json={"model": "x"}, headers=admin,
                      timeout=30)
        assert r.status_code == 503, r.text
        assert r.headers["content-type"].startswith("application/problem+json")
        assert "not saved" in r.json()["detail"]
        # Reads still answer from the mirror.
        r = httpx.get(gw.url + "/admin/models", headers=admin, timeout=10)
        assert r.status_code == 200 and [m["name"] for m in r.json()] == ["m"]

        own_etcd.start()
        wait_for(lambda: httpx.put(gw.url + "/admin/models/other", json={"model": "x"},
                                   headers=admin, timeout=10).status_code == 201,
                 20, "writes accepted again")
        wait_for(lambda: gw.leader()["is_leader"], 20, "leadership regained")
        assert routes(gw, key, "m")
        assert "Traceback" not in gw.output()
    finally:
        cluster.close()
