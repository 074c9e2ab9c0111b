"""LoRA adapters across real processes: a gateway on etcd, an agent, vLLM
stand-ins, the `openai` client (docs/design/lora-adapters.md)."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import openai

from tests.support.procs import Cluster, make_key, put_model, replicas, routes, wait_for


def adapter_status(gw: Any, name: str) -> dict[str, Any]:
    with gw.admin() as admin:
        r = admin.get(f"/admin/models/{name}")
        assert r.status_code == 200, r.text
        return dict(r.json()["status"])


def engine_logs(tmp: Path) -> str:
    return "".join(p.read_text(errors="replace")
                   for p in (tmp / "agent-node-1" / "logs").glob("*.log"))


def test_an_adapter_is_listed_routed_to_its_subset_grown_and_shrunk(cluster: Cluster) -> None:
    gw = cluster.gateway("gw-a", adapter_shrink_after="1", request_timeout="6",
                         drain_seconds="7", shutdown_grace_seconds="5",
                         usage_interval="0.5", reconcile_interval="0.5")
    cluster.agent("node-1", [gw], "--gpus", "3", env_extra={"FAKE_VLLM_TOKEN_DELAY": "0.05"})
    key = make_key(gw)
    put_model(gw, "base", {"model": "acme/base", "gpus": 1, "replicas": {"min": 3, "max": 3}})
    with gw.admin() as admin:
        r = admin.put("/admin/models/orphan", json={
            "adapter": {"base": "nope", "weights": "acme/lora"}})
        assert r.status_code == 422, r.text
        assert r.json()["errors"][0]["loc"] == ["body", "adapter", "base"]
        assert "base model 'nope' is not in the catalog" in r.json()["detail"]
    put_model(gw, "sql", {"aliases": ["text2sql"], "adapter": {
        "base": "base", "weights": "acme/sql-lora", "max_replicas": 2, "load_target": 1}})
    with gw.admin() as admin:
        r = admin.delete("/admin/models/base")
        assert r.status_code == 409 and "adapters sql name 'base'" in r.text, r.text

    client = openai.OpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0)
    wait_for(lambda: routes(gw, key, "sql"), 60, "the adapter routed")
    # The base's engines run with runtime LoRA loading on.
    serving = [rep for rep in replicas(gw) if rep["draining_since"] is None]
    assert len(serving) == 3
    assert all("--enable-lora" in rep["engine_args"] for rep in serving), serving
    listed = {m.id: m for m in client.models.list()}
    assert (listed["sql"].model_extra or {}).get("parent") == "base"
    assert (listed["text2sql"].model_extra or {}).get("parent") == "base"
    assert "parent" not in (listed["base"].model_extra or {})

    raw = client.chat.completions.with_raw_response.create(
        model="text2sql", messages=[{"role": "user", "content": "count rows"}])
    served_by = raw.headers["x-llmgw-replica"]
    answer = raw.parse()
    # The engine served it as the adapter (it answers 404 for one not loaded).
    assert "fake-vllm sql echo" in (answer.choices[0].message.content or "")
    status = adapter_status(gw, "sql")
    assert status["loaded_on"] == [served_by] and status["health"]["state"] == "ok"
    assert engine_logs(cluster.tmp).count("Loaded new LoRA adapter: name 'sql'") == 1

    # Load: six streams of about 3 s at once, load_target 1: a second replica.
    errors: list[BaseException] = []

    def stream(i: int) -> None:
        try:
            out = client.chat.completions.create(
                model="sql", stream=True, max_tokens=60,
                messages=[{"role": "user", "content": " ".join([f"q{i}"] * 80)}])
            assert "".join(c.choices[0].delta.content or "" for c in out if c.choices)
        except BaseException as exc:  # reported below, in the test thread
            errors.append(exc)

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    def loaded(n: int) -> dict[str, Any] | None:
        status = adapter_status(gw, "sql")
        return status if len(status["loaded_on"]) == n else None

    grown = wait_for(lambda: loaded(2), 10, "the subset grown to two")["loaded_on"]
    for t in threads:
        t.join(30)
    assert not errors, errors
    assert served_by in grown and len(set(grown)) == 2
    # max_replicas 2: never on the third replica.
    assert engine_logs(cluster.tmp).count("Loaded new LoRA adapter: name 'sql'") == 2

    # Idle: back to one replica (routing at once), unloaded after the drain.
    shrunk = wait_for(lambda: loaded(1), 10, "the subset shrunk")
    assert shrunk["unloading"] == [r for r in grown if r not in shrunk["loaded_on"]]
    wait_for(lambda: "Removed LoRA adapter: name 'sql'" in engine_logs(cluster.tmp), 15,
             "the adapter unloaded")
    assert adapter_status(gw, "sql")["unloading"] == []
    assert routes(gw, key, "sql")
