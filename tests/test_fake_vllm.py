"""Tests for the fake vLLM (tests/fakes): started as a real process through the
``tests/fakes/bin/vllm`` shim, spoken to with the official ``openai`` client and aiohttp."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import httpx
import openai
import pytest

from app.ports import free_port

FAKES = Path(__file__).resolve().parent / "fakes"
SHIM = FAKES / "bin" / "vllm"
API_KEY = "sk-fake-test"
MODEL = "org/Fake-Model-7B"
NAMES = ["fake-model", "alias-model"]


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["FAKE_VLLM_PYTHON"] = sys.executable
    for k in ("FAKE_VLLM_TOKEN_DELAY", "FAKE_VLLM_STARTUP_DELAY", "FAKE_VLLM_HOLD_DIR"):
        env.pop(k, None)
    env.update(extra)
    return env


@dataclass
class Proc:
    proc: subprocess.Popen[bytes]
    port: int
    stderr_path: Path
    ready_after: float

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stderr(self) -> str:
        return self.stderr_path.read_text()


def _spawn(workdir: Path, args: list[str], env: dict[str, str]) -> Proc:
    """Start the fake via the shim (absolute path, foreign cwd); does not wait."""
    port = free_port()
    err = workdir / f"vllm-{port}.stderr"
    with err.open("wb") as fh:
        proc = subprocess.Popen(
            [str(SHIM), "serve", MODEL, "--host", "127.0.0.1", "--port", str(port), *args],
            cwd=workdir, env=env, stdout=subprocess.DEVNULL, stderr=fh,
        )
    return Proc(proc, port, err, time.monotonic())


def _wait_healthy(p: Proc, timeout: float = 10.0) -> Proc:
    """Poll /health; afterwards ``ready_after`` is seconds from spawn to first 200."""
    t0 = p.ready_after
    while True:
        if p.proc.poll() is not None:
            raise AssertionError(f"fake vllm exited {p.proc.returncode}: {p.stderr()}")
        try:
            with urllib.request.urlopen(p.base + "/health", timeout=1) as r:
                if r.status == 200:
                    break
        except (urllib.error.URLError, ConnectionError, OSError):
            pass
        if time.monotonic() - t0 > timeout:
            _stop(p)
            raise AssertionError(f"fake vllm not healthy in {timeout}s: {p.stderr()}")
        time.sleep(0.02)
    p.ready_after = time.monotonic() - t0
    return p


def _stop(p: Proc) -> None:
    if p.proc.poll() is None:
        p.proc.terminate()
        try:
            p.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            p.proc.kill()
            p.proc.wait()


STARTUP_DELAY = 0.8
TOKEN_DELAY = 0.15


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Proc, Proc, Proc]]:
    """Three fakes, spawned together so their start-ups overlap.

    ``server``: key required, two served names, every flag the brief lists.
    ``slow``: FAKE_VLLM_TOKEN_DELAY and FAKE_VLLM_STARTUP_DELAY set, no key.
    ``doomed``: 5 s per token; the SIGTERM test kills it mid-stream.
    """
    workdir = tmp_path_factory.mktemp("fake-vllm")
    main = _spawn(
        workdir,
        ["--served-model-name", *NAMES, "--api-key", API_KEY, "-tp", "2",
         "--gpu-memory-utilization", "0.85", "--max-model-len", "8192", "--dtype", "bfloat16",
         "--download-dir", str(workdir), "--trust-remote-code", "--enable-prefix-caching",
         "--max-num-seqs", "8", "--no-enable-log-requests", "--uvicorn-log-level", "warning",
         "--generation-config", "vllm", "--enforce-eager"],
        _env(CUDA_VISIBLE_DEVICES="3,5"),
    )
    slow = _spawn(workdir, ["--served-model-name", "slow"],
                  _env(FAKE_VLLM_TOKEN_DELAY=str(TOKEN_DELAY),
                       FAKE_VLLM_STARTUP_DELAY=str(STARTUP_DELAY)))
    doomed = _spawn(workdir, [], _env(FAKE_VLLM_TOKEN_DELAY="5"))
    try:
        _wait_healthy(main)
        _wait_healthy(slow)
        _wait_healthy(doomed)
        yield main, slow, doomed
    finally:
        for p in (main, slow, doomed):
            _stop(p)


@pytest.fixture
def server(servers: tuple[Proc, Proc, Proc]) -> Proc:
    return servers[0]


@pytest.fixture
def slow_server(servers: tuple[Proc, Proc, Proc]) -> Proc:
    return servers[1]


def _client(server: Proc, key: str = API_KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base + "/v1", api_key=key, max_retries=0, timeout=10)


def _metrics(text: str) -> dict[tuple[str, str], float]:
    out: dict[tuple[str, str], float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = re.fullmatch(r"([a-zA-Z_:][a-zA-Z0-9_:]*)(\{.*\})? (\S+)", line)
        assert m, f"bad exposition line: {line!r}"
        out[(m.group(1), m.group(2) or "")] = float(m.group(3))
    return out


async def _get_metrics(base: str) -> dict[tuple[str, str], float]:
    async with aiohttp.ClientSession() as s, s.get(base + "/metrics") as r:
        assert r.status == 200
        return _metrics(await r.text())


def _labels(name: str, **extra: str) -> str:
    parts = [f'model_name="{name}"', 'engine="0"'] + [f'{k}="{v}"' for k, v in extra.items()]
    return "{" + ",".join(parts) + "}"


# ------------------------------------------------------------------- command line


def test_unknown_flag_exits_2(tmp_path: Path) -> None:
    # --gpu-memory is a prefix of a real flag: argparse would accept it by default,
    # the fake turns prefix matching off, so it must be reported as well.
    r = subprocess.run(
        [str(SHIM), "serve", MODEL, "--port", "1", "--bogus-flag", "x", "--gpu-memory", "0.5"],
        cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=10,
    )
    assert r.returncode == 2
    assert "error: unrecognized arguments: --bogus-flag x --gpu-memory 0.5" in r.stderr


def test_hold_file_keeps_the_port_unbound_until_removed(tmp_path: Path) -> None:
    """FAKE_VLLM_HOLD_DIR: an engine whose served name has a file there
    loads until the file goes; one whose name has none starts at once."""
    hold = tmp_path / "hold"
    hold.mkdir()
    (hold / "held").touch()
    env = _env(FAKE_VLLM_HOLD_DIR=str(hold))
    held = _spawn(tmp_path, ["--served-model-name", "held"], env)
    free = _spawn(tmp_path, ["--served-model-name", "free"], env)
    try:
        _wait_healthy(free)
        deadline = time.monotonic() + 10
        while "FAKE_VLLM_HOLD_DIR" not in held.stderr():
            assert time.monotonic() < deadline, held.stderr()
            time.sleep(0.02)
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", held.port), timeout=1).close()
        (hold / "held").unlink()
        _wait_healthy(held)
        assert "released" in held.stderr()
    finally:
        _stop(held)
        _stop(free)


def test_shim_found_on_path(tmp_path: Path) -> None:
    env = _env(PATH=f"{SHIM.parent}{os.pathsep}{os.environ.get('PATH', '')}")
    r = subprocess.run(["vllm", "--version"], cwd=tmp_path, env=env, capture_output=True,
                       text=True, timeout=10)
    assert r.returncode == 0, r.stderr
    assert "fake" in r.stdout


def test_startup_log_names_model_port_and_gpus(server: Proc) -> None:
    err = server.stderr()
    line = next((ln for ln in err.splitlines() if f":{server.port}" in ln), "")
    assert MODEL in line and "CUDA_VISIBLE_DEVICES=3,5" in line, err


# ----------------------------------------------------------------- auth / health


async def test_health_and_metrics_without_key(server: Proc) -> None:
    async with aiohttp.ClientSession() as s:
        async with s.get(server.base + "/health") as r:
            assert r.status == 200
            assert await r.read() == b""
        async with s.get(server.base + "/metrics") as r:
            assert r.status == 200
            assert r.headers["Content-Type"].startswith("text/plain")


async def test_v1_requires_the_key(server: Proc) -> None:
    async with aiohttp.ClientSession() as s:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
            async with s.get(server.base + "/v1/models", headers=headers) as r:
                assert r.status == 401, headers
                assert await r.json() == {"error": "Unauthorized"}
        async with s.post(server.base + "/v1/chat/completions",
                          json={"model": NAMES[0], "messages": []}) as r:
            assert r.status == 401
        async with s.get(server.base + "/v1/models",
                         headers={"Authorization": f"Bearer {API_KEY}"}) as r:
            assert r.status == 200
            body = await r.json()
    assert body["object"] == "list"
    assert [m["id"] for m in body["data"]] == NAMES
    first = body["data"][0]
    assert first["object"] == "model" and first["owned_by"] == "vllm"
    assert first["root"] == MODEL and first["max_model_len"] == 8192


async def test_paths_outside_v1_answer_without_the_key_as_in_vllm(server: Proc) -> None:
    """vLLM's --api-key guards /v1 only (its security docs; vllm-project/vllm#58144)."""
    chat = {"model": NAMES[0], "messages": [{"role": "user", "content": "no key"}]}
    async with aiohttp.ClientSession() as s:
        async with s.post(server.base + "/invocations", json=chat) as r:
            assert r.status == 200
            assert "no key" in (await r.json())["choices"][0]["message"]["content"]
        async with s.post(server.base + "/tokenize", json={"prompt": "a b c"}) as r:
            assert r.status == 200 and (await r.json())["count"] == 3
        for path in ("/detokenize", "/pooling", "/classify", "/score", "/rerank"):
            async with s.post(server.base + path, json={
                    "input": "x", "tokens": [1], "text_1": "a", "text_2": "b", "query": "a",
                    "documents": ["b"]}) as r:
                assert r.status == 200, path


def test_middleware_is_added_as_vllm_adds_it(tmp_path: Path) -> None:
    """--middleware: a class through add_middleware, a coroutine function through
    app.middleware("http"), the last given outermost, around vLLM's own check."""
    site = Path(__file__).resolve().parents[1] / "app" / "agent" / "engine_site"
    p = _spawn(tmp_path, ["--middleware", "llmgw_engine_guard.EngineKeyMiddleware",
                          "--middleware", "fake_vllm_more.refuse_marked"],
               _env(PYTHONPATH=str(site), VLLM_API_KEY=API_KEY))
    try:
        _wait_healthy(p)
        auth = {"Authorization": f"Bearer {API_KEY}"}
        with httpx_client(p) as c:
            assert c.post("/tokenize", json={"prompt": "x"}).status_code == 401  # the class
            assert c.post("/tokenize", json={"prompt": "x"}, headers=auth).status_code == 200
            marked = {"x-refuse": "1"}
            r = c.post("/tokenize", json={"prompt": "x"}, headers=marked)  # outermost
            assert (r.status_code, r.json()) == (418, {"refused": "/tokenize"})
            assert c.get("/v1/models", headers=auth).status_code == 200
            assert c.get("/metrics").status_code == 200
    finally:
        _stop(p)


def test_a_bad_middleware_stops_the_start(tmp_path: Path) -> None:
    for path, why in (("fake_vllm_more.not_a_middleware", "ValueError: Invalid middleware"),
                      ("no_such_module.Guard", "ModuleNotFoundError")):
        r = subprocess.run([str(SHIM), "serve", MODEL, "--port", str(free_port()),
                            "--middleware", path], cwd=tmp_path, env=_env(),
                           capture_output=True, text=True, timeout=20)
        assert r.returncode == 1 and why in r.stderr, r.stderr


def httpx_client(p: Proc) -> httpx.Client:
    return httpx.Client(base_url=p.base, timeout=5)


def test_openai_client_wrong_key_is_authentication_error(server: Proc) -> None:
    with _client(server, key="wrong") as c:
        with pytest.raises(openai.AuthenticationError):
            c.models.list()
        with pytest.raises(openai.AuthenticationError):
            c.chat.completions.create(model=NAMES[0],
                                      messages=[{"role": "user", "content": "hi"}])


def test_unknown_model_is_404(server: Proc) -> None:
    with _client(server) as c, pytest.raises(openai.NotFoundError) as ei:
        c.chat.completions.create(model="nope", messages=[{"role": "user", "content": "hi"}])
    assert ei.value.status_code == 404
    assert ei.value.body == {"message": "The model `nope` does not exist.",
                             "type": "NotFoundError", "param": "model", "code": 404}


# ------------------------------------------------------------------ completions


def test_chat_non_stream(server: Proc) -> None:
    with _client(server) as c:
        r = c.chat.completions.create(
            model=NAMES[1],
            messages=[{"role": "system", "content": "be brief"},
                      {"role": "user", "content": "first question"},
                      {"role": "assistant", "content": "ok"},
                      {"role": "user", "content": "hello there"}],
        )
    assert r.object == "chat.completion"
    assert r.model == NAMES[1]
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == "fake-vllm alias-model echo: hello there"
    assert r.choices[0].finish_reason == "stop"
    assert r.usage is not None
    assert r.usage.completion_tokens == 5
    assert r.usage.prompt_tokens > 0
    assert r.usage.total_tokens == r.usage.prompt_tokens + 5


def test_chat_stream_with_usage(server: Proc) -> None:
    with _client(server) as c:
        chunks = list(c.chat.completions.create(
            model=NAMES[0], messages=[{"role": "user", "content": "count one two three"}],
            stream=True, stream_options={"include_usage": True},
        ))
    assert all(ch.object == "chat.completion.chunk" for ch in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    content = [ch for ch in chunks if ch.choices and ch.choices[0].delta.content]
    assert len(content) == 7  # one word per chunk
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == "fake-vllm fake-model echo: count one two three"
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "stop"
    assert all(ch.choices[0].finish_reason is None for ch in chunks[:-2])
    usage_chunk = chunks[-1]
    assert usage_chunk.choices == []
    assert usage_chunk.usage is not None and usage_chunk.usage.completion_tokens == 7


async def test_chat_stream_raw_sse_without_usage(server: Proc) -> None:
    async with aiohttp.ClientSession() as s, s.post(
        server.base + "/v1/chat/completions",
        headers={"Authorization": f"Bearer {API_KEY}"},
        json={"model": NAMES[0], "stream": True, "max_tokens": 3,
              "messages": [{"role": "user", "content": "truncate me please"}]},
    ) as r:
        assert r.status == 200
        assert r.headers["Content-Type"].startswith("text/event-stream")
        raw = (await r.read()).decode()
    events = raw.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    payloads = [json.loads(e.removeprefix("data: ")) for e in events[:-2]]
    assert all(e.startswith("data: ") for e in events[:-1])
    assert all(p["choices"] for p in payloads)  # no usage chunk unless asked
    assert all("usage" not in p or p["usage"] is None for p in payloads)
    text = "".join(p["choices"][0]["delta"].get("content", "") for p in payloads)
    assert text == "fake-vllm fake-model echo:"  # max_tokens=3 words
    assert payloads[-1]["choices"][0]["finish_reason"] == "length"


def test_max_tokens_truncates_non_stream(server: Proc) -> None:
    with _client(server) as c:
        r = c.chat.completions.create(model=NAMES[0], max_tokens=2,
                                      messages=[{"role": "user", "content": "a b c"}])
    assert r.choices[0].message.content == "fake-vllm fake-model"
    assert r.choices[0].finish_reason == "length"
    assert r.usage is not None and r.usage.completion_tokens == 2


def test_text_completions(server: Proc) -> None:
    with _client(server) as c:
        r = c.completions.create(model=NAMES[1], prompt="say hi", max_tokens=50)
        assert r.object == "text_completion"
        assert r.choices[0].text == "fake-vllm alias-model echo: say hi"
        assert r.choices[0].finish_reason == "stop"
        assert r.usage is not None and r.usage.completion_tokens == 5
        assert r.usage.prompt_tokens == 2
        chunks = list(c.completions.create(model=NAMES[1], prompt="say hi", max_tokens=4,
                                           stream=True,
                                           stream_options={"include_usage": True}))
    text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
    assert text == "fake-vllm alias-model echo: say"
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 4


async def test_metrics_count_tokens_and_requests(server: Proc) -> None:
    lab = _labels(NAMES[0])
    ok = _labels(NAMES[0], finished_reason="stop")
    before = await _get_metrics(server.base)
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting",
                 "vllm:kv_cache_usage_perc", "vllm:prompt_tokens_total",
                 "vllm:generation_tokens_total"):
        assert (name, lab) in before, name
    assert ("vllm:request_success_total", ok) in before
    async with aiohttp.ClientSession() as s, s.post(
        server.base + "/v1/completions", headers={"Authorization": f"Bearer {API_KEY}"},
        json={"model": NAMES[1], "prompt": "one two three"},
    ) as r:
        assert r.status == 200
    after = await _get_metrics(server.base)
    # the model_name label is the first served name, whichever alias was asked for
    assert after[("vllm:generation_tokens_total", lab)] - before[
        ("vllm:generation_tokens_total", lab)] == 6
    assert after[("vllm:prompt_tokens_total", lab)] - before[
        ("vllm:prompt_tokens_total", lab)] == 3
    assert after[("vllm:request_success_total", ok)] - before[
        ("vllm:request_success_total", ok)] == 1
    assert after[("vllm:num_requests_running", lab)] == 0


async def test_a_repeated_chat_prefix_is_a_prefix_cache_hit(server: Proc) -> None:
    lab = _labels(NAMES[0])
    before = await _get_metrics(server.base)
    first = [{"role": "system", "content": "a b c d e f g h"},
             {"role": "user", "content": "one"}]
    nxt = [*first, {"role": "assistant", "content": "x"}, {"role": "user", "content": "two"}]
    async with aiohttp.ClientSession() as s:
        for messages in (first, nxt):
            async with s.post(server.base + "/v1/chat/completions",
                              headers={"Authorization": f"Bearer {API_KEY}"},
                              json={"model": NAMES[0], "messages": messages}) as r:
                assert r.status == 200
    after = await _get_metrics(server.base)
    hits = after[("vllm:prefix_cache_hits_total", lab)] - before[
        ("vllm:prefix_cache_hits_total", lab)]
    assert hits == 9 + 2  # the second turn found the first's system and user messages


# ------------------------------------------------------------ slow: live gauges


async def test_startup_delay_and_running_gauge_during_slow_stream(
    server: Proc, slow_server: Proc
) -> None:
    # Both were spawned together; only the slow one waits FAKE_VLLM_STARTUP_DELAY.
    assert slow_server.ready_after - server.ready_after >= STARTUP_DELAY * 0.6
    lab = _labels("slow")
    base = slow_server.base
    async with aiohttp.ClientSession() as s:
        assert (await _get_metrics(base))[("vllm:num_requests_running", lab)] == 0
        async with s.post(base + "/v1/chat/completions", json={
            "model": "slow", "stream": True, "messages": [{"role": "user", "content": "x"}],
        }) as r:
            assert r.status == 200
            first = await r.content.readuntil(b"\n\n")
            assert b'"role":"assistant"' in first
            live = await _get_metrics(base)
            assert live[("vllm:num_requests_running", lab)] == 1
            assert live[("vllm:kv_cache_usage_perc", lab)] > 0
            rest = await r.read()
        assert rest.endswith(b"data: [DONE]\n\n")
        assert (await _get_metrics(base))[("vllm:num_requests_running", lab)] == 0

        # a client that hangs up mid-stream frees its slot
        resp = await s.post(base + "/v1/completions",
                            json={"model": "slow", "prompt": "a b c", "stream": True,
                                  "max_tokens": 20})
        await resp.content.readuntil(b"\n\n")
        assert (await _get_metrics(base))[("vllm:num_requests_running", lab)] == 1
        resp.close()
        deadline = time.monotonic() + 3
        running = 1.0
        while time.monotonic() < deadline:
            running = (await _get_metrics(base))[("vllm:num_requests_running", lab)]
            if running == 0:
                break
            await asyncio.sleep(0.05)
        assert running == 0


async def test_sigterm_exits_cleanly_with_stream_in_flight(
    servers: tuple[Proc, Proc, Proc],
) -> None:
    p = servers[2]
    try:
        async with aiohttp.ClientSession() as s, s.post(
            p.base + "/v1/chat/completions",
            json={"model": MODEL, "stream": True,
                  "messages": [{"role": "user", "content": "hang"}]},
        ) as r:
            await r.content.readuntil(b"\n\n")
            t0 = time.monotonic()
            p.proc.send_signal(signal.SIGTERM)
            rc = p.proc.wait(timeout=5)
            took = time.monotonic() - t0
        assert rc == 0
        assert took < 2.0
    finally:
        _stop(p)
