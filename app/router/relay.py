"""A request's life once its model is known: attempts, the answer, failures.

See docs/architecture.md ("Routing") for the phases and what the client sees
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
import zlib
from collections.abc import Callable
from functools import partial
from typing import Any

from app.router import replies, stream_usage
from app.router.access import Exchange, Tracer
from app.router.continuation import Resumed, Splice, resumable, resume
from app.router.counting import PromptCounter
from app.router.engine_errors import client_fault, not_served, read_capped
from app.router.engine_headers import passed_on, route_headers
from app.router.entries import Endpoint
from app.router.hold import hold
from app.router.limits import Ticket
from app.router.renamed import answer_name
from app.router.replies import Reply, Send, error, error_event, openai_error_body, send_whole
from app.router.spill import Spill
from app.router.table import RouteTable
from app.router.timeouts import Timeouts, Watch, Why
from app.router.upstream import Response, Unsendable, UpstreamClient, UpstreamError

logger = logging.getLogger(__name__)

# What one attempt sends to its replica when the body is not JSON to POST as
# it is (app/router/passthrough.py): (method, body, content type).
Encoder = Callable[[Endpoint], tuple[bytes, bytes, bytes]]

# Upstream statuses that mean "this replica cannot take it now, try another".
_RETRY_STATUSES = {502, 503}
_MAX_ATTEMPTS = 3
# Most bytes one chunk of a compressed stream may inflate to: a chunk read is
# at most a few hundred KiB (upstream.py), SSE compresses some tenfold.
_MAX_INFLATED = 16 * 1024 * 1024
# The status a metric records for a client that left (nginx's convention).
CLIENT_GONE = 499


class _Retry(Exception):
    """This replica cannot take the request now; another may."""


class Upstreams:
    """Sends requests to replicas with one shared client (app/router/upstream.py)."""

    def __init__(self, table: RouteTable, timeouts: Timeouts, client: UpstreamClient,
                 tracer: Tracer | None = None,
                 continued: Callable[[str, str], None] | None = None) -> None:
        """`continued(model, outcome)`: told of each stream continuation."""
        self._continued = continued
        self._table = table
        self._timeouts = timeouts
        self.client = client
        self._tracer = tracer
        # Counts the prompt of a llama.cpp stream whose client asked for its
        # usage, before its [DONE] (stream_usage.py); set by the proxy.
        self.prompts: PromptCounter | None = None

    async def forward(self, watch: Watch, model: str, url_tail: str, body: dict[str, Any],
                      stream: bool, send: Send,
                      affinity: str | None = None, meter: Ticket | None = None, *,
                      ex: Exchange, pin: str | None = None,
                      encode: Encoder | None = None, raw: bytes | None = None,
                      spill: Spill | None = None) -> int:
        """Forwards to a replica, sends the answer; returns the status for metrics.

        `url_tail`: the path and query string to ask the engine for. `body`'s
        model is the catalog name, which our engines serve; an external
        model's endpoint names the provider's model instead (encoded for
        that attempt only). `meter` notes the usage the answer reports;
        `ex` is told the replica and a stream's first byte, and gives the
        request id and trace context sent to the engine. `pin`: only that
        replica may take it; `encode`: the request each attempt sends.
        `raw`: the client's bytes, when `body` is exactly what they say (sent
        as they are).
        `spill`: the model's overflow may take the request instead (spill.py).
        """
        started = [False]  # set by hold() once a held stream's response began
        try:
            if spill is not None or (not self._table.endpoints(model)
                                     and self._table.holdable(model)):
                try:
                    if spill is not None:
                        model = await spill.route(model)  # or its overflow's name
                    if not self._table.endpoints(model) and self._table.holdable(model):
                        await hold(self._table, self._timeouts, model, stream, send, started, ex)
                except asyncio.CancelledError:
                    why = watch.caught()
                    if why is None:
                        raise  # not ours: the server is stopping
                    if why is Why.CLIENT_GONE:
                        return CLIENT_GONE
                    if why is Why.SHUTDOWN:
                        raise replies.stopping() from None
                    self._table.hold_timed_out(model)
                    raise error(504, self._past_deadline(), "server_error",
                                "upstream_timeout") from None
            return await self._attempts(watch, model, url_tail, body, stream,
                                        send, affinity, meter, started[0], ex, pin, encode,
                                        raw)
        except Reply as r:
            if not started[0]:
                raise
            # The stream's response started while it was held: the error is
            # its last event (the client's SDK raises on it).
            err = json.loads(r.body)["error"]
            await send({"type": "http.response.body", "more_body": False,
                        "body": error_event(err["message"], err.get("code") or "upstream_error")})
            return int(r.status)

    async def _attempts(self, watch: Watch, model: str, url_tail: str, body: dict[str, Any],
                        stream: bool, send: Send,
                        affinity: str | None, meter: Ticket | None, started: bool,
                        ex: Exchange, pin: str | None = None,
                        encode: Encoder | None = None, raw: bytes | None = None) -> int:
        payload = raw if raw is not None else (
            json.dumps(body).encode() if encode is None else b"")
        tried: set[str] = set()
        last_error = ""
        unserved: Reply | None = None  # a llama.cpp replica lacks the route
        for _ in range(_MAX_ATTEMPTS):
            ep = self._table.choose(model, tried, affinity, pin)
            if ep is None:
                break
            tried.add(ep.replica_id)
            if meter is not None and meter.rename is None:  # a spill's is set already
                meter.rename = answer_name(ep, model)  # an external model's: ours (renamed.py)
            lease = self._table.acquire(ep)
            upstream: Response | None = None
            failed: str | None = None  # why this attempt failed, for its span
            ex.replica = ep.replica_id
            if ex.span is not None and self._tracer is not None:
                self._tracer.attempt(ex, ep.replica_id)
            try:
                if stream:
                    watch.expect_first_byte()
                # X-Request-Id (not to llama.cpp: its server answers 400 to
                # one that is not a UUID), the client's traceparent.
                forwarded = ex.forwarded if ep.engine != "llamacpp" else ex.forwarded[1:]
                if encode is not None:
                    method, data, content_type = encode(ep)
                    forwarded = [(b"Content-Type", content_type), *forwarded]
                else:
                    method = b"POST"
                    data = payload if not ep.upstream_model else json.dumps(
                        body | {"model": ep.upstream_model}).encode()
                upstream = await self.client.post(
                    ep.url, url_tail, data, forwarded,
                    route_headers(ep.key, encode is None), method)
                if upstream.status in _RETRY_STATUSES:
                    raise _Retry(f"answered {upstream.status}")
                if upstream.status == 401:
                    # The engine refused *our* key: a gateway/engine mismatch
                    # (another secret?), not the client's fault.
                    logger.error("replica %s refused the engine key", ep.replica_id)
                    raise error(502, f"replica {ep.replica_id} refused the gateway",
                                "server_error", "upstream_auth")
                if upstream.status == 404 and ep.engine == "llamacpp":
                    # llama-cpp-python serves chat, completions and embeddings
                    # only: another replica of the model (a vLLM one) may
                    # serve the route; none is blamed (engine_errors.py).
                    unserved, failed = not_served(url_tail, model), "route not served"
                    continue
                if upstream.status == 500 and ep.engine == "llamacpp":
                    # Its answer to the client's parameters, or a failure:
                    # engine_errors.py tells which. Neither is retried.
                    answer = await read_capped(upstream)
                    watch.close()
                    fault = client_fault(answer)
                    if fault is not None:
                        logger.info("replica %s refused the request's parameters: %s",
                                    ep.replica_id, fault.message)
                        raise fault.reply
                    if started:  # a held stream's response began: this ends it
                        raise error(500, f"Replica {ep.replica_id} failed.", "server_error",
                                    "upstream_error")
                    await send_whole(send, 500, answer or openai_error_body(
                        f"Replica {ep.replica_id} failed.", "server_error", "upstream_error"),
                        passed_on(upstream, ep, ex))
                    return 500
                if stream:
                    return await self._relay(upstream, ep, watch, send, meter, started, ex,
                                             resumable(body, url_tail, model, ep))
                # Read whole: nothing has reached the client yet, so a failure
                # here is still retried, and the answer keeps its length.
                answer = await upstream.read()
                watch.close()  # the answer is whole: a client leaving now changes nothing
                if meter is not None and upstream.status == 200:
                    answer = meter.read_answer(answer, upstream.headers.get("content-encoding"))
                await send_whole(send, upstream.status, answer, passed_on(upstream, ep, ex),
                                 upstream.headers.get("content-type",
                                                      "application/json").encode())
                return upstream.status
            except Unsendable as exc:
                # Built from the client's input and refused before a byte was
                # sent: its fault, never the replica's; no other replica
                # would take it either (the query is refused before any
                # attempt, proxy.py: this is the last line).
                failed = str(exc)
                logger.info("request not sent to replica %s: %s", ep.replica_id, exc)
                raise error(400, f"The request cannot be forwarded: {exc}.",
                            "invalid_request_error", "invalid_request") from None
            except (UpstreamError, _Retry) as exc:
                # Connect timeouts are the client's (UpstreamError): reads are
                # timed by the watch, which cancels instead.
                failed = f"{exc or type(exc).__name__}"
                last_error = f"replica {ep.replica_id} failed ({failed})"
                logger.warning("%s; trying another", last_error)
                self._table.cool_down(ep.replica_id, self._timeouts.cooldown)
            except asyncio.CancelledError:
                why = watch.caught()
                if why is None:
                    raise  # not ours: the server is stopping
                return self._stopped(why, ep)
            finally:
                if upstream is not None:
                    upstream.close()  # no-op once read whole; else the engine sees it closed
                lease.release()  # also when the client left (cancellation)
                if ex.span is not None and self._tracer is not None:
                    self._tracer.attempt_end(ex, None if upstream is None else upstream.status,
                                             failed)
        if unserved is not None and not last_error:
            raise unserved
        if tried:
            message = f"No replica of '{model}' can take the request now: {last_error}."
        else:  # none routable: say why when the control plane told the table
            why_not = self._table.unavailable(model)
            message = f"No replica of '{model}' is ready" + (f": {why_not}" if why_not else ".")
        raise error(503, message, "service_unavailable", "no_ready_replica")

    def _stopped(self, why: Why, ep: Endpoint) -> int:
        """The watch ended the request before any byte reached the client: the
        status for metrics when the client left, else the error it gets."""
        if why is Why.CLIENT_GONE:
            return CLIENT_GONE
        if why is Why.SHUTDOWN:
            raise replies.stopping()
        if why is Why.FIRST_BYTE:
            self._table.cool_down(ep.replica_id, self._timeouts.cooldown)
            message = (f"Replica {ep.replica_id} sent no first token within "
                       f"{self._timeouts.first_byte:g} s.")
        else:
            message = self._past_deadline()
        logger.warning("request to replica %s ended: %s", ep.replica_id, message)
        raise error(504, message, "server_error", "upstream_timeout")

    async def _count(self, meter: Ticket, watch: Watch) -> int | None:
        """The engine's count of a stream's prompt, while its client waits
        for [DONE]: no longer than a silent engine is waited for (`idle`),
        and ending a second before the request's deadline, which would cut
        the stream with an error event instead."""
        assert self.prompts is not None
        return await self.prompts.count(meter, min(self._timeouts.idle, watch.left() - 1.0))

    def _past_deadline(self) -> str:
        """What a client whose request ran out of its whole deadline is told."""
        return f"The request did not finish within {self._timeouts.request:g} s."

    async def _relay(self, upstream: Response, ep: Endpoint, watch: Watch, send: Send,
                     meter: Ticket | None, started: bool, ex: Exchange,
                     splice: Splice | None = None) -> int:
        """Streams the engine's bytes as they come; returns the status for metrics.
        `started`: the response began while the request was held (its
        headers are out): only the body follows. `splice`: the stream may be
        resumed on another replica if its engine dies (continuation.py)."""
        # A failure before this read completes propagates: nothing was sent
        # yet, so the caller may still retry or answer with an error.
        chunk = await upstream.readany()
        loop = asyncio.get_running_loop()
        ex.first_byte = loop.time()
        watch.streaming()
        if meter is not None and ep.engine == "llamacpp":
            meter.count_at = (ep.url, ep.key)  # no usage event: counted (limits.py)
        # Asked for identity, an engine or provider may compress anyway: gzip
        # and deflate are undone as the stream comes, so that its events are
        # read for usage and it can end with an error event; it goes on in
        # clear. Any other encoding passes as sent, unread.
        encoding = upstream.headers.get("content-encoding")
        decoder = (zlib.decompressobj(wbits=47)  # gzip or zlib, by its header
                   if encoding is not None and encoding.lower() in ("gzip", "deflate")
                   else None)
        headers = passed_on(upstream, ep, ex, decoded=decoder is not None)
        content_type = upstream.headers.get("content-type", "text/event-stream")
        headers += [(b"content-type", content_type.encode()), (b"cache-control", b"no-cache")]
        # Whole events only, so that an error event can follow a failure: not
        # for a compressed body, which no event can be appended to in clear.
        framed = (content_type.startswith("text/event-stream")
                  and (encoding is None or decoder is not None))
        tail = b""  # the start of an event not yet whole (framed only)
        if not framed or decoder is not None:
            splice = None
        # A usage event the client asked for and the engine never sends, put
        # before [DONE] (stream_usage.py); `earlier`: the events sent so far.
        owed = (framed and meter is not None and self.prompts is not None
                and stream_usage.owed(meter, ep.engine))
        earlier = b""
        resumed: Resumed | None = None
        try:
            if not started:
                await send({"type": "http.response.start", "status": upstream.status,
                            "headers": headers})
            while True:
                try:
                    while chunk:
                        if decoder is not None:
                            chunk = decoder.decompress(chunk, _MAX_INFLATED)
                            if decoder.unconsumed_tail:
                                raise UpstreamError("a compressed chunk inflates past "
                                                    f"{_MAX_INFLATED} bytes")
                        if framed and (tail or not chunk.endswith(replies.EVENT_ENDS)):
                            chunk, tail = replies.whole_events(tail + chunk)
                        if splice is not None and chunk:
                            chunk = splice.pass_on(chunk)  # kept, or rewritten once resumed
                        if framed and meter is not None:
                            chunk = meter.read_events(chunk)  # usage noted, maybe cut
                            if owed and meter.ended:
                                owed = False
                                chunk = await stream_usage.before_done(
                                    chunk, earlier, meter, partial(self._count, meter, watch))
                            elif owed and chunk:
                                earlier = chunk
                        if chunk:
                            watch.send_since = loop.time()
                            await send({"type": "http.response.body", "body": chunk,
                                        "more_body": True})
                            watch.send_since = 0.0
                        watch.read_since = loop.time()
                        chunk = await upstream.readany()
                        watch.read_since = 0.0
                    if splice is not None and splice.cut_short():
                        raise UpstreamError("the stream ended without [DONE]")
                    break
                except (UpstreamError, zlib.error) as exc:
                    logger.warning("replica %s broke off mid-stream: %s", ep.replica_id,
                                   exc or type(exc).__name__)
                    self._table.cool_down(ep.replica_id, self._timeouts.cooldown)
                    again = None if splice is None else await resume(
                        splice, self._table, self.client, watch, ex, ep)
                    if again is None:
                        await replies.end_badly(send, framed, f"Replica {ep.replica_id} "
                                                "broke off the stream.", "upstream_error")
                        return 502
                    resumed = again  # closed below; one a request (continuation.py)
                    upstream, ep, chunk, tail = again.upstream, again.ep, again.first, b""
                    watch.streaming()
        except asyncio.CancelledError:
            why = watch.caught()
            if why is None:
                raise
            ep = splice.on if splice is not None and splice.on is not None else ep
            if why is Why.CLIENT_GONE:
                return CLIENT_GONE
            if why is Why.CLIENT_STALLED:
                # Nothing more can reach it; the server closes its connection
                # as the response is left incomplete.
                logger.warning("client of a stream from replica %s took nothing for %g s: "
                               "stream dropped", ep.replica_id, self._timeouts.idle)
                return CLIENT_GONE
            if why is Why.SHUTDOWN:
                logger.warning("stream from replica %s cut: the gateway's stop ran out of "
                               "grace", ep.replica_id)
                await replies.end_badly(send, framed, replies.STOPPING, "gateway_stopping")
                return 503
            if why in (Why.IDLE, Why.FIRST_BYTE):  # first byte: of a continuation
                self._table.cool_down(ep.replica_id, self._timeouts.cooldown)
                limit = self._timeouts.idle if why is Why.IDLE else self._timeouts.first_byte
                message = f"Replica {ep.replica_id} sent nothing for {limit:g} s."
            else:
                message = self._past_deadline()
            logger.warning("stream from replica %s ended: %s", ep.replica_id, message)
            await replies.end_badly(send, framed, message, "upstream_timeout")
            return 504
        finally:
            if resumed is not None:
                resumed.upstream.close()
                resumed.lease.release()
            if splice is not None and splice.resumed and self._continued is not None:
                self._continued(splice.model, splice.outcome(watch.why))
        watch.close()
        await send({"type": "http.response.body", "body": tail, "more_body": False})
        return upstream.status
