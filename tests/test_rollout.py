"""A spec change on a one-replica model, across real processes: the new
replica is ready before the old one drains, clients are answered throughout,
and a long stream through the draining replica runs to its end."""

from __future__ import annotations

import threading
import time
from typing import Any

import openai
import pytest

from tests.support.procs import (
    Cluster,
    make_key,
    put_model,
    replicas,
    routes,
    wait_for,
    wait_ready,
)

WORDS = [f"w{i}" for i in range(120)]  # 12 s at 0.1 s a word


def test_a_spec_change_is_answered_throughout_and_a_long_stream_on_the_old_replica_ends(
    cluster: Cluster, monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Engines take a while to load, and generate one word every 0.1 s.
    monkeypatch.setenv("FAKE_VLLM_STARTUP_DELAY", "1")
    monkeypatch.setenv("FAKE_VLLM_TOKEN_DELAY", "0.1")
    gws = [cluster.gateway(n, usage_interval="0.5") for n in ("gw-a", "gw-b")]
    cluster.agent("node-1", gws, "--gpus", "2")
    wait_for(lambda: gws[0].admin().get("/admin/nodes").json(), 15, "node-1 registered")
    key = make_key(gws[0])
    put_model(gws[0], "chat", {"model": "acme/chat", "revision": "v1", "gpus": 1})
    old = wait_ready(gws[0], 60)["id"]
    for gw in gws:
        wait_for(lambda g=gw: routes(g, key, "chat"), 10, f"{gw.name} routing")

    # A long stream through gw-b, started on the old (the only) replica.
    streaming = openai.OpenAI(base_url=gws[1].url + "/v1", api_key=key, max_retries=0)
    stream = iter(streaming.chat.completions.create(
        model="chat", messages=[{"role": "user", "content": " ".join(WORDS)}], stream=True))
    text = [next(stream).choices[0].delta.content or ""]

    # And a client asking through gw-a all along.
    answered, failures = [0], list[str]()
    done = threading.Event()

    def read_stream() -> None:
        try:
            text.extend(ch.choices[0].delta.content or "" for ch in stream if ch.choices)
        except openai.OpenAIError as exc:  # the stream cut: what a short drain did
            failures.append(f"stream: {exc!r}")

    def ask() -> None:
        client = openai.OpenAI(base_url=gws[0].url + "/v1", api_key=key, max_retries=0)
        while not done.is_set():
            try:
                client.chat.completions.create(
                    model="chat", messages=[{"role": "user", "content": "hi"}])
                answered[0] += 1
            except openai.OpenAIError as exc:
                failures.append(repr(exc))

    threads = [threading.Thread(target=read_stream), threading.Thread(target=ask)]
    for t in threads:
        t.start()
    try:
        put_model(gws[0], "chat", {"model": "acme/chat", "revision": "v2", "gpus": 1})

        def draining() -> list[dict[str, Any]] | None:
            reps = replicas(gws[0])
            return reps if any(r["id"] == old and r["phase"] == "stopping" for r in reps) else None

        # The old one drains only once its replacement is ready...
        reps = wait_for(draining, 60, "the old replica draining")
        assert [r["phase"] for r in reps if r["id"] != old] == ["ready"], reps
        # ...and stays while the stream through it runs.
        assert threads[0].is_alive(), "the stream ended before the drain began"
        threads[0].join(60)
        assert not threads[0].is_alive()
        ended = time.monotonic()
        assert "".join(text).split()[-len(WORDS):] == WORDS, failures  # every word, none cut
        wait_for(lambda: old not in {r["id"] for r in replicas(gws[0])}, 30,
                 "the old replica removed once its stream ended")
        print(f"old replica removed {time.monotonic() - ended:.1f} s after its stream ended")
    finally:
        done.set()
        for t in threads:
            t.join(30)
    assert failures == [] and answered[0] > 0, (answered, failures[:3])
    print(f"{answered[0]} requests answered during the rollout, none refused")
