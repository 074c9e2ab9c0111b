"""The Responses API's state, found where it lives (docs/architecture.md,
"The Responses API and vLLM's other routes").

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
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets

from app.router.replies import Reply, error
from app.router.table import RouteTable

PREFIX = "resp_"
# resp_<nonce>.<replica id>: replica ids are a slug of [a-z0-9-] and 8 hex
# digits (app/control/plan.py), never a dot.
_OURS = re.compile(r"resp_([0-9a-f]{32})\.([a-z0-9][a-z0-9-]{0,63})")


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
