"""A request's life once its model is known: attempts, the answer, failures.

See docs/design/routing.md for the phases and what the client sees
on each failure. In short:

* Before the first byte reaches the client, a replica that cannot take the
  request (connection refused or timed out, 502/503, connection broken
  before an answer) is cooled down and the request tried on another, up to
  `_MAX_ATTEMPTS` replicas, all under one deadline (`Timeouts.request`).
* A timeout while reading is never retried: the engine may still be
  generating, and a second replica would do the work twice.
* A client that leaves stops everything at once (`Watch`): the engine's
  connection is closed, which makes vLLM abort the request; no retry.
* After the first byte of a stream, an engine that dies is replaced once by
  another replica continuing its answer in the same stream, where the
  request allows (continuation.py); else the failure ends the stream with an
  error event in OpenAI's shape and no `[DONE]`, so clients tell it from an end.

A stream's response starts only with the engine's first body byte (vLLM
sends its headers before the prefill): until then nothing has reached the
client, so a failure can still be retried or answered with a plain error.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable
from time import perf_counter

from app.router import own_answers
from app.router.access import Tracer
from app.router.answer_model import answer_name
from app.router.call import Call
from app.router.engine_errors import client_fault, not_served, read_capped
from app.router.engine_headers import passed_on, route_headers
from app.router.hold import hold
from app.router.own_answers import Reply, error, error_event, openai_error_body, send_whole
from app.router.published import Endpoint
from app.router.relay_stream import CLIENT_GONE, StreamRelay
from app.router.request_line import Unsendable, UpstreamError
from app.router.table import RouteTable
from app.router.timeouts import Timeouts, Why, past_deadline
from app.router.upstream import Response, UpstreamClient
from app.router.usage.prompt_count import PromptCounter

logger = logging.getLogger(__name__)

# Upstream statuses that mean "this replica cannot take it now, try another".
_RETRY_STATUSES = {502, 503}
_MAX_ATTEMPTS = 3


class _Retry(Exception):
    """This replica cannot take the request now; another may."""


class _NotServed(Exception):
    """A llama.cpp replica lacks the route: another replica of the model (a
    vLLM one) may serve it; none is blamed (engine_errors.py)."""


class _Tried:
    """What a request's attempts found so far."""

    __slots__ = ("last_error", "replicas", "unserved")

    def __init__(self) -> None:
        self.replicas: set[str] = set()
        self.last_error = ""  # the last replica's failure, for the 503
        self.unserved: Reply | None = None  # a llama.cpp replica lacks the route


class Upstreams:
    """Sends requests to replicas with one shared client (app/router/upstream.py).

    The stages, each reading the request's `Call`: `forward` (the spill and
    the hold), `_attempts` (a replica after another), `_attempt` (one
    replica: send, judge its status), then `_relay_whole` or a
    `StreamRelay` (relay_stream.py).
    """

    def __init__(self, table: RouteTable, timeouts: Timeouts, client: UpstreamClient,
                 tracer: Tracer | None = None,
                 continued: Callable[[str, str], None] | None = None) -> None:
        """`continued(model, outcome)`: told of each stream continuation."""
        self.continued = continued
        self.table = table
        self.timeouts = timeouts
        self.client = client
        self._tracer = tracer
        # Counts the prompt of a llama.cpp stream whose client asked for its
        # usage, before its [DONE] (usage/stream_usage.py); set by the proxy.
        self.prompts: PromptCounter | None = None

    async def forward(self, call: Call) -> int:
        """Forwards to a replica, sends the answer; returns the status for metrics."""
        try:
            if call.spill is not None or self._cold(call.model):
                began = perf_counter()
                gone = await self._before_attempts(call)
                # Waiting on the fleet, not the gateway's own cost.
                call.ex.upstream_wait += perf_counter() - began
                if gone is not None:
                    return gone
            return await self._attempts(call)
        except Reply as r:
            if not call.started:
                raise
            status, err = int(r.status), json.loads(r.body)["error"]
        # The stream's response started while it was held: the error is its
        # last event (the client's SDK raises on it); sent out of the except
        # block (docs/design/hot-path.md, "The router compiled").
        await call.send({"type": "http.response.body", "more_body": False,
                         "body": error_event(err["message"],
                                             err.get("code") or "upstream_error")})
        return status

    def _cold(self, model: str) -> bool:
        """No replica of `model` is routable, and one is on its way."""
        return not self.table.endpoints(model) and self.table.holdable(model)

    async def _before_attempts(self, call: Call) -> int | None:
        """The spill (the model, or its overflow) and the hold for a replica
        on its way; the status for metrics if the client left meanwhile."""
        try:
            if call.spill is not None:
                call.model = await call.spill.route(call)  # or its overflow's name
            if self._cold(call.model):
                await hold(self.table, self.timeouts, call)
        except asyncio.CancelledError:
            why = call.watch.caught()
            if why is None:
                raise  # not ours: the server is stopping
            if why is Why.CLIENT_GONE:
                return CLIENT_GONE
            if why is Why.SHUTDOWN:
                raise own_answers.stopping() from None
            self.table.hold_timed_out(call.model)
            raise error(504, past_deadline(self.timeouts), "server_error",
                        "upstream_timeout") from None
        return None

    async def _attempts(self, call: Call) -> int:
        """A replica after another, up to `_MAX_ATTEMPTS`, until one answers."""
        payload = call.raw if call.raw is not None else (
            json.dumps(call.body).encode() if call.encode is None else b"")
        tried = _Tried()
        for _ in range(_MAX_ATTEMPTS):
            ep = self.table.choose(call.model, tried.replicas, call.affinity, call.pin)
            if ep is None:
                break
            tried.replicas.add(ep.replica_id)
            status = await self._attempt(call, ep, payload, tried)
            if status is not None:
                return status
        if tried.unserved is not None and not tried.last_error:
            raise tried.unserved
        if tried.replicas:
            message = (f"No replica of '{call.model}' can take the request now: "
                       f"{tried.last_error}.")
        else:  # none routable: say why when the control plane told the table
            why_not = self.table.unavailable(call.model)
            message = (f"No replica of '{call.model}' is ready"
                       + (f": {why_not}" if why_not else "."))
        raise error(503, message, "service_unavailable", "no_ready_replica")

    async def _attempt(self, call: Call, ep: Endpoint, payload: bytes,
                       tried: _Tried) -> int | None:
        """One replica's try: the status for metrics, or None: try another."""
        if call.meter is not None and call.meter.rename is None:  # a spill's is set already
            call.meter.rename = answer_name(ep, call.model)  # an external model's: ours
        lease = self.table.acquire(ep)
        upstream: Response | None = None
        failed: str | None = None  # why this attempt failed, for its span
        call.ex.replica = ep.replica_id
        traced = self._tracer if call.ex.span is not None else None
        if traced is not None:
            traced.attempt(call.ex, ep.replica_id)
        try:
            call.sent = perf_counter()
            upstream = await self._post(call, ep, payload)
            return await self._answer(call, ep, upstream)
        except _NotServed:
            tried.unserved, failed = not_served(call.url_tail, call.model), "route not served"
            call.ex.upstream_wait += perf_counter() - call.sent
            return None
        except Unsendable as exc:
            # Built from the client's input and refused before a byte was
            # sent: its fault, never the replica's; no other replica
            # would take it either (the query is refused before any
            # attempt, proxy.py: this is the last line).
            failed = str(exc)
            logger.info("request not sent to replica %s: %s", ep.replica_id, exc)
            raise error(400, f"The request cannot be forwarded: {exc}.",
                        "invalid_request_error", "invalid_request") from None
        except (UpstreamError, _Retry) as failure:
            # Not `exc` again: mypyc gives a name one type per function.
            # Connect timeouts are the client's (UpstreamError): reads are
            # timed by the watch, which cancels instead.
            failed = f"{failure or type(failure).__name__}"
            call.ex.upstream_wait += perf_counter() - call.sent
            tried.last_error = f"replica {ep.replica_id} failed ({failed})"
            logger.warning("%s; trying another", tried.last_error)
            self.table.cool_down(ep.replica_id, self.timeouts.cooldown)
            return None
        except asyncio.CancelledError:
            why = call.watch.caught()
            if why is None:
                raise  # not ours: the server is stopping
            return self._stopped(why, ep)
        finally:
            if upstream is not None:
                upstream.close()  # no-op once read whole; else the engine sees it closed
            lease.release()  # also when the client left (cancellation)
            if traced is not None:
                traced.attempt_end(call.ex, None if upstream is None else upstream.status,
                                   failed)

    def _post(self, call: Call, ep: Endpoint, payload: bytes) -> Awaitable[Response]:
        """Sends the request to `ep`; its answer's status and headers. Not a
        coroutine of its own, nor is `_answer`: one frame less a request."""
        if call.stream:
            call.watch.expect_first_byte()
        # X-Request-Id (not to llama.cpp: its server answers 400 to one that
        # is not a UUID), the client's traceparent.
        ex = call.ex
        forwarded = ex.forwarded if ep.engine != "llamacpp" else ex.forwarded[1:]
        if call.encode is not None:
            method, data, content_type = call.encode(ep)
            forwarded = [(b"Content-Type", content_type), *forwarded]
        else:
            method = b"POST"
            data = payload if not ep.upstream_model else json.dumps(
                call.body | {"model": ep.upstream_model}).encode()
        return self.client.post(ep.url, call.url_tail, data, forwarded,
                                route_headers(ep.key, call.encode is None), method)

    def _answer(self, call: Call, ep: Endpoint, upstream: Response) -> Awaitable[int]:
        """Judges the replica's status, then relays its answer."""
        status = upstream.status
        if status in _RETRY_STATUSES:
            raise _Retry(f"answered {status}")
        if status == 401:
            # The engine refused *our* key: a gateway/engine mismatch
            # (another secret?), not the client's fault.
            logger.error("replica %s refused the engine key", ep.replica_id)
            raise error(502, f"replica {ep.replica_id} refused the gateway",
                        "server_error", "upstream_auth")
        if status == 404 and ep.engine == "llamacpp":
            # llama-cpp-python serves chat, completions and embeddings only.
            raise _NotServed
        if status == 500 and ep.engine == "llamacpp":
            return self._llamacpp_failed(call, ep, upstream)
        if call.stream:
            return StreamRelay(self, call, upstream, ep).run()
        return self._relay_whole(call, ep, upstream)

    async def _relay_whole(self, call: Call, ep: Endpoint, upstream: Response) -> int:
        """Read whole: nothing has reached the client yet, so a failure here
        is still retried, and the answer keeps its length."""
        answer = await upstream.read()
        call.ex.upstream_wait += upstream.engine_seconds()
        call.watch.close()  # the answer is whole: a client leaving now changes nothing
        if call.meter is not None and upstream.status == 200:
            answer = call.meter.read_answer(answer, upstream.headers.get("content-encoding"))
        await send_whole(call.send, upstream.status, answer, passed_on(upstream, ep, call.ex),
                         upstream.headers.get("content-type", "application/json").encode(),
                         call.direct)
        if not call.started:
            call.ex.answered = perf_counter()
        return upstream.status

    async def _llamacpp_failed(self, call: Call, ep: Endpoint, upstream: Response) -> int:
        """llama.cpp's 500: its answer to the client's parameters, or a
        failure; engine_errors.py tells which. Neither is retried."""
        answer = await read_capped(upstream)
        call.watch.close()
        fault = client_fault(answer, call.model)
        if fault is not None:
            logger.info("replica %s refused the request's parameters: %s",
                        ep.replica_id, fault.message)
            raise fault.reply
        if call.started:  # a held stream's response began: this ends it
            raise error(500, f"Replica {ep.replica_id} failed.", "server_error",
                        "upstream_error")
        await send_whole(call.send, 500, answer or openai_error_body(
            f"Replica {ep.replica_id} failed.", "server_error", "upstream_error"),
            passed_on(upstream, ep, call.ex), direct=call.direct)
        return 500

    def _stopped(self, why: Why, ep: Endpoint) -> int:
        """The watch ended the request before any byte reached the client: the
        status for metrics when the client left, else the error it gets."""
        if why is Why.CLIENT_GONE:
            return CLIENT_GONE
        if why is Why.SHUTDOWN:
            raise own_answers.stopping()
        if why is Why.FIRST_BYTE:
            self.table.cool_down(ep.replica_id, self.timeouts.cooldown)
            message = (f"Replica {ep.replica_id} sent no first token within "
                       f"{self.timeouts.first_byte:g} s.")
        else:
            message = past_deadline(self.timeouts)
        logger.warning("request to replica %s ended: %s", ep.replica_id, message)
        raise error(504, message, "server_error", "upstream_timeout")
