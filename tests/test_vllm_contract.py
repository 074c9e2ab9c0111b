"""The engine contract: what llmgw relies on in vLLM's HTTP API, asked of the
stand-in (tests/fakes/fake_vllm.py) and of real vLLM (its CPU build, one
replica of the session's real fleet, tests/support/real_vllm.py) alike, so
the stand-in the rest of the suite runs on cannot drift from the engine.

Each test sends the same requests to both, straight to the engine's port
with the replica's key, as a gateway does, and checks status codes, error
bodies, headers, stream framing, usage and metric names. Text the model
writes differs (the stand-in echoes); its shape does not.

Where they differed when this module was written, the stand-in changed:
- a body that is not JSON: vLLM answers FastAPI's validation error, 400
  `{"type": "Bad Request", "param": "body.<offset>"}`, not the stand-in's
  own "Invalid JSON body." (BadRequestError);
- `messages` not a list: 400 `"Bad Request"`, param `body.messages`;
  an empty list: 400 BadRequestError, param null ("Cannot apply chat
  template to an empty conversation...");
- loading a LoRA adapter from a local folder that is not there: 404
  NotFoundError ("Loading lora NAME failed: No adapter found for PATH"),
  where the stand-in loaded anything; and loading one twice says, as vLLM
  does, how to load it in place.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from app.agent.engines import ENGINE_SITE, GUARD_MIDDLEWARE
from tests.support.procs import ROOT, free_port, wait_for
from tests.support.real_vllm import LORA, MODEL, RealFleet, metric

pytestmark = pytest.mark.timeout(900)  # the real fleet's start counts in the first test

METRICS = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
           "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total")
ASK = [{"role": "user", "content": "Say hi"}]


@dataclass
class Engine:
    kind: str
    url: str
    key: str

    def post(self, path: str, body: Any, key: str | None = "", **kw: Any) -> httpx.Response:
        headers = {} if key is None else {"Authorization": f"Bearer {key or self.key}"}
        if isinstance(body, (bytes, str)):
            return httpx.post(self.url + path, content=body, timeout=60,
                              headers=headers | {"Content-Type": "application/json"}, **kw)
        return httpx.post(self.url + path, json=body, headers=headers, timeout=60, **kw)


@pytest.fixture(scope="module")
def stand_in(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    """The stand-in started as the agent starts vLLM: its flags, the guard,
    the key in VLLM_API_KEY."""
    port, key = free_port(), "llmgw-contract-key"
    log = tmp_path_factory.mktemp("stand-in") / "engine.log"
    env = os.environ | {"VLLM_API_KEY": key, "PYTHONPATH": str(ENGINE_SITE),
                        "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True",
                        # About real vLLM's pace on 2 cores: a stream lasts.
                        "FAKE_VLLM_TOKEN_DELAY": "0.02"}
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            [sys.executable, str(ROOT / "tests" / "fakes" / "fake_vllm.py"), "serve", "/w",
             "--host", "127.0.0.1", "--port", str(port), "--served-model-name", MODEL,
             "--middleware", GUARD_MIDDLEWARE, "--max-model-len=2048", "--enable-lora"],
            env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    engine = Engine("stand-in", f"http://127.0.0.1:{port}", key)
    try:
        wait_for(lambda: httpx.get(engine.url + "/health", timeout=1).status_code == 200, 20,
                 "the stand-in up")
        yield engine
    finally:
        proc.kill()
        proc.wait(5)


@pytest.fixture(params=["stand-in", "vllm"])
def engine(request: pytest.FixtureRequest) -> Engine:
    if request.param == "stand-in":
        found: Engine = request.getfixturevalue("stand_in")
        return found
    fleet: RealFleet = request.getfixturevalue("real_vllm")
    rid = sorted(fleet.whole())[0]
    url, key = fleet.engine(rid)
    return Engine("vllm", url, key)


def events(r: httpx.Response) -> list[str]:
    """The SSE events of a stream, framing checked: `data: X` lines, each
    followed by a blank line, nothing else."""
    text = r.text
    assert text.endswith("\n\n"), text[-40:]
    out = []
    for block in text[:-2].split("\n\n"):
        assert block.startswith("data: ") and "\n" not in block, block
        out.append(block[len("data: "):])
    return out


def test_health_and_metrics_are_open_and_name_the_load(engine: Engine) -> None:
    assert httpx.get(engine.url + "/health", timeout=10).status_code == 200
    r = httpx.get(engine.url + "/metrics", timeout=10)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    for name in METRICS:
        labelled = [line for line in r.text.splitlines() if line.startswith(name + "{")]
        assert labelled and all(f'model_name="{MODEL}"' in line for line in labelled), name
        assert metric(engine.url, name) >= 0


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/tokenize", "/invocations"])
def test_a_request_without_the_key_is_refused_alike(engine: Engine, path: str) -> None:
    for key in (None, "llmgw-wrong"):
        r = engine.post(path, {"model": MODEL, "messages": ASK}, key=key)
        assert r.status_code == 401, (engine.kind, r.text)
        assert r.json() == {"error": "Unauthorized"}
        assert r.headers["www-authenticate"] == "Bearer"


@pytest.mark.parametrize(("body", "status", "kind", "param", "says"), [
    ({"model": "zz", "messages": ASK}, 404, "NotFoundError", "model",
     "The model `zz` does not exist."),
    ({"model": MODEL, "messages": ASK, "max_tokens": -1}, 400, "BadRequestError", "max_tokens",
     "max_tokens must be at least 1, got -1."),
    ({"model": MODEL, "messages": "hi"}, 400, "Bad Request", "body.messages",
     "1 validation error"),
    ({"model": MODEL, "messages": []}, 400, "BadRequestError", None,
     "Cannot apply chat template to an empty conversation."),
    ("{bad json", 400, "Bad Request", "body.1", "1 validation error"),
], ids=["unknown-model", "bad-max-tokens", "messages-not-a-list", "no-messages", "not-json"])
def test_errors_have_the_same_status_and_shape(engine: Engine, body: Any, status: int,
                                               kind: str, param: str | None, says: str) -> None:
    r = engine.post("/v1/chat/completions", body)
    assert r.status_code == status, (engine.kind, r.text)
    assert r.headers["content-type"].startswith("application/json")
    err = r.json()["error"]
    assert (err["type"], err["param"], err["code"]) == (kind, param, status), err
    assert err["message"].startswith(says), err["message"]


def test_a_plain_answer_and_its_usage(engine: Engine) -> None:
    r = engine.post("/v1/chat/completions",
                    {"model": MODEL, "messages": ASK, "max_tokens": 3, "temperature": 0})
    assert r.status_code == 200 and r.headers["content-type"].startswith("application/json")
    answer = r.json()
    assert answer["object"] == "chat.completion" and answer["model"] == MODEL
    assert answer["id"].startswith("chatcmpl-")
    (choice,) = answer["choices"]
    assert choice["message"]["role"] == "assistant" and choice["finish_reason"] == "length"
    usage = answer["usage"]
    assert usage["completion_tokens"] == 3 and usage["prompt_tokens"] > 0
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_a_stream_is_framed_alike_and_ends_with_the_usage_asked_for(
        engine: Engine, path: str) -> None:
    body: dict[str, Any] = {"model": MODEL, "max_tokens": 3, "temperature": 0, "stream": True,
                            "stream_options": {"include_usage": True}}
    body |= {"messages": ASK} if "chat" in path else {"prompt": "Say hi"}
    r = engine.post(path, body)
    assert r.status_code == 200
    assert r.headers["content-type"] == "text/event-stream; charset=utf-8"
    got = events(r)
    assert got[-1] == "[DONE]"
    chunks = [json.loads(e) for e in got[:-1]]
    assert len({c["id"] for c in chunks}) == 1
    usage_chunk = chunks[-1]
    assert usage_chunk["choices"] == []
    usage = usage_chunk["usage"]
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"] == (
        usage["prompt_tokens"] + 3)
    content = [c for c in chunks[:-1] if c["choices"]]
    if "chat" in path:
        # The first event carries the role alone; then one event per token:
        # what llmgw's estimate of a broken stream counts (Client keys, Usage).
        assert content[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        content = content[1:]
    assert len(content) == usage["completion_tokens"]
    assert content[-1]["choices"][0]["finish_reason"] == "length"
    # Without include_usage: no usage event at all.
    body.pop("stream_options")
    plain = [json.loads(e) for e in events(engine.post(path, body))[:-1]]
    assert all(c.get("usage") is None for c in plain) and all(c["choices"] for c in plain)


def test_a_final_assistant_message_is_continued(engine: Engine) -> None:
    """What a stream continued on another replica sends (A stream that
    survives its engine): the text so far as the last message."""
    r = engine.post("/v1/chat/completions", {
        "model": MODEL, "max_tokens": 3, "temperature": 0,
        "messages": [*ASK, {"role": "assistant", "content": "Hello, I am"}],
        "continue_final_message": True, "add_generation_prompt": False})
    assert r.status_code == 200, r.text
    answer = r.json()
    assert answer["choices"][0]["message"]["content"]
    assert answer["usage"]["completion_tokens"] == 3


def test_tokenize_and_detokenize(engine: Engine) -> None:
    r = engine.post("/tokenize", {"model": MODEL, "prompt": "hi there"})
    assert r.status_code == 200, r.text
    tok = r.json()
    assert set(tok) >= {"count", "max_model_len", "tokens"} and tok["max_model_len"] == 2048
    assert tok["count"] == len(tok["tokens"]) >= 1
    assert all(isinstance(t, int) for t in tok["tokens"])
    back = engine.post("/detokenize", {"model": MODEL, "tokens": tok["tokens"]})
    assert back.status_code == 200 and back.json()["prompt"] == "hi there"
    chat = engine.post("/tokenize", {"model": MODEL, "messages": ASK}).json()
    plain = engine.post("/v1/chat/completions",
                        {"model": MODEL, "messages": ASK, "max_tokens": 1}).json()
    assert chat["count"] == plain["usage"]["prompt_tokens"]


def test_the_models_list_and_runtime_lora(engine: Engine) -> None:
    listed = httpx.get(engine.url + "/v1/models", timeout=10,
                       headers={"Authorization": f"Bearer {engine.key}"}).json()
    (served,) = [m for m in listed["data"] if m["id"] == MODEL]
    assert (served["object"], served["owned_by"], served["parent"]) == ("model", "vllm", None)
    assert served["max_model_len"] == 2048
    name = f"contract-{engine.kind}"
    missing = engine.post("/v1/load_lora_adapter",
                          {"lora_name": name, "lora_path": "/nonexistent/lora"})
    assert missing.status_code == 404, missing.text
    assert missing.json()["error"]["type"] == "NotFoundError"
    r = engine.post("/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(LORA)})
    assert r.status_code == 200, r.text
    try:
        twice = engine.post("/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(LORA)})
        assert twice.status_code == 400 and twice.json()["error"]["type"] == "InvalidUserInput"
        listed = httpx.get(engine.url + "/v1/models", timeout=10,
                           headers={"Authorization": f"Bearer {engine.key}"}).json()
        assert {m["id"]: m["parent"] for m in listed["data"]}[name] == MODEL
    finally:
        gone = engine.post("/v1/unload_lora_adapter", {"lora_name": name})
        assert gone.status_code == 200, gone.text
    again = engine.post("/v1/unload_lora_adapter", {"lora_name": name})
    assert again.status_code == 404 and again.json()["error"]["type"] == "NotFoundError"


def test_a_client_that_leaves_aborts_its_request(engine: Engine) -> None:
    with httpx.stream("POST", engine.url + "/v1/completions", timeout=60,
                      headers={"Authorization": f"Bearer {engine.key}"},
                      json={"model": MODEL, "prompt": "1, 2,", "stream": True,
                            "max_tokens": 1000, "ignore_eos": True}) as r:
        lines = r.iter_lines()
        for _ in range(4):
            next(lines)
        assert metric(engine.url, "vllm:num_requests_running") == 1
    left = time.monotonic()
    wait_for(lambda: metric(engine.url, "vllm:num_requests_running") == 0, 2,
             f"{engine.kind}: the request aborted")
    assert time.monotonic() - left < 2


def test_the_stand_ins_recorded_flags_are_vllms() -> None:
    """The stand-in's `serve` parser is generated from flags recorded from a
    vLLM version (tests/fakes/vllm_serve_flags.json): every flag it takes,
    the pinned CPU build's API server takes too (else a command line the
    stand-in passes would stop the real engine at start)."""
    from tests.support.real_vllm import VENV, installed

    installed()
    recorded = json.loads((ROOT / "tests" / "fakes" / "vllm_serve_flags.json").read_text())
    flags = {n for f in recorded["flags"] for n in f["names"] if n.startswith("--")}
    out = subprocess.run([str(VENV / "bin" / "python"), "-m",
                          "vllm.entrypoints.openai.api_server", "--help=all"],
                         capture_output=True, text=True, timeout=300, check=False).stdout
    assert "--served-model-name" in out, "vLLM printed no help"
    taken = set(re.findall(r"--[a-z0-9][a-z0-9-]*", out))
    missing = sorted(flags - taken)
    assert not missing, f"flags the stand-in takes that vLLM does not: {missing}"
