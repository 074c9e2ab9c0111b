"""llama-cpp-python's OpenAI server (`python -m llama_cpp.server`), as the
agent starts it: the same server and arguments, its access log without the
agent's liveness probe.

A ready engine is asked every second whether it is alive (health.py).
llama-cpp-python's server has no health route, so the probe is `GET /docs`,
and its access log would write a line for it every second: 86,400 a day,
burying what the engine said before a failure (the last lines a death's
detail shows, `llmgw ctl logs`). The server takes no option for its access
log, so a filter is put on uvicorn's access logger before the server starts
it (uvicorn's logging configuration replaces a logger's handlers, never its
filters). Every other request is logged as before.

One route is added to the server (app/wire/engine_routes.py,
`PROMPT_TOKENS`): a chat's prompt counted as its chat completion counts it,
without running the model. llama-cpp-python's stream sends no usage, so the
gateway asks for the count when the stream ends; before this route it asked
a one-token chat, which prefilled the whole prompt again (a 221-token
prompt at 4 streams at once: twice the engine's prefill work). The count
goes through the very handler a chat completion goes through (its chat
format or the GGUF's template, its tokenizer), stopped where the
completion would start: the count is the same by construction.
"""

from __future__ import annotations

import logging
import runpy
from collections.abc import Callable
from typing import Any, cast

from app.agent.health import LIVENESS_PATHS
from app.wire.engine_routes import PROMPT_FIELDS, PROMPT_TOKENS

PROBE = LIVENESS_PATHS["llamacpp"]


class NoProbe(logging.Filter):
    """Drops uvicorn's access line of a GET of the probe's path. The line's
    arguments are (client, method, path and query, HTTP version, status)."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        return not (isinstance(args, tuple) and len(args) >= 3
                    and args[1] == "GET" and args[2] == PROBE)


class _Counted(Exception):
    def __init__(self, tokens: int) -> None:
        self.tokens = tokens


class _Counting:
    """The model as a chat handler sees it, but for its completion, which
    is never run: the handler's tokenized prompt is counted instead."""

    def __init__(self, llama: Any) -> None:
        self._llama = llama

    def __getattr__(self, name: str) -> Any:
        return getattr(self._llama, name)

    def create_completion(self, prompt: Any = None, *args: Any, **kwargs: Any) -> Any:
        raise _Counted(len(prompt) if isinstance(prompt, list | str | bytes) else 0)


def prompt_tokens(llama: Any, body: dict[str, Any]) -> int:
    """`body`'s prompt tokens, as `llama.create_chat_completion(**body)`
    would count them (its handler chosen as that method chooses it)."""
    from llama_cpp import llama_chat_format

    handler = (llama.chat_handler or llama._chat_handlers.get(llama.chat_format)
               or llama_chat_format.get_chat_completion_handler(llama.chat_format))
    try:
        handler(llama=cast(Any, _Counting(llama)),
                **{k: body[k] for k in PROMPT_FIELDS if k in body})
    except _Counted as counted:
        return counted.tokens
    raise ValueError("the chat handler ran no completion")


def _with_prompt_tokens(create_app: Callable[..., Any]) -> Callable[..., Any]:
    """llama-cpp-python's `create_app`, whose app also has `PROMPT_TOKENS`,
    behind the same key as its other routes."""
    from fastapi import Body, Depends, HTTPException
    from llama_cpp.server import app as server

    async def count(body: dict[str, Any] = Body(...),  # noqa: B008 (FastAPI's way)
                    llama_proxy: Any = Depends(server.get_llama_proxy)) -> dict[str, int]:  # noqa: B008
        if not isinstance(body.get("messages"), list):
            raise HTTPException(400, "messages must be a list")
        model = body.get("model")
        try:
            return {"count": prompt_tokens(llama_proxy(model if isinstance(model, str)
                                                       else None), body)}
        except Exception as exc:  # the template's or the tokenizer's refusal
            raise HTTPException(400, f"cannot count this chat's prompt: {exc}") from None

    def create(*args: Any, **kwargs: Any) -> Any:
        app = create_app(*args, **kwargs)
        app.add_api_route(PROMPT_TOKENS, count, methods=["POST"], tags=["Extras"],
                          summary="A chat's prompt tokens, the model not run (llmgw)",
                          dependencies=[Depends(server.authenticate)])
        return app

    return create


def main() -> None:
    logging.getLogger("uvicorn.access").addFilter(NoProbe())
    # The server's module imports `create_app` from here as it starts.
    from llama_cpp.server import app as server

    server.create_app = _with_prompt_tokens(server.create_app)
    runpy.run_module("llama_cpp.server", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
