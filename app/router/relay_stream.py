"""A stream's answer relayed as it comes: a chain of chunk transforms, the
engine dying mid-stream, the client leaving (docs/architecture.md, "Flows").

A chunk read from the engine goes through, in order: `inflate` (gzip or
deflate undone), `frame` (cut at the last whole SSE event, sse.py),
`splice` (kept, or rewritten once the stream is continued elsewhere,
continuation.py), `meter` (its usage noted, the usage-only event the client
did not ask for cut, the answer's model renamed, usage/limits.py) and, for an
engine that sends no usage event, `usage_before_done` (usage/stream_usage.py).
Which transforms a stream has is decided once, from its first answer's
headers, when `StreamRelay` is built: its `_Chain`.

A stream's response starts only with the engine's first body byte (vLLM
sends its headers before the prefill): until then nothing has reached the
client, so a failure can still be retried by relay.py.

Where the server writes the body straight to the client's socket
(direct_body.py) and no transform needs the task, the rest of the stream is
piped (`_piped`): the chain runs inside the engine connection's read
callback (upstream.py, `Response.pipe`) and writes what one read brought in
one write, with no task step, future or ASGI message per chunk
(docs/design/hot-path.md, "A stream's chunks").
"""

from __future__ import annotations

import asyncio
import logging
import zlib
from collections.abc import Callable
from time import perf_counter
from typing import Protocol

from app.router import own_answers, sse
from app.router.call import Call
from app.router.continuation import Resumed, Splice, resumable, resume
from app.router.direct_body import ClientFlow, DirectBody
from app.router.engine_headers import passed_on
from app.router.published import Endpoint
from app.router.request_line import UpstreamError
from app.router.table import RouteTable
from app.router.timeouts import Timeouts, Watch, Why, past_deadline
from app.router.upstream import Response, Sink, UpstreamClient
from app.router.usage import stream_usage
from app.router.usage.meter import Meter
from app.router.usage.prompt_count import PromptCounter

logger = logging.getLogger(__name__)

# Most bytes one chunk of a compressed stream may inflate to: a chunk read is
# at most a few hundred KiB (upstream.py), SSE compresses some tenfold.
_MAX_INFLATED = 16 * 1024 * 1024
# The status a metric records for a client that left (nginx's convention).
CLIENT_GONE = 499

class Upstreams(Protocol):
    """What a stream's relay uses of relay.py's `Upstreams`."""

    table: RouteTable
    timeouts: Timeouts
    client: UpstreamClient
    prompts: PromptCounter | None
    continued: Callable[[str, str], None] | None


class _Chain(Sink):
    """A stream's transforms, as decided once when its relay was built, and
    the rest of a piped chunk's way (`take`): everything a chunk reads is a
    slot of this one object, so that a chunk touches few objects (with
    thousands of streams, each chunk finds them out of the CPU's caches:
    docs/design/hot-path.md, "A stream's chunks"). A transform a stream
    lacks costs a chunk one test. It holds nothing of the relay, which
    holds it (a bound method of the relay here would make every stream a
    reference cycle for the collector: tests/test_request_life.py)."""

    __slots__ = ("clock", "decoder", "flow", "framed", "meter", "splice", "tail", "watch")
    # Set when piped (StreamRelay._piped): the client's socket `take` writes
    # to (a compiled class: called natively), and the watch it tells when
    # the next read became pending.
    flow: ClientFlow
    watch: Watch
    clock: Callable[[], float]

    def __init__(self, decoder: zlib._Decompress | None, framed: bool, splice: Splice | None,
                 meter: Meter | None) -> None:
        self.decoder = decoder  # a compressed stream's, inflated here
        self.framed = framed
        self.splice = splice
        self.meter = meter
        self.tail = b""  # the start of an event not yet whole (framed only)

    def through(self, chunk: bytes) -> bytes:
        """What the client gets of `chunk`."""
        if self.decoder is not None:
            chunk = self.decoder.decompress(chunk, _MAX_INFLATED)
            if self.decoder.unconsumed_tail:
                raise UpstreamError(f"a compressed chunk inflates past {_MAX_INFLATED} bytes")
        if self.framed and (self.tail or not sse.ends_whole(chunk)):
            chunk, self.tail = sse.whole_events(self.tail + chunk)
        if self.splice is not None and chunk:
            chunk = self.splice.pass_on(chunk)  # kept, or rewritten
        if self.meter is not None:
            chunk = self.meter.read_events(chunk)  # usage noted, maybe cut
        return chunk

    def take(self, data: bytes) -> bool:
        """A piped read (upstream.py's `Sink`): through, timed, written;
        False when the client's socket is full."""
        data = self.through(data)
        self.watch.read_since = self.clock()  # the next read pending from now
        return not data or self.flow.write_chunk(data)

    def take_framed(self, data: bytes, framed: bytes) -> bool:
        """A piped read of whole chunks (upstream.py's `Sink`): as `take`,
        and when no transform changed `data`, the chunks written as the
        engine framed them, with no framing of ours."""
        out = self.through(data)
        self.watch.read_since = self.clock()
        if out is data:
            return self.flow.write_framed(framed)
        return not out or self.flow.write_chunk(out)


class StreamRelay:
    """One stream's relay, from its engine's answer `upstream` on `ep`."""

    def __init__(self, up: Upstreams, call: Call, upstream: Response, ep: Endpoint) -> None:
        self._up = up
        self._call = call
        self._upstream = upstream
        self._ep = ep
        # The stream may be resumed on another replica if its engine dies.
        self._splice = resumable(call.body, call.url_tail, call.model, ep)
        self._resumed: Resumed | None = None  # closed at the end; one a request
        # Asked for identity, an engine or provider may compress anyway: gzip
        # and deflate are undone as the stream comes, so that its events are
        # read for usage and it can end with an error event; it goes on in
        # clear. Any other encoding passes as sent, unread.
        encoding = upstream.headers.get("content-encoding")
        self._decoder = (zlib.decompressobj(wbits=47)  # gzip or zlib, by its header
                         if encoding is not None and encoding.lower() in ("gzip", "deflate")
                         else None)
        self._content_type = upstream.headers.get("content-type", "text/event-stream")
        # Whole events only, so that an error event can follow a failure: not
        # for a compressed body, which no event can be appended to in clear.
        self._framed = (self._content_type.startswith("text/event-stream")
                        and (encoding is None or self._decoder is not None))
        if not self._framed or self._decoder is not None:
            self._splice = None
        meter = call.meter
        # A usage event the client asked for and the engine never sends, put
        # before [DONE] (usage/stream_usage.py); `_earlier`: the events sent so far.
        self._owed = (self._framed and meter is not None and up.prompts is not None
                      and stream_usage.owed(meter, ep.engine))
        self._earlier = b""
        # Piped once the response has started, if the server allows it
        # (run()); a usage event owed before [DONE] needs the task.
        self._direct: DirectBody | None = None if self._owed else call.direct
        self._chain = _Chain(self._decoder, self._framed, self._splice,
                             meter if self._framed else None)

    async def run(self) -> int:
        """Relays the stream to its end; returns the status for metrics."""
        call, ep = self._call, self._ep
        # A failure before this read completes propagates: nothing was sent
        # yet, so the caller may still retry or answer with an error.
        chunk = await self._upstream.readany()
        call.ex.first_byte = call.watch.loop.time()
        call.ex.first_token = perf_counter()
        call.ex.upstream_wait += self._upstream.engine_seconds()
        call.watch.streaming()
        if call.meter is not None and ep.engine == "llamacpp":
            call.meter.count_at = (ep.url, ep.key)  # no usage event: counted (usage/limits.py)
        why: Why | None = None  # the watch's, when it cut the stream: ended below
        try:
            if not call.started:
                await call.send({"type": "http.response.start",
                                 "status": self._upstream.status, "headers": self._headers()})
                call.ex.answered = perf_counter()
            flow = self._direct.writer() if self._direct is not None else None
            while True:
                try:
                    await self._pump(chunk, flow)
                    break
                except (UpstreamError, zlib.error) as exc:
                    broken: Exception | None = exc
                # Out of the except block (docs/design/hot-path.md, "The
                # router compiled"); the exception not kept past its use.
                assert broken is not None
                again = await self._broken(broken)
                broken = None
                if again is None:
                    return 502
                chunk = again
        except asyncio.CancelledError:
            why = call.watch.caught()
            if why is None:
                raise
        finally:
            self._close()
        if why is not None:
            return await self._ended_by(why)
        call.watch.close()
        await call.send({"type": "http.response.body", "body": self._chain.tail,
                         "more_body": False})
        return self._upstream.status

    def _headers(self) -> list[tuple[bytes, bytes]]:
        headers = passed_on(self._upstream, self._ep, self._call.ex,
                            decoded=self._decoder is not None)
        return [*headers, (b"content-type", self._content_type.encode()),
                (b"cache-control", b"no-cache")]

    async def _pump(self, chunk: bytes, flow: ClientFlow | None) -> None:
        """Passes chunks on through the chain until the engine's answer ends."""
        if flow is not None:
            await self._piped(chunk, flow)
        else:
            await self._sent(chunk)
        if self._splice is not None and self._splice.cut_short():
            raise UpstreamError("the stream ended without [DONE]")

    async def _piped(self, chunk: bytes, flow: ClientFlow) -> None:
        """The chain run in the engine connection's read callback, each read
        written to the client at once; the task wakes only when the client's
        socket is full, or at the end."""
        direct = self._direct
        assert direct is not None
        chain, watch = self._chain, self._call.watch
        chain.flow, chain.watch, chain.clock = flow, watch, watch.loop.time
        if chunk and not chain.take(chunk):
            await self._drained(direct)
        watch.read_since = chain.clock()
        while not await self._upstream.pipe(chain):
            await self._drained(direct)
        watch.read_since = 0.0

    async def _drained(self, direct: DirectBody) -> None:
        """Waits for a client whose socket is full: timed as a send (Watch)."""
        watch = self._call.watch
        clock = watch.loop.time
        watch.read_since, watch.send_since = 0.0, clock()
        await direct.drain()
        watch.send_since, watch.read_since = 0.0, clock()

    async def _sent(self, chunk: bytes) -> None:
        """Chunk by chunk, each sent as an ASGI message."""
        call, through = self._call, self._chain.through
        watch, send = call.watch, call.send
        loop = watch.loop
        while chunk:
            chunk = through(chunk)
            if self._owed:
                chunk = await self._usage_before_done(chunk)
            if chunk:
                watch.send_since = loop.time()
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
                watch.send_since = 0.0
            watch.read_since = loop.time()
            chunk = await self._upstream.readany()
            watch.read_since = 0.0

    async def _usage_before_done(self, chunk: bytes) -> bytes:
        meter = self._call.meter
        assert meter is not None
        if meter.ended:
            self._owed = False
            return await stream_usage.before_done(
                chunk, self._earlier, meter, self._count)
        if chunk:
            self._earlier = chunk
        return chunk

    async def _count(self) -> int | None:
        """The engine's count of a stream's prompt, while its client waits
        for [DONE]: no longer than a silent engine is waited for (`idle`),
        and ending a second before the request's deadline, which would cut
        the stream with an error event instead."""
        prompts, call = self._up.prompts, self._call
        assert prompts is not None and call.meter is not None
        return await prompts.count(call.meter, min(self._up.timeouts.idle,
                                                   call.watch.left() - 1.0))

    async def _broken(self, exc: Exception) -> bytes | None:
        """The engine broke off: the continuation's first bytes, or None once
        the stream has ended with an error event."""
        call, ep, up = self._call, self._ep, self._up
        logger.warning("replica %s broke off mid-stream: %s", ep.replica_id,
                       exc or type(exc).__name__)
        up.table.cool_down(ep.replica_id, up.timeouts.cooldown)
        again = None if self._splice is None else await resume(
            self._splice, up.table, up.client, call.watch, call.ex, ep)
        if again is None:
            await own_answers.end_badly(call.send, self._framed, f"Replica {ep.replica_id} "
                                    "broke off the stream.", "upstream_error")
            return None
        self._resumed = again
        self._upstream, self._ep, self._chain.tail = again.upstream, again.ep, b""
        call.watch.streaming()
        return again.first

    async def _ended_by(self, why: Why) -> int:
        """The watch cut the stream: how it ends for the client; the status
        for metrics."""
        up, splice = self._up, self._splice
        ep = splice.on if splice is not None and splice.on is not None else self._ep
        if why is Why.CLIENT_GONE:
            return CLIENT_GONE
        if why is Why.CLIENT_STALLED:
            # Nothing more can reach it; the server closes its connection
            # as the response is left incomplete.
            logger.warning("client of a stream from replica %s took nothing for %g s: "
                           "stream dropped", ep.replica_id, up.timeouts.idle)
            return CLIENT_GONE
        send, framed = self._call.send, self._framed
        if why is Why.SHUTDOWN:
            logger.warning("stream from replica %s cut: the gateway's stop ran out of "
                           "grace", ep.replica_id)
            await own_answers.end_badly(send, framed, own_answers.STOPPING, "gateway_stopping")
            return 503
        if why in (Why.IDLE, Why.FIRST_BYTE):  # first byte: of a continuation
            up.table.cool_down(ep.replica_id, up.timeouts.cooldown)
            limit = up.timeouts.idle if why is Why.IDLE else up.timeouts.first_byte
            message = f"Replica {ep.replica_id} sent nothing for {limit:g} s."
        else:
            message = past_deadline(up.timeouts)
        logger.warning("stream from replica %s ended: %s", ep.replica_id, message)
        await own_answers.end_badly(send, framed, message, "upstream_timeout")
        return 504

    def _close(self) -> None:
        if self._resumed is not None:
            self._resumed.upstream.close()
            self._resumed.lease.release()
        splice, continued = self._splice, self._up.continued
        if splice is not None and splice.resumed and continued is not None:
            continued(splice.model, splice.outcome(self._call.watch.why))
