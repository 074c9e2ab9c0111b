"""vLLM's routes beyond chat, completions and embeddings, passed through
(docs/design/responses-api.md).

Each is routed by its model like the others, behind the client key, its
model grants and its limits: the Responses API (`/v1/responses`, and a
stored response's GET and cancel, routed to the replica that holds it,
responses.py), reranking and scoring (`/v1/rerank`, `/rerank`,
`/v2/rerank`, `/v1/score`, `/score`), tokenizing (`/tokenize`,
`/detokenize`, outside `/v1` as vLLM serves them) and speech to text
(`/v1/audio/transcriptions`, `/v1/audio/translations`, a multipart form).
`prepare()` turns a request into a `Plan` for the relay; it reads the
fields the gateway acts on, with the one form it reads (body_fields.py), and
leaves the rest to the engine.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qs

from app.router import responses
from app.router.body_fields import checked_model
from app.router.call import Encoder
from app.router.multipart_form import form_fields
from app.router.own_answers import Send, error
from app.router.published import Endpoint, KeyGrant
from app.router.request_read import parse_json
from app.router.table import RouteTable

# Client path -> engine path, for JSON bodies POSTed with a `model`.
JSON_ROUTES = {p: p for p in ("/v1/responses", "/v1/rerank", "/rerank", "/v2/rerank",
                              "/v1/score", "/score", "/tokenize", "/detokenize")}
FORM_ROUTES = frozenset({"/v1/audio/transcriptions", "/v1/audio/translations"})
# The paths outside /v1 that the gateway's ASGI app hands to the router (main.py).
ROOT_PATHS = frozenset(p for p in JSON_ROUTES if not p.startswith("/v1/"))
_STORED = "/v1/responses/"
# A form's parse is two scans over its bytes and python-multipart's work on
# its headers, bounded (multipart_form.py; measured: 18 ms for 30 MiB, 0.11 ms for
# 256 KiB, at most 2.2 ms for the worst small form, a loaded 2-core
# machine), its rewrite a copy (when an alias is renamed): past this size,
# both run off the loop.
_OFF_LOOP = 256 * 1024



@dataclass(slots=True)
class Plan:
    """What the relay is asked to do with one request."""

    model: str
    target: str  # the engine's path
    encode: Encoder
    stream: bool = False
    pin: str | None = None  # the one replica that may take it
    body: dict[str, Any] = field(default_factory=dict)  # JSON bodies: the affinity's input
    # A stream's usage is estimated from this if it is cut before its usage
    # event (usage/limits.py): the Responses API's input as chat messages or a prompt.
    estimate: dict[str, Any] | None = None
    # False: a request with no tokens of its own (a stored response's GET or
    # cancel, whose answer repeats the usage its create was charged).
    metered: bool = True
    # A create's answer on its way to the client, its provider's id wrapped.
    wrapping: responses.Wrapping | None = None

    def sender(self, send: Send) -> Send:
        """What the relay sends the answer with."""
        return send if self.wrapping is None else self.wrapping.send(send)


def serves(path: str) -> bool:
    return path in JSON_ROUTES or path in FORM_ROUTES or _stored_id(path) is not None


def check_method(method: str, path: str) -> None:
    """405 unless `method` is the one `path` takes."""
    wanted = "GET" if _stored_id(path) is not None and not path.endswith("/cancel") else "POST"
    if method != wanted:
        raise error(405, f"{method} is not allowed on {path}.", "invalid_request_error")


def _stored_id(path: str) -> str | None:
    """The response id of `/v1/responses/{id}` or `/v1/responses/{id}/cancel`."""
    if not path.startswith(_STORED):
        return None
    rest = path[len(_STORED):].removesuffix("/cancel")
    return rest if rest and "/" not in rest else None


class Passthrough:
    def __init__(self, table: RouteTable, ids: responses.ProviderIds) -> None:
        self._table = table
        self._ids = ids

    async def prepare(self, grant: KeyGrant, path: str, query: str, raw: bytes,
                      content_type: str) -> Plan:
        """The plan for one request whose body was read (a 4xx Reply if refused)."""
        stored = _stored_id(path)
        if stored is not None:
            return self._stored(grant, path, stored, query)
        if path in FORM_ROUTES:
            return await self._form(grant, path, raw, content_type)
        body = parse_json(raw)
        model = self._allowed(grant, checked_model(body))
        body["model"] = model
        if path != "/v1/responses":
            payload = json.dumps(body).encode()
            return Plan(model, JSON_ROUTES[path], lambda ep: _json(ep, body, payload), body=body)
        return self._create(grant, model, body)

    def _allowed(self, grant: KeyGrant, requested: str) -> str:
        name = self._table.resolve(requested)
        if name is None or not grant.allows(name):
            raise error(404, f"The model '{requested}' does not exist or you do not have "
                        "access to it.", "invalid_request_error", "model_not_found", "model")
        return name

    def _create(self, grant: KeyGrant, model: str, body: dict[str, Any]) -> Plan:
        """POST /v1/responses: a continuation goes where its previous response
        is; a provider's ids reach the client bound to its key (responses.py)."""
        prev = checked_previous(body)
        pin = responses.replica_of(prev, grant.id, "previous_response_id") if prev else None
        if prev and pin is not None and all(
                ep.replica_id != pin for ep in self._table.endpoints(model)):
            self._elsewhere(grant, prev, pin)
        theirs = None  # the provider's id of the previous response
        if prev and pin is None:
            theirs = self._ids.unwrap(prev, grant.id, "previous_response_id")
            if theirs is None:
                # Neither ours nor a provider's bound to this key: no replica
                # made it, and a provider's raw id may be another key's.
                raise responses.not_found(prev, "previous_response_id")
        body.pop("request_id", None)  # the gateway's to set (responses.py)
        wrapping = self._ids.answer(grant.id, (theirs, prev) if theirs and prev else None)

        def encode(ep: Endpoint) -> tuple[bytes, bytes, bytes]:
            wrapping.on = not ep.engine
            if not ep.engine:  # an external provider: its own ids, no vLLM extension
                return _json(ep, body if theirs is None else
                             body | {"previous_response_id": theirs}, b"")
            sent = body | {"request_id": responses.new_id(ep.replica_id, grant.id)}
            return b"POST", json.dumps(sent).encode(), b"application/json"

        given = body.get("input")
        estimate = {"messages": given} if isinstance(given, list) else {"prompt": given}
        return Plan(model, "/v1/responses", encode, body.get("stream") is True, pin, body,
                    estimate, wrapping=wrapping)

    def _elsewhere(self, grant: KeyGrant, prev: str, replica: str) -> None:
        """A continuation whose replica does not serve the body's model: gone,
        or another model's (named only to a key allowed it)."""
        owner = responses.model_of(self._table, replica)
        if owner is None:
            raise responses.gone(prev, replica, "previous_response_id")
        if not grant.allows(owner):
            raise responses.not_found(prev, "previous_response_id")
        raise error(400, f"Response '{prev}' was made by model '{owner}': continue it with "
                    "that model.", "invalid_request_error", "model_mismatch",
                    "previous_response_id")

    def _stored(self, grant: KeyGrant, path: str, response_id: str, query: str) -> Plan:
        """GET /v1/responses/{id} and POST …/cancel, to the replica holding it."""
        replica = responses.replica_of(response_id, grant.id)
        if replica is None:
            raise responses.not_found(response_id, "response_id")
        model = responses.model_of(self._table, replica)
        if model is None:
            raise responses.gone(response_id, replica, "response_id")
        if not grant.allows(model):
            raise responses.not_found(response_id, "response_id")
        stream = (not path.endswith("/cancel")
                  and parse_qs(query).get("stream") == ["true"])
        method = b"POST" if path.endswith("/cancel") else b"GET"
        # Its answer (a stream's last event too) repeats the usage its create
        # was charged: a request, with no tokens.
        return Plan(model, path, lambda ep: (method, b"", b"application/json"), stream, replica,
                    metered=False)

    async def _form(self, grant: KeyGrant, path: str, raw: bytes, content_type: str) -> Plan:
        if len(raw) > _OFF_LOOP:
            form = await asyncio.to_thread(form_fields, raw, content_type)
        else:
            form = form_fields(raw, content_type)
        model = self._allowed(grant, form.model)
        sent = (await asyncio.to_thread(form.with_model, raw, model)
                if len(raw) > _OFF_LOOP else form.with_model(raw, model))
        return Plan(model, path, lambda ep: (b"POST", sent, form.content_type), form.stream)


def checked_previous(body: dict[str, Any]) -> str | None:
    """A /v1/responses body's `previous_response_id`: a string or null."""
    prev = body.get("previous_response_id")
    if prev is not None and type(prev) is not str:
        raise error(400, "Invalid type for 'previous_response_id': expected a string.",
                    "invalid_request_error", "invalid_type", "previous_response_id")
    return prev


def _json(ep: Endpoint, body: dict[str, Any], payload: bytes) -> tuple[bytes, bytes, bytes]:
    if ep.upstream_model:  # an external model: its name at its provider
        payload = json.dumps(body | {"model": ep.upstream_model}).encode()
    elif not payload:
        payload = json.dumps(body).encode()
    return b"POST", payload, b"application/json"
