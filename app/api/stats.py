"""`GET /admin/stats`: each model's last minutes of traffic, the fleet's
(docs/design/cluster-page.md, "Charts").

Behind a load balancer the cluster page's polls reach different gateways,
and each counts only the requests it proxied: a one-gateway series would
jump from poll to poll. So the gateway asked asks each other live gateway
(`gateways/` in its mirror) for its own window (`?scope=self`), with the
admin token, a short timeout and a size cap, and adds them up; the
gateways that did not answer in time are named in the answer, which is the
rest of the fleet's sum. An all-in-one gateway answers from its own ring.
"""

from __future__ import annotations

import asyncio
import json
import ssl
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import aiohttp
from fastapi import APIRouter, Depends
from pydantic import Field, ValidationError

from app.api.auth import admin_guard
from app.api.errors import Problem
from app.api.openapi import problems
from app.gateway.request_series import Series, merge

if TYPE_CHECKING:
    from pathlib import Path

    from app.api.deps import MirrorState

# A window of 256 models is some 1.3 MB of JSON; past this a peer's answer
# is not read (named in `missing`), so one gateway cannot fill another's memory.
MAX_BYTES = 4 << 20


def _tls(cert_file: Path | None) -> ssl.SSLContext:
    """Peers are verified as `llmgw ctl` verifies a gateway: the system's
    CAs, host names checked; plus this gateway's own certificate file as
    trust anchors, so a fleet whose gateways share a certificate (or a
    private CA kept in the chain file) reach each other without a setting."""
    ctx = ssl.create_default_context()
    if cert_file is not None:
        ctx.load_verify_locations(cert_file)
        ctx.verify_flags |= ssl.VERIFY_X509_PARTIAL_CHAIN
    return ctx


async def _ask(session: aiohttp.ClientSession, url: str, token: str) -> Series:
    """One peer's own window; raises ValueError saying why not."""
    async with session.get(url.rstrip("/") + "/admin/stats", params={"scope": "self"},
                           headers={"Authorization": f"Bearer {token}"}) as resp:
        if resp.status != 200:
            raise ValueError(f"answered {resp.status}")
        body = bytearray()
        async for chunk in resp.content.iter_any():  # as it comes, never past the cap
            body += chunk
            if len(body) > MAX_BYTES:
                raise ValueError(f"answered over {MAX_BYTES} bytes")
    try:
        return Series.model_validate(json.loads(body))
    except (ValueError, ValidationError) as exc:  # JSONDecodeError is a ValueError
        raise ValueError(f"answered no stats ({type(exc).__name__})") from None


@dataclass(frozen=True)
class Peers:
    """How this gateway asks the others for their windows."""

    me: str  # this gateway's id
    token: str  # the admin token, which every gateway of the fleet takes
    timeout: float  # LLMGW_STATS_PEER_TIMEOUT
    tls: ssl.SSLContext


async def fleet_stats(state: MirrorState, mine: Series, p: Peers) -> dict[str, Any]:
    me = p.me
    peers = {gid: info.url for gid, info in state.mirror.gateways().items() if gid != me}
    missing: dict[str, str] = {}
    found: list[Series] = []
    if peers:
        timeout = aiohttp.ClientTimeout(total=p.timeout)
        connector = aiohttp.TCPConnector(ssl=p.tls)
        async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
            answers = await asyncio.gather(
                *(_ask(session, url, p.token) for url in peers.values()),
                return_exceptions=True)
        for gid, answer in zip(peers, answers, strict=True):
            if isinstance(answer, Series):
                found.append(answer)
            elif isinstance(answer, TimeoutError):
                missing[gid] = f"no answer within {p.timeout:g} s"
            elif isinstance(answer, (ValueError, aiohttp.ClientError, OSError)):
                missing[gid] = str(answer) or type(answer).__name__
            else:  # anything else is a bug: raised, logged with its traceback
                raise answer
    out = merge(mine, found)
    out["gateways"] = sorted([me, *(gid for gid in peers if gid not in missing)])
    out["missing"] = missing
    return out


class StatsAnswer(Series):
    """`GET /admin/stats`'s answer (documented; built as a plain dict)."""

    gateways: list[str] = Field(description="the gateways whose figures are summed")
    missing: dict[str, str] = Field(description="gateways that did not answer, and why")
    now: float = Field(description="this gateway's time (Unix): the last interval so far "
                                   "ends here")


def routes(state: MirrorState, series: Callable[[], Series], *, admin_token: str,
           gateway_id: str, peer_timeout: float, tls_cert_file: Path | None) -> APIRouter:
    """`series`: this gateway's own window (RequestSeries.snapshot)."""
    # The CA files are read once, not on the loop per request.
    peers = Peers(gateway_id, admin_token, peer_timeout, _tls(tls_cert_file))
    r = APIRouter(prefix="/admin", tags=["stats"],
                  dependencies=[Depends(admin_guard(admin_token))])

    # Documented, not validated on the way out: a window of many models is
    # some hundred thousand numbers (app/gateway/request_series.py).
    @r.get("/stats", summary="Each model's traffic over the last minutes",
           response_model=None,
           responses={200: {"model": StatsAnswer, "description": "the window"},
                      **problems(422)})
    async def stats(scope: Literal["fleet", "self"] = "fleet") -> dict[str, Any]:
        """Per model, one sample per `interval` seconds from `start` (Unix
        time), `samples` of them, oldest first: `requests_2xx`,
        `requests_4xx`, `requests_5xx`, `prompt_tokens`,
        `completion_tokens`, and `ttft_sum`/`ttft_count` (seconds to first
        token of the streams, summed, and how many: their ratio is the
        mean); `now`, this gateway's time, ends the last interval so far.
        `scope=fleet` (the default) adds up every live gateway's
        window, naming in `missing` those that did not answer within
        LLMGW_STATS_PEER_TIMEOUT; `scope=self` is this gateway's alone.
        A model with no request in the window is absent."""
        if scope == "self":
            mine = series()
            out = {"interval": mine.interval, "start": mine.start, "samples": mine.samples,
                   "models": mine.models}
            out["now"] = time.time()
            out["gateways"] = [gateway_id]
            out["missing"] = {}
            return out
        if not state.ready:
            raise Problem(503, "State not loaded",
                          "this gateway has not loaded the fleet's state yet; ask another, "
                          "or ask for scope=self")
        out = await fleet_stats(state, series(), peers)
        out["now"] = time.time()  # the page scales the interval in progress by it
        return out

    return r
