"""The two fields the gateway reads from a multipart form (speech to text:
`/v1/audio/transcriptions`), and the model's rewrite to its catalog name.

Only what routing needs is read: `model`, `stream`, and that a `file` part
is there; the audio passes as sent. Bounded: the body is already capped
(intake.MAX_BODY), a part's headers are read up to `_HEADERS_MAX` bytes,
at most `_PARTS_MAX` parts are looked at, and each step is a `bytes.find`
(C speed, linear in the body). The fields take one form, the one the
gateway reads: a second `model` or `stream`, or a `stream` other than
`true`/`false` (vLLM's form parsing would take `1` or `yes` too), is
refused rather than read one way here and another in the engine
(docs/architecture.md, Security, "A client's fields, counted whatever
their form").
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from app.router.replies import Reply, error

_HEADERS_MAX = 8 * 1024
_PARTS_MAX = 1000
_FIELD_MAX = 1024  # the longest `model` or `stream` value read
_BOUNDARY = re.compile(r'boundary="?([0-9A-Za-z\'()+_,\-./:=? ]{1,70})"?')
_NAME = re.compile(rb'(?i)content-disposition:\s*form-data\s*;(?:[^\r\n]*?;)?\s*name="([^"\r\n]*)"')


@dataclass(frozen=True, slots=True)
class Form:
    model: str
    stream: bool
    model_at: tuple[int, int]  # where the model's value lies in the body
    # What the engine is sent as the body's type: rebuilt from the boundary
    # read (safe characters only), never the client's header as it came.
    content_type: bytes = b""

    def with_model(self, raw: bytes, name: str) -> bytes:
        """The body with its model's value replaced by `name` (`raw` itself
        when it names it already: no copy)."""
        if name == self.model:
            return raw
        start, end = self.model_at
        return raw[:start] + name.encode() + raw[end:]


def _bad(message: str, param: str | None = None, code: str | None = None) -> Reply:
    return error(400, message, "invalid_request_error", code, param)


def form_fields(raw: bytes, content_type: str) -> Form:
    """The form's model and stream flag; a 400 Reply naming what is wrong."""
    kind = content_type.split(";", 1)[0].strip().lower()
    m = _BOUNDARY.search(content_type)
    if kind != "multipart/form-data" or m is None:
        raise _bad("The request body must be multipart/form-data, with its boundary.")
    delimiter = b"\r\n--" + m.group(1).rstrip(" ").encode("latin-1")
    data = raw  # not copied: a copy of 30 MiB costs more than the scans
    values: dict[str, tuple[int, int]] = {}
    has_file = False
    # The first delimiter has no line break before it (bar a preamble's).
    first = data.find(delimiter[2:])
    pos = first + len(delimiter) - 2 if first >= 0 else -1  # just past a delimiter
    for _ in range(_PARTS_MAX):
        if pos < 0:
            break
        if data[pos:pos + 2] == b"--":
            break  # the closing delimiter
        head_end = data.find(b"\r\n\r\n", pos, pos + _HEADERS_MAX)
        if head_end < 0:
            raise _bad("A part of the form has no end to its headers.")
        following = data.find(delimiter, head_end + 4)
        if following < 0:
            raise _bad("The form is not closed by its boundary.")
        named = _NAME.search(data, pos, head_end + 2)
        name = named.group(1).decode("latin-1") if named else ""
        if name in ("model", "stream"):
            if name in values:
                raise _bad(f"The form has more than one '{name}' field.", name)
            values[name] = (head_end + 4, following)
        has_file = has_file or name == "file"
        pos = following + len(delimiter)
    else:
        raise _bad(f"The form has more than {_PARTS_MAX} parts.")
    if not has_file:
        raise _bad("You must provide a file.", "file")
    if "model" not in values:
        raise _bad("You must provide a model parameter.", "model")
    model = _text(raw, values["model"], "model")
    if not model:
        raise _bad("You must provide a model parameter.", "model")
    stream = _text(raw, values["stream"], "stream") if "stream" in values else "false"
    if stream not in ("true", "false"):
        raise _bad("Invalid value for 'stream': expected 'true' or 'false'.", "stream",
                   "invalid_type")
    boundary = m.group(1).rstrip(" ")
    return Form(model, stream == "true", values["model"],
                f'multipart/form-data; boundary="{boundary}"'.encode("latin-1"))


def _text(raw: bytes, at: tuple[int, int], name: str) -> str:
    start, end = at
    if end - start > _FIELD_MAX:
        raise _bad(f"The '{name}' field is longer than {_FIELD_MAX} bytes.", name)
    try:
        return raw[start:end].decode()
    except UnicodeDecodeError:
        raise _bad(f"The '{name}' field is not UTF-8.", name) from None
