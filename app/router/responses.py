"""The Responses API's state, found where it lives (docs/design/responses-api.md).

vLLM keeps a stored response (and the messages that led to it) in the
memory of the engine process that made it: a `previous_response_id`, or a
GET of the response, answered by any other replica is "not found". So the
router must send those to the replica that made the response, from any
gateway, also one that never saw the response made.

The id says where: vLLM takes a create request's `request_id` field (its
own extension) as the response's id, so the gateway sets it, per attempt,
to `resp_<32 random hex>.<replica id>`. The client sees vLLM's answer as
vLLM wrote it, no body rewritten, and any gateway reads the replica back
from the id alone: nothing is remembered, nothing shared, nothing to
expire. What bounds the state is the engine's own store (vLLM never
evicts from it; it holds responses only with
VLLM_ENABLE_RESPONSES_API_STORE=1), and the replica's life: an id whose
replica is gone gets a 404 that says so (`replica_gone`), not another
replica's "not found".

Ownership: the id is bound to the client key that made it. Its 32 hex
digits are 64 random bits and the first 64 bits of
sha256(key id, NUL, those random digits); another key holding the id gets
vLLM's own "not found" to a GET, a cancel or a continuation, and nothing
reaches the replica (which would answer: vLLM stores a response under its
id alone, and a changed id is another id). No secret is needed: a key can
make a tag for itself, but only on an id the engine never stored.

An external provider makes its own ids, and stores each conversation
under it alone: any key holding one continues it there. So the client
sees each provider id bound to its key, `<provider id>.ext_<tag>`, the tag
32 hex digits of HMAC(key derived from the shared secret, key id NUL
provider id): here a secret is needed, since the provider stores the id
without the tag (`ProviderIds`). A continuation unwraps it, checked, for
the provider; an id of another key, or one not wrapped (a provider's raw
id), is "not found", and nothing reaches the provider.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import re
import secrets
from collections.abc import Sequence

from app.router import sse
from app.router.own_answers import Message, Reply, Send, error
from app.router.table import RouteTable

PREFIX = "resp_"
# resp_<nonce>.<replica id>: replica ids are a slug of [a-z0-9-] and 8 hex
# digits (app/control/plan/placing.py), never a dot.
_OURS = re.compile(r"resp_([0-9a-f]{32})\.([a-z0-9][a-z0-9-]{0,63})")
# <provider id>.ext_<tag>: never one of ours (`_` is in no replica id).
_WRAPPED = re.compile(r"(.{1,512})\.ext_([0-9a-f]{32})", re.DOTALL)
_TAG_LABEL = b"llmgw response id\x00"


def _tag(owner: str, nonce: str) -> str:
    return hashlib.sha256(f"{owner}\0{nonce}".encode()).hexdigest()[:16]


def new_id(replica_id: str, owner: str) -> str:
    """A response id naming the replica that will hold the response, bound
    to `owner`, the id of the client key that asks for it."""
    nonce = secrets.token_hex(8)
    return f"{PREFIX}{nonce}{_tag(owner, nonce)}.{replica_id}"


def replica_of(response_id: str, owner: str, param: str = "response_id") -> str | None:
    """The replica named by an id `new_id` made for `owner`; None for any
    other id (one an external provider made, a client's own). An id made
    for another key raises vLLM's "not found" (a Reply), the same answer as
    an id nobody made."""
    m = _OURS.fullmatch(response_id)
    if m is None:
        return None
    nonce, tag = m.group(1)[:16], m.group(1)[16:]
    if not hmac.compare_digest(tag, _tag(owner, nonce)):
        raise not_found(response_id, param)
    return m.group(2)


def gone(response_id: str, replica: str, param: str) -> Reply:
    return error(404, f"Response '{response_id}' was made by replica {replica}, which is "
                 "gone (stopped, moved or replaced): its stored state went with it. Start "
                 "again without previous_response_id.", "invalid_request_error",
                 "replica_gone", param)


def not_found(response_id: str, param: str) -> Reply:
    """vLLM's own answer for an unknown id, said by the gateway."""
    return error(404, f"Response with id '{response_id}' not found.", "invalid_request_error",
                 "response_not_found", param)


def model_of(table: RouteTable, replica: str) -> str | None:
    """The model whose routable replicas include `replica`, if any."""
    for entry in table.catalog():
        if any(ep.replica_id == replica for ep in table.endpoints(entry.name)):
            return entry.name
    return None


def tag_keys(current: str, previous: str | None = None) -> tuple[bytes, ...]:
    """The keys provider ids are tagged with (the first) and checked against
    (any), derived from the shared secret, so every gateway tags alike.
    While a rotation keeps the previous secret (LLMGW_PREVIOUS_SECRET), that
    one tags: every gateway of the rotation holds it, the ones not yet
    restarted as their only secret (docs/design/security.md)."""
    return tuple(hmac.new(s.encode(), _TAG_LABEL, hashlib.sha256).digest()
                 for s in ((previous, current) if previous else (current,)))


class ProviderIds:
    """Provider response ids bound to the client key that made them."""

    def __init__(self, keys: Sequence[bytes]) -> None:
        self._keys = tuple(keys)

    def _tag(self, key: bytes, owner: str, provider_id: str) -> str:
        msg = owner.encode() + b"\x00" + provider_id.encode()
        return hmac.new(key, msg, hashlib.sha256).hexdigest()[:32]

    def wrap(self, provider_id: str, owner: str) -> str:
        """The id `owner`'s client is given for the provider's `provider_id`."""
        return f"{provider_id}.ext_{self._tag(self._keys[0], owner, provider_id)}"

    def unwrap(self, given: str, owner: str, param: str) -> str | None:
        """The provider's id in `given`, an id `wrap` made for `owner`; None
        when `given` is not of that form; "not found" (a Reply) when it was
        made for another key, or tampered with."""
        m = _WRAPPED.fullmatch(given)
        if m is None:
            return None
        provider_id, tag = m.group(1), m.group(2)
        if any(hmac.compare_digest(tag, self._tag(k, owner, provider_id)) for k in self._keys):
            return provider_id
        raise not_found(given, param)

    def answer(self, owner: str, previous: tuple[str, str] | None) -> Wrapping:
        """The rewrite of one create's answer for `owner`; `previous`: the
        (provider id, wrapped id) of its previous_response_id, which the
        provider's answer names unwrapped."""
        return Wrapping(self, owner, previous)


class Wrapping:
    """One answer of a provider's Responses API on its way to the client:
    its response's id wrapped (`ProviderIds`), in a whole answer or in each
    stream event, by replacing the JSON string of the provider's id (a
    string equal to the id, whatever field holds it; quotes within a text
    are escaped, so never match). `on` while the request goes to a
    provider (set per attempt). A body the provider compressed against our
    `identity` passes as sent: its id unwrapped, which no continuation
    takes (docs/design/responses-api.md)."""

    __slots__ = ("_found", "_ids", "_owner", "_pairs", "_start", "on")

    def __init__(self, ids: ProviderIds, owner: str, previous: tuple[str, str] | None) -> None:
        self._ids = ids
        self._owner = owner
        # (the provider's id, ours) as JSON strings: the previous response's
        # (which the answer echoes), then this one's once seen.
        self._pairs = [] if previous is None else [_quoted(*previous)]
        self._found = False
        self._start: Message | None = None
        self.on = False

    def send(self, send: Send) -> Send:
        """`send`, with each body rewritten while `on`."""
        async def rewritten(message: Message) -> None:
            if not self.on:
                await send(message)
            elif message["type"] == "http.response.start":
                self._start = message  # held for its body: a whole answer's length changes
            elif message["type"] == "http.response.body":
                start, self._start = self._start, None
                more = bool(message.get("more_body", False))
                body = self._rewritten(bytes(message.get("body", b"")),
                                       whole=start is not None and not more)
                if start is not None:
                    if not more:
                        start = {**start, "headers": [
                            (k, str(len(body)).encode() if k == b"content-length" else v)
                            for k, v in start["headers"]]}
                    await send(start)
                await send({**message, "body": body})
            else:
                await send(message)
        return rewritten

    def _rewritten(self, body: bytes, whole: bool) -> bytes:
        if not self._found:
            found = _answer_id(body) if whole else _stream_id(body)
            if found is not None:
                self._found = True
                self._pairs.append(_quoted(found, self._ids.wrap(found, self._owner)))
        for raw, wrapped in self._pairs:
            body = body.replace(raw, wrapped)
        return body


def _quoted(provider_id: str, wrapped: str) -> tuple[bytes, bytes]:
    return json.dumps(provider_id).encode(), json.dumps(wrapped).encode()


def _response_id(obj: object) -> str | None:
    """The id of a Responses API response object."""
    if isinstance(obj, dict) and obj.get("object") == "response":
        rid = obj.get("id")
        return rid if isinstance(rid, str) and rid else None
    return None


def _answer_id(body: bytes) -> str | None:
    try:
        return _response_id(json.loads(body))
    except (ValueError, UnicodeDecodeError):
        return None


def _stream_id(chunk: bytes) -> str | None:
    """The response's id in the first of these whole events that holds it
    (`response.created` does, the stream's first)."""
    if chunk.find(b'"response"') < 0:  # find, not `in` (sse.whole_events says why)
        return None
    for data in sse.datas(chunk):
        if data.find(b'"response"') < 0:
            continue
        try:
            obj = json.loads(data)
        except (ValueError, UnicodeDecodeError):
            continue
        found = _response_id(obj.get("response")) if isinstance(obj, dict) else None
        if found is not None:
            return found
    return None
