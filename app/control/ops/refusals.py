"""Why a control-plane operation did not do what it was asked: typed, so
the caller (app/api) chooses the answer (RFC 9457 problem, status, title)
and the operation knows nothing of HTTP. Each carries the sentence that
says why; `detail` is what a client is told.
"""

from __future__ import annotations

from typing import Literal


class Refusal(Exception):
    """Nothing was written (or, for OutcomeUnknown, that is not known)."""

    def __init__(self, detail: str) -> None:
        super().__init__(detail)
        self.detail = detail


class NotFound(Refusal):
    """The record the operation acts on does not exist."""

    def __init__(self, what: Literal["model", "key", "quota", "node"], detail: str) -> None:
        super().__init__(detail)
        self.what = what


class Taken(Refusal):
    """A name the write would claim is held by another record."""


class Invalid(Refusal):
    """The write breaks a rule only the whole catalog can check (an
    adapter's base); `loc` names the field in the request body."""

    def __init__(self, loc: tuple[str, ...], detail: str) -> None:
        super().__init__(detail)
        self.loc = loc


class InUse(Refusal):
    """Other records depend on the one the write would remove or change
    (adapters on their base model)."""


class Busy(Refusal):
    """The record kept changing under the operation (races lost, each
    decided again on the winner's write); sending it again may succeed."""

    def __init__(self, what: Literal["catalog", "record", "node"], detail: str) -> None:
        super().__init__(detail)
        self.what = what


class PreconditionFailed(Refusal):
    """The caller's If-Match / If-None-Match does not hold; `current` is the
    record's ETag now (None: it does not exist)."""

    def __init__(self, detail: str, current: str | None) -> None:
        super().__init__(detail)
        self.current = current


class TooLate(Refusal):
    """The caller's deadline passed before the write was sent."""


class NotSaved(Refusal):
    """The store answered, and the record is not there."""


class OutcomeUnknown(Refusal):
    """The store did not answer: whether the write landed is not known, or
    (`known_absent`) it was looked for after and not found. `id` names the
    record so the caller can check it later."""

    def __init__(self, detail: str, id: str, known_absent: bool = False) -> None:
        super().__init__(detail)
        self.id = id
        self.known_absent = known_absent
