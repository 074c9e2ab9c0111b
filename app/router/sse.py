"""Server-sent events, as engines and OpenAI frame their streams: the one
parser of the router (docs/design/routing.md).

An event ends at a blank line, written `\\n\\n`, `\\r\\n\\r\\n` or `\\r\\r`; its
data is the text after `data:` on each of its data lines. The relay cuts a
stream into whole events (`whole_events`) before anything reads it, so that
every reader below sees events whole: the meter (usage), the renamer (an
answer's model), the splice (a continued stream) and the Responses API's id
binding.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

# The three ways an event may end, as the SSE specification writes them.
EVENT_ENDS = (b"\n\n", b"\r\n\r\n", b"\r\r")
_EVENT_SPLIT = re.compile(rb"(\r\n\r\n|\n\n|\r\r)")

DONE = b"[DONE]"


def ends_whole(chunk: bytes) -> bool:
    """Whether `chunk` ends at the end of an event: a stream's every chunk
    asks, so each ending is its own `endswith` of one suffix (compiled, a
    primitive), the usual `\n\n` first, where a tuple of them is a call
    of the interpreter's (docs/design/hot-path.md, "A stream's chunks")."""
    return chunk.endswith(b"\n\n") or chunk.endswith(b"\r\n\r\n") or chunk.endswith(b"\r\r")


def whole_events(data: bytes) -> tuple[bytes, bytes]:
    """`data` cut after its last complete event: (whole events, the rest)."""
    cut = 0
    for end in EVENT_ENDS:
        # rfind, not `in`: on bytes, `in` first tries its operand as an
        # integer, and makes and drops a TypeError each time.
        at = data.rfind(end)
        if at >= 0:
            cut = max(cut, at + len(end))
    return data[:cut], data[cut:]


def events(chunk: bytes) -> Iterator[tuple[bytes, bytes]]:
    """Each event of `chunk` with the blank line that ended it (b"" for the
    last, unended part): joining the pairs gives `chunk` back."""
    parts = _EVENT_SPLIT.split(chunk)
    yield from zip(parts[0::2], [*parts[1::2], b""], strict=True)


def data_of(event: bytes) -> bytes:
    """The data of one event: its data lines' text, joined (b"": none, a
    comment or a bare field)."""
    return b"".join(line[5:].lstrip() for line in event.splitlines()
                    if line.startswith(b"data:"))


def datas(chunk: bytes) -> Iterator[bytes]:
    """The data of each event of `chunk` that has some."""
    for event, _ in events(chunk):
        data = data_of(event)
        if data:
            yield data


def event(data: bytes) -> bytes:
    """One event carrying `data`."""
    return b"data: " + data + b"\n\n"
