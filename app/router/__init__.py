"""The router: the `/v1` data path, a plain ASGI app on the hot path.

Every gateway serves it. It reads only its own in-memory `RouteTable`,
filled by the gateway from the store's watches (app/gateway/publish.py):
no request ever waits on the store. It never imports the control plane
(import-linter's first contract); what it needs of it arrives as the plain
values of `published`. A request's life, in order: `proxy` (the edge: key,
route, body, model, admission) builds a `call.Call`, which `relay` sends
(spill, hold, attempts) and relays whole or as a stream (`relay_stream`);
`usage/` limits and meters it.

Modules:
- `proxy`: the ASGI app at /v1: the edge's stages, /v1/models, the access line.
- `turns`: a burst's requests begin a few a loop turn, beside the streams flowing.
- `call`: `Call`, one request on its way to a replica, read by every stage.
- `outcome`: `Outcome`, how a request ended, told to the gateway's observers.
- `relay`: forward, attempts on one replica after another, a whole answer.
- `relay_stream`: a stream's chain of chunk transforms, its failures and continuation.
- `continuation`: a stream whose engine died, continued on another replica.
- `direct_body`: a stream's body written straight to the client's socket, where offered.
- `hold`: scale from zero: a request held while its model's replica starts.
- `spill`: a request's way to its model's overflow (an external provider).
- `passthrough`: vLLM's other routes (Responses API, audio, rerank, tokenize, ...).
- `responses`: the Responses API's stored ids, bound to their replica and key.
- `table`: `RouteTable`, the router's view: replicas, loads, cooldowns, keys, catalog.
- `choice`: which replica takes a request: priority tiers, affinity, two random choices.
- `engine_load`: the engines' own load, polled off the request path.
- `published`: the plain values the control side hands the table (endpoints, grants).
- `upstream`: the router's HTTP client to engines, on httptools.
- `request_line`: the request line and headers that client writes, checked.
- `request_read`: a request's headers and body read at the edge, under their caps.
- `body_fields`: the body fields the gateway acts on, type-checked.
- `multipart_form`: the fields read from a multipart form, with python-multipart.
- `sse`: server-sent events: the one parser of a stream's events.
- `own_answers`: what the router answers itself: OpenAI-shaped errors, whole bodies.
- `answer_model`: an external provider's answer renamed to the catalog's model.
- `engine_errors`: an engine's error answers read (llama.cpp's 500s, a missing route).
- `engine_headers`: the headers sent to an engine and passed back from it.
- `timeouts`: `Timeouts` and `Watch`, which cancels a request at its limits.
- `access`: `Exchange`, the request as the access log and traces see it.
- `tracing`: OpenTelemetry spans, imported only when tracing is on.
- `openapi`: the OpenAPI description of /v1.
- `usage/`: client keys' limits and budgets, usage read from answers, prompts counted.
"""

# The compiled copy of these modules, when one matches them (app/compiled.py).
from app.compiled import package_path

__path__ = package_path(__name__, __path__)
