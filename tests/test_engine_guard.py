"""The engine key on every path of a vLLM engine's port
(docs/design/security.md, "The engine's port"): llmgw's ASGI middleware
in-process, then a real agent
starting the vLLM stand-in, which, like vLLM, guards only /v1 by itself."""

from __future__ import annotations

import ast
import json
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.responses import PlainTextResponse
from starlette.routing import Route

from app.agent.engine_site import llmgw_engine_guard as guard
from app.agent.engines import ENGINE_SITE, GUARD_MIDDLEWARE, EngineSpec, command, environment
from app.control.keys import engine_key
from tests.support.procs import SECRET, Cluster, make_key, replicas, serve_one, wait_for

KEY = "llmgw-0123456789abcdef"
Message = dict[str, Any]


class Inner:
    """The app behind the guard: records what reached it."""

    def __init__(self) -> None:
        self.scopes: list[dict[str, Any]] = []

    async def __call__(self, scope: dict[str, Any], receive: Callable[[], Awaitable[Message]],
                       send: Callable[[Message], Awaitable[None]]) -> None:
        self.scopes.append(scope)
        if scope["type"] == "http":
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"inner"})
        elif scope["type"] == "websocket":
            await receive()
            await send({"type": "websocket.accept"})
        else:
            assert (await receive())["type"] == "lifespan.startup"
            await send({"type": "lifespan.startup.complete"})


async def call(mw: guard.EngineKeyMiddleware, scope: dict[str, Any]) -> list[Message]:
    sent: list[Message] = []
    first = {"http": {"type": "http.request", "body": b"", "more_body": False},
             "websocket": {"type": "websocket.connect"},
             "lifespan": {"type": "lifespan.startup"}}.get(scope["type"], {})

    async def receive() -> Message:
        return first

    async def send(message: Message) -> None:
        sent.append(message)

    await mw(scope, receive, send)
    return sent


def http(path: str, *headers: tuple[bytes, bytes], kind: str = "http") -> dict[str, Any]:
    return {"type": kind, "path": path, "method": "POST", "headers": list(headers)}


def bearer(token: str, scheme: str = "Bearer") -> tuple[bytes, bytes]:
    return (b"authorization", f"{scheme} {token}".encode())


def refused(sent: list[Message]) -> bool:
    if sent[0]["status"] != 401:
        return False
    assert json.loads(sent[1]["body"]) == {"error": "Unauthorized"}
    assert (b"www-authenticate", b"Bearer") in sent[0]["headers"]
    return True


GUARDED = ["/invocations", "/tokenize", "/detokenize", "/pooling", "/score", "/rerank",
           "/classify", "/start_profile", "/sleep", "/collective_rpc", "/version", "/docs",
           "/openapi.json", "/v1/chat/completions", "/v1/load_lora_adapter", "/",
           "/health/../invocations", "/healthz", "/metrics/x", "/HEALTH"]


@pytest.mark.parametrize("path", GUARDED)
async def test_a_request_without_the_right_key_is_refused_on_every_guarded_path(
        path: str) -> None:
    inner = Inner()
    mw = guard.EngineKeyMiddleware(inner, KEY)
    for headers in [(), (bearer("wrong"),), (bearer(KEY + "x"),), (bearer(KEY[:-1]),),
                    (bearer(KEY, "Basic"),), (bearer(""),), ((b"authorization", KEY.encode()),),
                    (bearer(KEY), bearer("wrong")), (bearer(KEY), bearer(KEY)),
                    ((b"x-api-key", KEY.encode()),)]:
        assert refused(await call(mw, http(path, *headers))), (path, headers)
    assert inner.scopes == []
    for scheme in ("Bearer", "bearer", "BEARER"):
        assert (await call(mw, http(path, bearer(KEY, scheme))))[1]["body"] == b"inner"
    assert len(inner.scopes) == 3


@pytest.mark.parametrize("path", sorted(guard.OPEN_PATHS))
async def test_health_and_metrics_answer_without_a_key(path: str) -> None:
    inner = Inner()
    mw = guard.EngineKeyMiddleware(inner, KEY)
    assert (await call(mw, http(path)))[1]["body"] == b"inner"
    assert (await call(mw, http(path, bearer("wrong"))))[1]["body"] == b"inner"
    assert guard.OPEN_PATHS == {"/health", "/metrics", "/ping"}


async def test_the_key_comes_from_the_engines_environment_and_none_opens_nothing(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("VLLM_API_KEY", KEY)
    mw = guard.EngineKeyMiddleware(app=Inner())  # as Starlette builds it: cls(app=...)
    assert not refused(await call(mw, http("/tokenize", bearer(KEY))))
    assert refused(await call(mw, http("/tokenize", bearer("other"))))

    monkeypatch.delenv("VLLM_API_KEY")
    inner = Inner()
    mw = guard.EngineKeyMiddleware(inner)
    assert "VLLM_API_KEY is not set" in capsys.readouterr().err
    for headers in [(), (bearer(""),), ((b"authorization", b"Bearer"),), (bearer(KEY),)]:
        assert refused(await call(mw, http("/tokenize", *headers)))
    assert (await call(mw, http("/health")))[1]["body"] == b"inner"


async def test_lifespan_passes_and_a_websocket_needs_the_key() -> None:
    inner = Inner()
    mw = guard.EngineKeyMiddleware(inner, KEY)
    assert await call(mw, {"type": "lifespan"}) == [{"type": "lifespan.startup.complete"}]
    # Closing before the accept: the server answers the handshake with 403.
    for headers in [(), (bearer("wrong"),)]:
        sent = await call(mw, http("/v1/realtime", *headers, kind="websocket"))
        assert sent == [{"type": "websocket.close", "code": 1008}]
    assert [s["type"] for s in inner.scopes] == ["lifespan"]
    sent = await call(mw, http("/v1/realtime", bearer(KEY), kind="websocket"))
    assert sent == [{"type": "websocket.accept"}]
    with pytest.raises(RuntimeError, match="unexpected ASGI scope type 'webtransport'"):
        await call(mw, {"type": "webtransport", "path": "/x"})


async def test_added_to_a_starlette_app_as_vllm_adds_it() -> None:
    async def ok(request: Any) -> PlainTextResponse:
        return PlainTextResponse("served")

    app = Starlette(routes=[Route(p, ok, methods=["GET", "POST"])
                            for p in ("/health", "/metrics", "/invocations", "/v1/models")])
    app.add_middleware(guard.EngineKeyMiddleware)  # type: ignore[arg-type]
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_API_KEY", KEY)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://engine") as c:
            assert (await c.post("/invocations")).status_code == 401
            r = await c.post("/invocations", headers={"Authorization": f"Bearer {KEY}"})
            assert (r.status_code, r.text) == (200, "served")
            assert (await c.get("/health")).status_code == 200
            assert (await c.get("/metrics")).status_code == 200
            assert (await c.get("/v1/models")).status_code == 401


def test_the_module_imports_only_the_standard_library() -> None:
    """The engine's venv does not have llmgw: nothing but the stdlib."""
    names = {p.name for p in ENGINE_SITE.iterdir() if p.name != "__pycache__"}
    assert names == {"__init__.py", "llmgw_engine_guard.py"}
    tree = ast.parse((ENGINE_SITE / "llmgw_engine_guard.py").read_text())
    imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import)
                for a in n.names}
    imported |= {(n.module or "").split(".")[0] for n in ast.walk(tree)
                 if isinstance(n, ast.ImportFrom)}
    assert imported and imported <= set(sys.stdlib_module_names) | {"__future__"}


def test_vllm_is_started_with_the_guard_on_its_pythonpath(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTHONPATH", "/opt/theirs")
    spec = EngineSpec(replica_id="m-1", model="m", weights="acme/m", engine="vllm",
                      gpus=(0,), key=KEY)
    cmd = command(spec, "127.0.0.1", 8000, "vllm")
    assert cmd[cmd.index("--middleware") + 1] == GUARD_MIDDLEWARE
    assert KEY not in " ".join(cmd)
    env = environment(spec)
    assert env["PYTHONPATH"] == f"{ENGINE_SITE}:/opt/theirs" and env["VLLM_API_KEY"] == KEY
    module, name = GUARD_MIDDLEWARE.rsplit(".", 1)
    assert (Path(env["PYTHONPATH"].split(":")[0]) / f"{module}.py").is_file()
    assert getattr(guard, name) is guard.EngineKeyMiddleware
    llama = EngineSpec(replica_id="m-2", model="m", weights="/w.gguf", engine="llamacpp",
                       gpus=(), key=KEY)
    assert "--middleware" not in command(llama, "127.0.0.1", 8000, "vllm")


# --- a real agent, the vLLM stand-in ----------------------------------------------------


def test_an_engine_the_agent_starts_answers_only_with_its_key(cluster: Cluster) -> None:
    gw = cluster.gateway("gw-a")
    cluster.agent("node-1", [gw], "--gpus", "1")
    served = serve_one(gw)  # the agent's readiness probe (/v1/models, with the key) passed
    url, ekey = served.replica["url"], engine_key(SECRET, served.replica["id"])
    chat = {"model": "m", "messages": [{"role": "user", "content": "free lunch?"}]}
    posts = {"/invocations": chat, "/tokenize": {"model": "m", "prompt": "count me"},
             "/pooling": {"model": "m", "input": "x"}, "/score": {"model": "m"},
             "/v1/chat/completions": chat}
    with httpx.Client(base_url=url, timeout=5) as engine:
        for path, body in posts.items():
            # The stand-in, like vLLM, answers all but /v1 to anyone by itself.
            r = engine.post(path, json=body)
            assert r.status_code == 401 and r.json() == {"error": "Unauthorized"}, (path, r.text)
            assert engine.post(path, json=body,
                               headers={"Authorization": "Bearer " + make_key(gw)}
                               ).status_code == 401  # a client key is not the engine's
        auth = {"Authorization": f"Bearer {ekey}"}
        r = engine.post("/invocations", json=chat, headers=auth)
        assert r.status_code == 200 and "free lunch?" in r.json()["choices"][0]["message"][
            "content"]
        assert engine.post("/tokenize", json=posts["/tokenize"], headers=auth).json()[
            "count"] == 2
        assert engine.get("/version").status_code == 401
        for path in ("/health", "/metrics", "/ping"):
            assert engine.get(path).status_code == 200, path
        assert "vllm:num_requests_running" in engine.get("/metrics").text

    def polled() -> bool:  # the gateways' load poll still reads the engine's /metrics
        with gw.admin() as admin:
            rows = admin.get("/admin/routes", params={"model": "m"}).json()["endpoints"]
        return len(rows) == 1 and rows[0]["engine"] is not None

    wait_for(polled, 10, "the engine's load polled")
    # Liveness probes (/health) kept passing: still ready, and served through us.
    assert [r["phase"] for r in replicas(gw)] == ["ready"]
    r = httpx.post(gw.url + "/v1/chat/completions", json=chat, timeout=10,
                   headers={"Authorization": f"Bearer {served.key}"})
    assert r.status_code == 200 and "free lunch?" in r.text
