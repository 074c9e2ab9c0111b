"""The OpenAI-compatible surface (`/v1`): a plain ASGI app, the hot path.

Per request: check the client key, resolve the model name or alias, choose
a replica (`RouteTable.choose`), forward with that replica's engine key, and
send the answer back: whole for a plain request, chunk by chunk for a
streamed one (SSE passes through unbuffered). No step waits on the store.

Why plain ASGI rather than FastAPI routes: measured with bench/proxy.py,
FastAPI's request objects, routing and per-response task groups cost the
gateway about 0.9 ms of CPU per plain request, against about 0.5 ms for a
bare proxy. The admin API, where that does not matter, stays on FastAPI.

Requests go to engines through the router's own HTTP client
(`upstream.py`, on httptools), which costs a third of aiohttp's CPU per
request; another of its clients polls the engines' loads, off the request
path.

What happens to a request once its model is known (attempts, timeouts,
failures) is in `relay.py` and `timeouts.py`; docs/design/routing.md tells the whole life.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
from collections.abc import Awaitable, Callable, MutableMapping, Sequence
from dataclasses import dataclass
from typing import Any

from app.router import passthrough
from app.router.access import ARRIVED, Exchange, Tracer
from app.router.body_fields import checked_model
from app.router.call import Call
from app.router.choice import affinity_key
from app.router.direct_body import DIRECT_BODY, DirectBody
from app.router.engine_load import EngineLoadPoller
from app.router.outcome import Outcome, RequestObserver
from app.router.own_answers import Reply, error, openai_error_body, send_whole
from app.router.published import KeyGrant
from app.router.relay import Upstreams
from app.router.relay_stream import CLIENT_GONE
from app.router.request_line import unsafe_target
from app.router.request_read import ClientGone, has_body, headers_of, parse_json, read_body
from app.router.responses import ProviderIds
from app.router.spill import Spill
from app.router.table import RouteTable
from app.router.timeouts import Timeouts, Watch
from app.router.turns import Turns
from app.router.upstream import UpstreamClient
from app.router.usage.estimates import ask_for_usage, usage_asked_in
from app.router.usage.limits import Limiter, Ticket
from app.router.usage.overlimit import OverLimit
from app.router.usage.prompt_count import PromptCounter

logger = logging.getLogger(__name__)

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

# The engine paths reachable through us, with passthrough.py's. We send the
# engine's key, so its guard (docs/design/security.md, "The engine's port") does
# not keep a client off what it must not reach: /v1/load_lora_adapter
# (runtime LoRA updates on), /metrics, /pooling, /invocations,
# /start_profile... are never forwarded.
_FORWARDED = {"/v1/chat/completions", "/v1/completions", "/v1/embeddings"}


# How long the load poll waits for a connection to an agent or engine: on a
# network that answers in well under a millisecond, longer is a node down.
_POLL_CONNECT = 0.25


# How many granted keys' hashes the proxy remembers (`Proxy._key_names`).
_KEYS_REMEMBERED = 4096


# The model label of a request whose model is unknown: client-chosen strings
# must not become label values (one time series per typo).
UNKNOWN_MODEL = "(unknown)"


@dataclass(frozen=True)
class ProxyOptions:
    """How the proxy routes and counts (app/gateway/settings/router.py).

    `affinity`: a conversation's requests go to one replica (choice.py).
    `count_concurrency`, `count_timeout`: the llama.cpp prompt counts
    running at once, and how long one may take (usage/prompt_count.py).
    `response_keys`: what provider response ids are bound to their keys
    with (responses.tag_keys, from the shared secret, so alike on every
    gateway); none: a key of this proxy's own.
    """

    affinity: bool = True
    count_concurrency: int = 2
    count_timeout: float = 120.0
    response_keys: Sequence[bytes] = ()


class Proxy:
    """The ASGI app mounted at /v1 (see `main.create_app`).

    `client` sends requests to engines (a test passes one whose
    `on_request` records each attempt); the engines' load is polled, from
    `start()`, with a client of its own. The proxy closes both in `stop()`.
    """

    def __init__(
        self,
        table: RouteTable,
        hash_key: Callable[[str], str],
        timeouts: Timeouts,
        observer: RequestObserver | None = None,
        limiter: Limiter | None = None,
        client: UpstreamClient | None = None,
        tracer: Tracer | None = None,
        options: ProxyOptions | None = None,
    ) -> None:
        opts = options or ProxyOptions()
        self._affinity = opts.affinity
        self._tracer = tracer  # None: no spans, and nothing of OpenTelemetry imported
        self._table = table
        # Client keys' limits and usage, decided here with no I/O.
        self.limits = limiter or Limiter()
        self._hash_key = hash_key
        # Keys that passed, by what the client sent: the same key's hash is
        # not computed again on each of its requests (a sha256 through
        # OpenSSL, some 1.3 us with its digest lookup). Bounded, and only
        # keys that were granted: a flood of made-up keys fills nothing. A
        # revoked key is refused all the same: the grant is looked up anew.
        self._key_names: dict[str, str] = {}
        self._observer = observer
        self._timeouts = timeouts
        self._upstreams = Upstreams(table, timeouts, client or UpstreamClient(timeouts.connect),
                                    tracer, observer.continued if observer else None)
        # The prompts of streams whose engine reports no usage (llama.cpp).
        self._counts = PromptCounter(self._upstreams.client, self.limits,
                                     opts.count_concurrency, opts.count_timeout,
                                     observer.prompt_counted if observer else None)
        self._upstreams.prompts = self._counts  # a stream's asked-for usage (relay.py)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._turns: Turns | None = None  # made with the loop (start())
        self._polls: UpstreamClient | None = None
        # Engines' own load, read off the request path with a client of its own.
        self.loads = EngineLoadPoller(table, lambda: self._polls)
        self._polling: asyncio.Task[None] | None = None
        # The watches of requests being forwarded, for `cut_open()`.
        self._open: set[Watch] = set()
        self._extra = passthrough.Passthrough(table, ProviderIds(
            opts.response_keys or (secrets.token_bytes(32),)))

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._turns = Turns(self._loop)
        self._polls = UpstreamClient(_POLL_CONNECT)
        self._polling = asyncio.create_task(self.loads.run(), name="engine-loads")

    async def stop(self) -> None:
        if self._polling is not None:
            self._polling.cancel()
            await asyncio.gather(self._polling, return_exceptions=True)
            self._polling = None
        await self.stop_counting()
        await self._upstreams.client.close()
        if self._polls is not None:
            await self._polls.close()
            self._polls = None

    def cut_open(self) -> int:
        """Ends every request still being forwarded as its deadline would (a
        stream with an error event, code `gateway_stopping`): the end of a
        stop's grace period (docs/design/stopping.md). Returns how many."""
        open_now = list(self._open)
        for watch in open_now:
            watch.cut()
        return len(open_now)

    async def stop_counting(self) -> None:
        """Ends the prompt counts still running: their prompts are estimated."""
        await self._counts.close()

    # --- ASGI -------------------------------------------------------------------

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path, method = scope["path"], scope["method"]
        assert self._loop is not None and self._turns is not None, \
            "Proxy.start() was not awaited"
        started = self._loop.time()
        ex = Exchange(method, path, started)  # the request id, the access line (access.py)
        # From when its server began to read it, where the server says
        # (app/gateway/http1.py): its parse and scheduling are the
        # gateway's time too (`Outcome.gateway`).
        ex.arrived = scope.get(ARRIVED) or time.perf_counter()
        # In a burst, a few begin each loop turn (turns.py).
        wait = self._turns.begin()
        if wait is not None:
            await wait
        # A refusal's answer (status, body, headers, the server's direct
        # writer), sent after its except block: no await in a handler, which
        # the compiled router would get wrong (docs/design/hot-path.md, "The
        # router compiled").
        answer: tuple[int, bytes, list[tuple[bytes, bytes]], Any] | None = None
        try:
            try:
                await self._serve(scope, receive, send, ex)
            except OverLimit as over:
                ex.status = 429
                answer = (429, openai_error_body(over.message, over.kind, over.code),
                          [(b"retry-after", str(over.retry_after).encode()), ex.header],
                          scope.get(DIRECT_BODY))
            except Reply as r:
                ex.status = r.status
                extra = [(b"www-authenticate", b"Bearer")] if r.status == 401 else []
                if not ex.body_read and has_body(scope):
                    # Refused before its body was read (no key, too large): the
                    # connection closes rather than read the rest to reach a
                    # next request (docs/design/security.md).
                    extra.append((b"connection", b"close"))
                answer = (r.status, r.body, [*extra, *r.headers, ex.header],
                          scope.get(DIRECT_BODY))
            except ClientGone:
                ex.status = CLIENT_GONE
            except Exception:
                logger.exception("unhandled error on %s %s", method, path)
                ex.status = 500
                answer = (500, openai_error_body("Internal error in the gateway.",
                                                 "server_error"), [ex.header], None)
            if answer is not None:
                status, body, headers, direct = answer
                try:
                    await send_whole(send, status, body, headers, direct=direct)
                except RuntimeError:
                    if status != 500:
                        raise
                    # 500: the response had started (a stream): the client sees it cut
        finally:
            self._ended(ex)

    async def _serve(self, scope: Scope, receive: Receive, send: Send, ex: Exchange) -> None:
        """The edge, in order: the key, the route, the body, the model and the
        key's admission; then the `Call` goes to a replica (relay.py)."""
        token, session = headers_of(scope, ex)
        if self._tracer is not None:
            self._tracer.begin(ex)
        grant = self._authenticate(token)
        ex.key_id = grant.id
        path, method = ex.path, ex.method
        if path == "/v1/models" or path.startswith("/v1/models/"):
            await self._list_models(grant, send, ex)
            return
        other = path not in _FORWARDED  # vLLM's other routes (passthrough.py)
        if other and not passthrough.serves(path):
            raise error(404, f"Unknown path {path}.", "invalid_request_error", "unknown_url")
        if other:
            passthrough.check_method(method, path)
        elif method != "POST":
            raise error(405, f"{method} is not allowed on {path}.", "invalid_request_error")
        raw = await read_body(receive)
        ex.body_read = True
        query = scope.get("query_string", b"").decode("latin-1")
        if unsafe_target(query):
            # The engine client could not send it; refused here, before
            # any attempt, so that no replica is blamed (relay.py).
            raise error(400, "The query string holds a character that cannot be "
                        "forwarded (a space or a control character): percent-encode it.",
                        "invalid_request_error", "invalid_query")
        # What `llmgw serve`'s server offers beside ASGI (direct_body.py).
        direct: DirectBody | None = scope.get(DIRECT_BODY)
        if other:
            plan = await self._extra.prepare(grant, path, query, raw, _content_type(scope))
            call = await self._other_call(grant, plan, query, session, receive, send, direct,
                                          ex)
        else:
            call = await self._forwarded_call(grant, raw, query, session, receive, send, direct,
                                              ex)
        if call.send is send:  # the server's own: it may write a stream's body directly
            call.direct = direct
        # Forwarded; the admission released however it ends.
        ticket = ex.ticket
        assert ticket is not None
        self._open.add(call.watch)
        try:
            ex.status = await self._upstreams.forward(call)
        finally:
            self._open.discard(call.watch)
            call.watch.close()
            ticket.release()
            if ticket.prompt_later:  # a llama.cpp stream's: counted by its engine
                self._counts.submit(ticket)

    async def _forwarded_call(self, grant: KeyGrant, raw: bytes, query: str,
                              session: str | None, receive: Receive, send: Send,
                              direct: DirectBody | None, ex: Exchange) -> Call:
        """A chat, completion or embeddings request, admitted. `direct`: the
        server's hook for its client's leaving, if it offers one."""
        body, model, rewritten = self._request(grant, raw)
        ex.model = model
        named_options = "stream_options" in body  # before the admission asks for usage
        affinity = self._affinity_of(body, session, model)
        spill = Spill.of(self._table, self.limits, self._timeouts, model, len(raw))
        # A request refused below its key's limit first waits, bounded, for
        # its claim to be raised (docs/design/client-keys.md).
        ticket = ex.ticket = await self._admit(grant, model, ex.path, body)
        call = Call(
            ex, Watch(receive, self._timeouts, ex.started, self._loop, direct), send, model,
            f"{ex.path}?{query}" if query else ex.path, body, body.get("stream") is True)
        call.meter, call.grant, call.ticket = ticket.meter, grant, ticket
        call.affinity, call.spill = affinity, spill
        # The client's bytes go on untouched when nothing was rewritten, or
        # with the ask for a stream's usage appended: no encode per request,
        # which grows with the prompt.
        call.raw = None if rewritten else (
            raw if not ticket.meter.strip_usage
            else None if named_options else usage_asked_in(raw))
        return call

    async def _other_call(self, grant: KeyGrant, plan: passthrough.Plan, query: str,
                          session: str | None, receive: Receive, send: Send,
                          direct: DirectBody | None, ex: Exchange) -> Call:
        """One of vLLM's other routes, as passthrough.py planned it, admitted. A pinned
        or non-chat route never spills (spill.py)."""
        ex.model = plan.model
        affinity = self._affinity_of(plan.body, session, plan.model)
        ticket = ex.ticket = await self.limits.admit_or_wait(
            grant.id, plan.model, grant.limits, grant.gateways)
        if plan.stream:
            ticket.meter.body = plan.estimate  # estimated from, if cut short
        watch = Watch(receive, self._timeouts, ex.started, self._loop, direct)
        call = Call(ex, watch, plan.sender(send), plan.model,
                    f"{plan.target}?{query}" if query else plan.target, plan.body, plan.stream)
        call.meter = ticket.meter if plan.metered else None
        call.grant, call.ticket, call.affinity = grant, ticket, affinity
        call.pin, call.encode = plan.pin, plan.encode
        return call

    def _affinity_of(self, body: dict[str, Any], session: str | None,
                     model: str) -> str | None:
        """The conversation the request continues, when `model` has a choice
        of replicas; OpenAI's own `prompt_cache_key` names one too."""
        if not self._affinity or len(self._table.endpoints(model)) <= 1:
            return None
        cache_key = body.get("prompt_cache_key")
        return affinity_key(body, session or (cache_key if isinstance(cache_key, str)
                                              else None))

    async def _list_models(self, grant: KeyGrant, send: Send, ex: Exchange) -> None:
        if ex.method != "GET":
            raise error(405, f"{ex.method} is not allowed on {ex.path}.",
                        "invalid_request_error")
        ident = ex.path[len("/v1/models/"):]
        await send_whole(send, 200, self._model(grant, ident) if ident
                         else self._models(grant), [ex.header])
        ex.status = 200

    def _ended(self, ex: Exchange) -> None:
        """The request's metrics, access line and span."""
        assert self._loop is not None
        now = self._loop.time()
        if self._observer is not None and (ex.path in _FORWARDED or ex.model):
            # By `perf_counter()` from the request's arrival: the loop's
            # clock moves in whole milliseconds (access.py, `first_token`).
            first, t, arrived = ex.first_token, ex.ticket, ex.arrived
            self._observer.observe(Outcome(
                ex.model or UNKNOWN_MODEL, ex.status, time.perf_counter() - arrived,
                first - arrived if first else None, t.meter.prompt_tokens if t else 0,
                t.meter.completion_tokens if t else 0,
                ex.answered - arrived - ex.upstream_wait if ex.answered else None))
        ex.log(now)
        if self._tracer is not None and ex.span is not None:
            self._tracer.end(ex)

    def _authenticate(self, token: str) -> KeyGrant:
        if not token:
            raise error(401, "Missing API key: send 'Authorization: Bearer <key>'.",
                        "invalid_request_error", "invalid_api_key")
        name = self._key_names.get(token)
        remembered = name is not None
        if name is None:
            name = self._hash_key(token)
        grant = self._table.grant(name)
        if grant is None and not self._table.keys_loaded:
            # Listening before the state has loaded (a restart, or the store
            # unreachable since start): a valid key must not read as wrong.
            raise error(503, "This gateway has not loaded its state yet; try again shortly.",
                        "server_error", "gateway_loading", retry_after=1)
        if grant is None:
            raise error(401, "Incorrect API key provided.", "invalid_request_error",
                        "invalid_api_key")
        if self.limits.expired(grant.expires):
            raise error(401, "This API key has expired.", "invalid_request_error",
                        "invalid_api_key")
        if not remembered:
            if len(self._key_names) >= _KEYS_REMEMBERED:
                self._key_names.clear()
            self._key_names[token] = name
        return grant

    async def _admit(self, grant: KeyGrant, model: str, path: str,
                     body: dict[str, Any]) -> Ticket:
        """The key's ticket for this request (OverLimit if over a limit). A
        stream asks the engine for its usage, which the client may not have:
        usage is counted from it (app/router/usage/limits.py)."""
        ticket = await self.limits.admit_or_wait(grant.id, model, grant.limits, grant.gateways)
        if body.get("stream") is True and path != "/v1/embeddings":
            meter = ticket.meter
            meter.strip_usage = ask_for_usage(body)
            meter.body = body  # its usage is estimated from it if cut short
            meter.chat = path == "/v1/chat/completions"
        return ticket

    def _listed(self, grant: KeyGrant) -> list[dict[str, Any]]:
        return [
            {"id": ident, "object": "model", "created": entry.created,
             "owned_by": "llmgw", "root": entry.name}
            | ({"parent": entry.parent} if entry.parent else {})
            for entry in self._table.catalog() if grant.allows(entry.name)
            for ident in (entry.name, *entry.aliases)
        ]

    def _models(self, grant: KeyGrant) -> bytes:
        return json.dumps({"object": "list", "data": self._listed(grant)}).encode()

    def _model(self, grant: KeyGrant, ident: str) -> bytes:
        # The first entry `_listed` would name it by, without listing the
        # whole catalog (2,000 models: 4,000 dicts) for one model.
        for entry in self._table.catalog():
            if (ident == entry.name or ident in entry.aliases) and grant.allows(entry.name):
                return json.dumps({"id": ident, "object": "model", "created": entry.created,
                                   "owned_by": "llmgw", "root": entry.name}).encode()
        raise error(404, f"The model '{ident}' does not exist or you do not have access to it.",
                    "invalid_request_error", "model_not_found", "model")

    def _request(self, grant: KeyGrant, raw: bytes) -> tuple[dict[str, Any], str, bool]:
        """The parsed body, its model rewritten to the catalog name, that name,
        and whether the body now differs from `raw` (an alias; or a key
        "model" written more than once, which only our parse decided)."""
        body = parse_json(raw)
        requested = checked_model(body)  # and the other fields the gateway acts on
        name = self._table.resolve(requested)
        if name is None or not grant.allows(name):
            raise error(
                404, f"The model '{requested}' does not exist or you do not have access to it.",
                "invalid_request_error", "model_not_found", "model")
        body["model"] = name  # engines serve the catalog name, not the alias
        return body, name, name != requested or raw.count(b'"model"') != 1


def _content_type(scope: Scope) -> str:
    for name, value in scope["headers"]:
        if name == b"content-type":
            return str(value.decode("latin-1"))
    return ""
