"""The router's SSE reading (app/router/sse.py): where an event ends."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from app.router import sse


@given(st.lists(st.sampled_from([b"data: x", b"\n", b"\r", b"\r\n", b":", b" "]), max_size=12))
def test_a_chunk_ends_whole_exactly_when_it_ends_in_one_of_the_three_endings(
        parts: list[bytes]) -> None:
    chunk = b"".join(parts)
    assert sse.ends_whole(chunk) == chunk.endswith(sse.EVENT_ENDS)
    # And the cut agrees: a chunk that ends whole leaves no rest.
    if sse.ends_whole(chunk):
        assert sse.whole_events(chunk) == (chunk, b"")


def test_each_ending_and_a_partial_event() -> None:
    for end in sse.EVENT_ENDS:
        assert sse.ends_whole(b"data: {}" + end)
    assert not sse.ends_whole(b"data: {}\n")
    assert not sse.ends_whole(b"data: {}\r\n\r")
    assert not sse.ends_whole(b"")
