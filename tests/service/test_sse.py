"""The one SSE framing: events cut the same wherever the stream is split, for every line-end style."""

from __future__ import annotations

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from handoff.protocol.sse import EventSplitter, EventTooLarge, WholeEvents, event_data, split_after_last_event

LINE_ENDS = st.sampled_from([b"\n", b"\r\n", b"\r"])
LINES = st.one_of(st.builds(lambda t: b"data: " + t, st.binary(max_size=12).map(
    lambda b: b.replace(b"\r", b"").replace(b"\n", b""))), st.just(b": comment"), st.just(b"data: [DONE]"))


@st.composite
def streams(draw: st.DrawFn) -> tuple[bytes, list[list[bytes]]]:
    """A stream and, per event, its lines (the reference cut)."""
    events = draw(st.lists(st.lists(LINES, min_size=1, max_size=3), max_size=5))
    out = b""
    for lines in events:
        for line in lines:
            out += line + draw(LINE_ENDS)
        blank = draw(LINE_ENDS)
        if out.endswith(b"\r") and blank == b"\n":  # CR then LF is one CRLF, not a blank line
            blank = b"\r"
        out += blank
    return out, events


def split(stream: bytes, cuts: list[int]) -> tuple[list[bytes], bytes]:
    splitter = EventSplitter()
    out: list[bytes] = []
    previous = 0
    for cut in sorted(set(cuts)) + [len(stream)]:
        out += splitter.feed(stream[previous:cut])
        previous = cut
    return out, splitter.finish()


@settings(max_examples=500, deadline=None)
@given(streams(), st.lists(st.integers(min_value=0, max_value=200), max_size=10))
def test_events_are_the_same_wherever_the_stream_is_cut(case: tuple[bytes, list[list[bytes]]],
                                                        cuts: list[int]) -> None:
    stream, expected = case
    events, rest = split(stream, [c for c in cuts if c <= len(stream)])
    whole, whole_rest = split(stream, [])
    assert b"".join(events) + rest == stream  # no byte lost or added
    assert [event_data(e) for e in events] == [event_data(e) for e in whole]
    data = [b"\n".join(line[6:] for line in lines if line.startswith(b"data: "))
            if any(line.startswith(b"data: ") for line in lines) else None for lines in expected]
    assert [event_data(e) for e in events] == data
    assert rest.strip(b"\r\n") == b""


def test_an_event_ending_in_cr_cr_is_out_before_the_next_byte() -> None:
    splitter = EventSplitter()
    assert splitter.feed(b"data: a\r\r") == [b"data: a\r\r"]
    assert splitter.feed(b"\ndata: b\r\n\r\n") == [b"\ndata: b\r\n\r\n"]  # that LF finished the CRLF
    assert event_data(b"\ndata: b\r\n\r\n") == b"b"


def test_the_lf_finishing_a_cut_crlf_is_taken_once() -> None:
    splitter = EventSplitter()
    assert splitter.feed(b"data: a\r\n\r") == [b"data: a\r\n\r"]
    assert splitter.feed(b"\n") == []           # the second half of that CRLF
    assert splitter.feed(b"\n") == []           # a blank line of its own, no event
    assert splitter.feed(b"data: b\n\n") == [b"\n\ndata: b\n\n"]


def test_an_event_past_the_bound_raises_after_the_events_before_it() -> None:
    splitter = EventSplitter(max_event_bytes=64)
    assert splitter.feed(b"data: a\n\n" + b"data: " + b"x" * 100) == [b"data: a\n\n"]  # completed, handed out
    with pytest.raises(EventTooLarge):
        splitter.feed(b"x")  # the rest is past the bound: the next read fails
    late = EventSplitter(max_event_bytes=64)
    late.feed(b"data: a\n\n" + b"data: " + b"x" * 100)
    with pytest.raises(EventTooLarge):
        late.finish()  # ...and so does the end of the stream


def test_an_event_growing_past_the_bound_in_small_reads_raises() -> None:
    splitter = EventSplitter(max_event_bytes=1000)
    with pytest.raises(EventTooLarge):
        for _ in range(200):  # bounded: 1200 bytes must have raised
            assert splitter.feed(b"data: " + b"y" * 10) == []  # one line, never ended
    assert EventSplitter(max_event_bytes=1000).feed(b"data: " + b"y" * 990 + b"\n\n") != []  # at the bound: fine


@settings(max_examples=300, deadline=None)
@given(stream=streams(), cut=st.integers(min_value=0, max_value=400))
def test_a_relay_passes_on_whole_events_only(stream: tuple[bytes, list[list[bytes]]], cut: int) -> None:
    """What a relay sends at any point is whole events (the splitter finds no event left open in it), and
    what it holds back never holds the end of an event it could have sent, wherever the stream is cut."""
    data, events = stream
    sent, held = split_after_last_event(data[:cut])
    assert sent + held == data[:cut]
    splitter = EventSplitter()
    num_sent = len(splitter.feed(sent))
    assert splitter.finish() == b"" or sent.endswith(b"\r")  # a CR may end a CRLF blank line's first half
    assert len(EventSplitter().feed(held)) == 0 or held.startswith(b"\n")
    assert num_sent <= len(events)


@settings(max_examples=300, deadline=None)
@given(stream=streams(), cuts=st.lists(st.integers(min_value=0, max_value=400), max_size=12))
@example(stream=(b"data: [DONE]\ndata: [DONE]\r\n\r\n: comment\n", []), cuts=[28, 29])  # a read ending on a CR
def test_a_held_event_is_cut_as_the_whole_stream_would_be(stream: tuple[bytes, list[list[bytes]]],
                                                          cuts: list[int]) -> None:
    """:class:`WholeEvents` searches only the bytes new since the last read: what it hands out after each read
    is what cutting everything received so far would send, wherever the reads end; but for a read that ended
    on a CR, which may be half of a CRLF: its LF then travels with the next event (``split_after_last_event``'s
    rule), where the cut of everything received counts it in the event before."""
    data, _ = stream
    hold = WholeEvents()
    sent = b""
    previous = 0
    for cut in sorted(set(cuts)) + [len(data)]:
        sent += hold.feed(data[previous:cut])
        previous = max(previous, cut)
        whole = split_after_last_event(data[:previous])[0]
        assert sent == whole or (sent.endswith(b"\r") and whole == sent + b"\n"), (sent[-8:], whole[-8:])
    assert sent + hold.finish() == data


def test_a_held_event_is_bounded() -> None:
    hold = WholeEvents(max_event_bytes=1000)
    assert hold.feed(b"data: a\n\ndata: ") == b"data: a\n\n"
    with pytest.raises(EventTooLarge):
        for _ in range(200):  # 1200 bytes must have raised
            assert hold.feed(b"y" * 10) == b""
