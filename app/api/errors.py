"""Error shapes: OpenAI's on /v1, RFC 9457 problem JSON everywhere else.

Every failure a client can cause gets a clear 4xx, and anything unexpected
a 500 without a traceback in the body (the traceback goes to the log).
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException

from app.router.own_answers import openai_error_body

logger = logging.getLogger(__name__)

_OPENAI_TYPES = {400: "invalid_request_error", 401: "invalid_request_error",
                 403: "permission_error", 404: "invalid_request_error",
                 405: "invalid_request_error", 503: "service_unavailable"}


# What an operator must do when etcd's NOSPACE alarm is raised; said by
# writes' 503s and by /readyz (docs/design/security-operations.md, "A month of uptime").
NOSPACE_DETAIL = (
    "the change was not saved: the store (etcd) is out of space (its NOSPACE alarm is "
    "raised) and refuses writes; routing goes on from the last known state. An operator "
    "must free space: compact (the leader does every LLMGW_ETCD_COMPACTION_INTERVAL), "
    "defragment each member (etcdctl defrag), then disarm the alarm (etcdctl alarm disarm)."
)
NOSPACE_ACTION = "compact, defragment (etcdctl defrag), disarm (etcdctl alarm disarm)"


class Problem(Exception):
    """Raised by admin and agent routes; rendered as problem JSON."""

    def __init__(self, status: int, title: str, detail: str = "", **extra: Any) -> None:
        super().__init__(detail or title)
        self.status = status
        self.title = title
        self.detail = detail
        self.extra = extra


def problem(status: int, title: str, detail: str = "", **extra: Any) -> JSONResponse:
    body: dict[str, Any] = {"type": "about:blank", "title": title, "status": status}
    if detail:
        body["detail"] = detail
    body.update(extra)
    headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
    if status == 412 and isinstance(extra.get("etag"), str):  # the revision now (writes.py)
        headers = {"ETag": extra["etag"]}
    return JSONResponse(body, status_code=status, media_type="application/problem+json",
                        headers=headers)


def openai_error(status: int, message: str, type_: str) -> Response:
    return Response(openai_error_body(message, type_), status_code=status,
                    media_type="application/json")


def _is_openai(request: Request) -> bool:
    return request.url.path.startswith("/v1")


def install(app: FastAPI, unavailable: type[Exception], full: type[Exception]) -> None:
    """Renders problems, and the store's errors: `unavailable` (the store
    did not answer) and its subclass `full` (etcd's NOSPACE alarm), handed
    in by the composition root (app/gateway/main.py) so the api imports no store."""

    @app.exception_handler(Problem)
    async def _problem(request: Request, exc: Problem) -> Response:
        if _is_openai(request):
            return openai_error(exc.status, exc.detail or exc.title,
                                _OPENAI_TYPES.get(exc.status, "server_error"))
        return problem(exc.status, exc.title, exc.detail, **exc.extra)

    @app.exception_handler(HTTPException)
    async def _http(request: Request, exc: HTTPException) -> Response:
        if _is_openai(request):
            return openai_error(exc.status_code, str(exc.detail),
                                _OPENAI_TYPES.get(exc.status_code, "invalid_request_error"))
        return problem(exc.status_code, str(exc.detail))

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> Response:
        errors = [
            {"loc": list(e.get("loc", ())), "msg": e.get("msg", ""), "type": e.get("type", "")}
            for e in exc.errors()
        ]
        if _is_openai(request):
            return openai_error(400, "; ".join(e["msg"] for e in errors),
                                "invalid_request_error")
        return problem(422, "Invalid request body", "the body does not match the schema",
                       errors=errors)

    @app.exception_handler(unavailable)
    async def _store_down(request: Request, exc: Exception) -> JSONResponse:
        if isinstance(exc, full):
            # Logged once by the store's health tracker, with what to do.
            logger.debug("write refused, store out of space: %s", exc)
            return problem(503, "State store out of space", NOSPACE_DETAIL)
        logger.warning("write refused, store unavailable: %s", exc)
        # "Not saved" would be a lie after a timeout: etcd may have applied a
        # write whose answer was lost
        # (docs/design/security-operations.md, "Writes whose outcome is unknown").
        # These writes are safe to send again.
        return problem(503, "State store unavailable",
                       "the store (etcd) did not answer: the change was not saved, or, if "
                       "etcd timed out after receiving it, may have been; read it back or "
                       "send it again once the store answers. Routing goes on from the last "
                       "known state.")

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> Response:
        logger.error("unhandled error on %s %s", request.method, request.url.path,
                     exc_info=exc)
        if _is_openai(request):
            return openai_error(500, "Internal error in the gateway.", "server_error")
        return problem(500, "Internal error", "see the gateway's log")
