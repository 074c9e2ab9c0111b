"""The two fields the gateway reads from a multipart form (speech to text:
`/v1/audio/transcriptions`), and the model's rewrite to its catalog name.

Only what routing needs is read: `model`, `stream`, and that a `file` part
is there; the audio passes as sent. The form is read by the parser vLLM
reads it with, python-multipart's, through the same callbacks as
Starlette's `MultiPartParser` (starlette/formparsers.py): a part's name is
`parse_options_header` of its last Content-Disposition header, a part with
a `filename` is a file. So `name=model`, `name = "model"` or `NAME="model"`
name the model here as they do in the engine (docs/design/responses-api.md). Where two readers could
still differ, the form is refused, not read one way: a second `model` or
`stream` (Starlette keeps the last of a name, FastAPI's `Form()` reads
that one), a `stream` other than `true`/`false` (vLLM's pydantic would take
`1` or `yes` too), a part with two Content-Disposition headers, one with an
RFC 2231 parameter (`name*=`: python-multipart 0.0.34 ignores it, earlier
ones decode it; an engine may run either), a `model` or `stream` sent as a
file.

Bounded: the body is already capped (intake.MAX_BODY). python-multipart
steps through some bytes one at a time in Python (a header value's leading
spaces, padding after a boundary, text that nearly matches the boundary:
measured 15 to 29 s for 32 MiB of them), so before it runs, a scan at C
speed (`bytes.find`) refuses what no client sends: more than
`_PARTS_MAX` boundaries, a boundary followed by anything but a line break
or `--` (RFC 2046: the boundary never appears inside a part), headers
longer than `_HEADERS_MAX` bytes in all. No part's bytes are copied but the
two fields' (at most `_FIELD_MAX` each).
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

from python_multipart.exceptions import FormParserError
from python_multipart.multipart import MultipartParser, parse_options_header

from app.router.own_answers import Reply, error

if TYPE_CHECKING:
    from python_multipart.multipart import MultipartCallbacks

# A transcription's form has at most a few dozen parts of 50 to 150 bytes of
# headers each (Starlette would take 1,000 fields and 1,000 files). These
# two bound the parser's Python work, which runs on the event loop for a
# small body (passthrough.py): about 2 ms at worst (measured, docs/design/responses-api.md).
# python-multipart logs a WARNING for each malformed form before it raises
# (an invalid header character, a lost boundary): the client is answered
# 400 here, and the gateway's log is not the client's to fill, a line a
# request. Its errors (a parser bug) still show.
logging.getLogger("python_multipart").setLevel(logging.ERROR)

_PARTS_MAX = 100
_HEADERS_MAX = 8 * 1024  # all the parts' headers together
_FIELD_MAX = 1024  # the longest `model` or `stream` value read
# RFC 2046's boundary characters, the last not a space: safe inside the
# quotes of the Content-Type the engine is sent.
_BOUNDARY = re.compile(rb"[0-9A-Za-z'()+_,\-./:=? ]{0,69}[0-9A-Za-z'()+_,\-./:=?]")
_QUOTED = re.compile(rb'"(?:[^"\\]|\\.)*"')
_READ = (b"model", b"stream")


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
    try:
        kind, params = parse_options_header(content_type)
    except UnicodeEncodeError:  # a character past latin-1: no boundary of RFC 2046's
        kind, params = b"", {}
    boundary = params.get(b"boundary", b"")
    # Starlette reads a form only as `multipart/form-data`, lowercased.
    if kind != b"multipart/form-data" or not _BOUNDARY.fullmatch(boundary):
        raise _bad("The request body must be multipart/form-data, with its boundary.")
    _bounded(raw, boundary)
    reader = _Reader(raw)
    try:
        parser = MultipartParser(boundary, reader.callbacks())
        parser.write(raw)  # whole: each field's value is one span of `raw`
    except FormParserError:
        raise _bad("The request body is not a well-formed multipart form.") from None
    if not reader.ended:
        raise _bad("The form is not closed by its boundary.")
    if not reader.file_sent:
        raise _bad("You must provide a file.", "file")
    model_at = reader.values.get(b"model")
    if model_at is None or not (model := _text(raw, model_at, "model")):
        raise _bad("You must provide a model parameter.", "model")
    stream = _text(raw, reader.values[b"stream"], "stream") if b"stream" in reader.values \
        else "false"
    if stream not in ("true", "false"):
        raise _bad("Invalid value for 'stream': expected 'true' or 'false'.", "stream",
                   "invalid_type")
    return Form(model, stream == "true", model_at,
                b'multipart/form-data; boundary="' + boundary + b'"')


def _bounded(raw: bytes, boundary: bytes) -> None:
    """Refuses, at C speed, what would make the parser step byte by byte."""
    opener = b"--" + boundary
    delimiter = b"\r\n" + opener
    first = raw.find(opener)
    if first < 0 or raw[:first].strip(b"\r\n"):  # only line breaks may come first
        raise _bad("The form does not open with its boundary.")
    headers = 0
    at = first + len(opener)  # just past a boundary
    # Each boundary up to the closing one is visited, in order, so this
    # bounds them all (after it, the parser reads nothing).
    for _ in range(_PARTS_MAX + 1):
        following = raw[at:at + 2]
        if following == b"--":
            return  # the closing boundary: the rest is ignored, by the engine too
        if following != b"\r\n":
            raise _bad("The form's boundary appears inside a part, or padded.")
        ends = raw.find(b"\r\n\r\n", at, at + _HEADERS_MAX - headers + 4)
        if ends < 0:
            raise _bad(f"The form's parts have more than {_HEADERS_MAX} bytes of headers, "
                       "or one has no end to them.")
        headers += ends - at
        after = raw.find(delimiter, ends + 4)
        if after < 0:
            raise _bad("The form is not closed by its boundary.")
        at = after + len(delimiter)
    raise _bad(f"The form has more than {_PARTS_MAX} parts.")


class _Reader:
    """Starlette's MultiPartParser's reading (its callbacks, one for one),
    keeping only where the model and stream values lie and whether the
    last `file` part is a file."""

    def __init__(self, raw: bytes) -> None:
        self.raw = raw
        self.parts = 0
        self.values: dict[bytes, tuple[int, int]] = {}
        self.file_sent = False
        self.ended = False
        self._field = b""  # the header being read: its name, its value
        self._value = b""
        self._disposition: bytes | None = None
        self._dispositions = 0
        self._name = b""
        self._upload = False
        self._at: tuple[int, int] | None = None

    def callbacks(self) -> MultipartCallbacks:
        return {"on_part_begin": self.part_begin, "on_part_data": self.part_data,
                "on_part_end": self.part_end, "on_header_field": self.header_field,
                "on_header_value": self.header_value, "on_header_end": self.header_end,
                "on_headers_finished": self.headers_finished, "on_end": self.end}

    def part_begin(self) -> None:
        self.parts += 1
        if self.parts > _PARTS_MAX:
            raise _bad(f"The form has more than {_PARTS_MAX} parts.")
        self._disposition, self._dispositions = None, 0
        self._name, self._upload, self._at = b"", False, None

    def header_field(self, data: bytes, start: int, end: int) -> None:
        self._field += data[start:end]

    def header_value(self, data: bytes, start: int, end: int) -> None:
        self._value += data[start:end]

    def header_end(self) -> None:
        if self._field.lower() == b"content-disposition":
            self._disposition = self._value  # Starlette keeps the last
            self._dispositions += 1
        self._field = self._value = b""

    def headers_finished(self) -> None:
        if self._dispositions > 1:
            raise _bad("A part of the form has more than one Content-Disposition header.")
        disposition = self._disposition or b""
        if b"*" in disposition and b"*" in _QUOTED.sub(b"", disposition):
            raise _bad("A part of the form has an extended (RFC 2231) parameter in its "
                       "Content-Disposition header.")
        _, options = parse_options_header(disposition)
        if b"name" not in options:
            raise _bad('The Content-Disposition header field "name" must be provided.')
        self._name, self._upload = options[b"name"], b"filename" in options
        if self._name in _READ:
            name = self._name.decode()
            if self._upload:
                raise _bad(f"The '{name}' field must be text, not a file.", name)
            if self._name in self.values:
                raise _bad(f"The form has more than one '{name}' field.", name)

    def part_data(self, data: bytes, start: int, end: int) -> None:
        if self._name not in _READ:
            return
        # One write of the whole body: a value comes as one span of it.
        if data is not self.raw or self._at is not None:
            raise _bad("The form's fields could not be located in its body.")
        self._at = (start, end)

    def part_end(self) -> None:
        if self._name in _READ:
            # An empty value has no data called back: (0, 0) reads as empty.
            self.values[self._name] = self._at or (0, 0)
        if self._name == b"file":
            self.file_sent = self._upload  # the engine reads the last `file`

    def end(self) -> None:
        self.ended = True


def _text(raw: bytes, at: tuple[int, int], name: str) -> str:
    start, end = at
    if end - start > _FIELD_MAX:
        raise _bad(f"The '{name}' field is longer than {_FIELD_MAX} bytes.", name)
    try:
        return raw[start:end].decode()
    except UnicodeDecodeError:
        raise _bad(f"The '{name}' field is not UTF-8.", name) from None
