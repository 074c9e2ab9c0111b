"""The control plane's refusals (app/control/ops/refusals.py) as problems:
one place that says which status and title each gets, so every handler
answers a refusal the same way."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from app.api.errors import Problem
from app.control.ops import refusals as r

_BUSY = {"catalog": "Catalog busy", "record": "Busy", "node": "Node busy"}


def as_problem(refusal: r.Refusal) -> Problem:
    match refusal:
        case r.NotFound():
            return Problem(404, f"No such {refusal.what}", refusal.detail)
        case r.Taken():
            return Problem(409, "Name already in use", refusal.detail)
        case r.Invalid():
            return Problem(422, "Invalid request body", refusal.detail, errors=[
                {"loc": ["body", *refusal.loc], "msg": refusal.detail, "type": "value_error"}])
        case r.InUse():
            return Problem(409, "Model in use", refusal.detail)
        case r.Busy():
            return Problem(409, _BUSY[refusal.what], refusal.detail)
        case r.PreconditionFailed():
            return Problem(412, "Precondition Failed", refusal.detail, etag=refusal.current)
        case r.TooLate():
            return Problem(408, "Deadline passed", refusal.detail)
        case r.NotSaved():
            return Problem(503, "Client key not saved", refusal.detail)
        case r.OutcomeUnknown():
            title = "State store unavailable" if refusal.known_absent else "Outcome unknown"
            return Problem(503, title, refusal.detail, id=refusal.id)
    return Problem(409, "Refused", refusal.detail)


@contextmanager
def answered() -> Iterator[None]:
    """Raises the problem a refusal inside the block is answered with."""
    try:
        yield
    except r.Refusal as exc:
        raise as_problem(exc) from exc
