"""Server-sent-event framing, written once for every process and the client.

An SSE stream is lines ending in CRLF, LF or CR (all three, mixed); an empty
line ends an event; ``data:`` lines carry its payload (several are joined with
LF; one space after the colon is dropped); lines starting with ``:`` are
comments. handoff's events are one ``data:`` line of JSON, and ``data: [DONE]``
ends a complete answer.

:class:`EventSplitter` cuts a byte stream, fed as it arrives, into whole
events without altering their bytes, so a relay can pass them on as they were
or rewrite only the ones it must; :class:`WholeEvents` holds back the start of an
event still coming, for a relay that passes bytes on as they arrive.
"""

from __future__ import annotations

import re

DONE = b"[DONE]"
# an SGLang stream repeats the whole answer in every event: with logprobs of a long prompt, megabytes each
DEFAULT_MAX_EVENT_BYTES = 64 * 1024 * 1024

_LINE_END = re.compile(rb"\r\n|\r|\n")


EVENT_ENDS = (b"\n\n", b"\r\n\r\n", b"\r\r", b"\n\r")  # two line ends in a row (CR, LF, CRLF mixed)
_LONGEST_EVENT_END = 4


def split_after_last_event(data: bytes) -> tuple[bytes, bytes]:
    """``data`` cut after the last blank line: (the whole events, the start of one still coming).

    For a relay that passes bytes on as they are but never a part of an event, so that an error event it adds
    stands alone. (A CR ending ``data`` may be half of a CRLF: its LF then travels with the next event.)
    """
    if data.endswith(EVENT_ENDS):
        return data, b""
    end = _last_event_end(data, 0)
    return data[:end], data[end:]


def _last_event_end(data: bytes | bytearray, start: int) -> int:
    """Where the last blank line of ``data[start:]`` ends; 0 when there is none."""
    end = 0
    for separator in EVENT_ENDS:
        at = data.rfind(separator, start)
        if at >= 0:
            end = max(end, at + len(separator))
    return end


class WholeEvents:
    """A relay's hold on an event still coming: fed a stream's bytes as they arrive, :meth:`feed` hands out
    those up to the last blank line (as :func:`split_after_last_event`) and keeps the rest, at most
    ``max_event_bytes`` (past that :class:`EventTooLarge`).

    The bytes held are appended to, never copied again, and only the new bytes are searched (the held ones
    hold no blank line): an event arriving in many small reads costs time linear in its size, where cutting
    ``held + new`` again at each read cost time quadratic in it.
    """

    def __init__(self, max_event_bytes: int = DEFAULT_MAX_EVENT_BYTES) -> None:
        self._max_event_bytes = max_event_bytes
        self._held = bytearray()

    @property
    def is_holding(self) -> bool:
        return bool(self._held)

    def feed(self, data: bytes) -> bytes:
        """The whole events ``data`` completes, with what was held of the first of them."""
        held = self._held
        if not held:
            whole, rest = split_after_last_event(data)
            held += rest
        else:
            num_old = len(held)
            held += data
            # a blank line may begin in the last bytes held (a CRLF CRLF cut between two reads)
            end = _last_event_end(held, max(0, num_old - _LONGEST_EVENT_END + 1))
            whole = bytes(held[:end])
            del held[:end]
        if len(held) > self._max_event_bytes:
            raise EventTooLarge(f"an event grew past {self._max_event_bytes} bytes without ending")
        return whole

    def finish(self) -> bytes:
        """What is held when the stream ends (an event cut short), else ``b""``."""
        rest = bytes(self._held)
        self._held.clear()
        return rest


class EventTooLarge(ValueError):
    """A peer's event grew past the splitter's bound without ending (no blank line)."""


class EventSplitter:
    """Whole events out of an SSE byte stream fed in arbitrary pieces.

    An event is handed out as soon as its blank line is in, whatever follows:
    a CR that ends one read may be half of a CRLF, so an LF starting the next
    read is taken as its second half (it travels with the next event's bytes,
    so no byte is lost or added).

    The event being read is bounded: past ``max_event_bytes`` without its blank
    line, :meth:`feed` raises :class:`EventTooLarge` (after handing out the
    events the same read completed: then the next :meth:`feed` or
    :meth:`finish` raises). Bytes are appended, never copied whole again, so a
    large event costs time linear in its size.
    """

    def __init__(self, max_event_bytes: int = DEFAULT_MAX_EVENT_BYTES) -> None:
        self._max_event_bytes = max_event_bytes
        self._buffer = bytearray()
        self._scan_from = 0      # where the next line starts in the buffer
        self._after_cr = False   # the last read ended with a CR line end
        self._has_line = False   # the event being read has a non-blank line (blank lines before one are kept, not events)

    def feed(self, chunk: bytes) -> list[bytes]:
        """The events ``chunk`` completes, each with the line ends that closed it."""
        self._check_bound()
        scan_start = len(self._buffer)  # a line without its end yet is not searched again
        if self._buffer:
            self._buffer += chunk
            buffer: bytes | bytearray = self._buffer
        else:  # the usual case, a read of whole events: nothing is copied but the events
            buffer = chunk
        events: list[bytes] = []
        event_start = 0
        line_start = self._scan_from
        has_line = self._has_line
        is_after_cr = self._after_cr and line_start == len(buffer)  # an empty read leaves the CR pending
        if self._after_cr and buffer[line_start:line_start + 1] == b"\n":
            line_start += 1  # the second half of a CRLF cut between two reads; the CR is no longer pending
        for match in _LINE_END.finditer(buffer, line_start if line_start > scan_start else scan_start):
            if match.start() > line_start:
                has_line = True
            elif has_line:  # an empty line ends the event
                events.append(buffer[event_start:match.end()])
                event_start = match.end()
                has_line = False
            line_start = match.end()
            is_after_cr = match.group() == b"\r" and line_start == len(buffer)
        match = None  # a match keeps the buffer exported: it could not be resized below
        self._after_cr = is_after_cr
        self._has_line = has_line
        if buffer is self._buffer:
            del self._buffer[:event_start]
            events = [bytes(event) for event in events]
        elif event_start < len(buffer):
            self._buffer = bytearray(buffer[event_start:])
        self._scan_from = line_start - event_start
        if not events:
            self._check_bound()
        return events

    def finish(self) -> bytes:
        """The stream ended: what is left, an event cut short (or blank lines), else ``b""``."""
        self._check_bound()
        rest, self._buffer, self._scan_from, self._after_cr, self._has_line = self._buffer, bytearray(), 0, False, False
        return bytes(rest)

    def _check_bound(self) -> None:
        if len(self._buffer) > self._max_event_bytes:
            raise EventTooLarge(f"an event longer than {self._max_event_bytes} bytes, still without its end")


def event_data(event: bytes) -> bytes | None:
    """The ``data`` payload of one event (its ``data:`` lines joined by LF), or None if it has none."""
    parts = [line[5:].removeprefix(b" ") for line in _LINE_END.split(event) if line.startswith(b"data:")]
    return b"\n".join(parts) if parts else None


def data_event(payload: bytes) -> bytes:
    """One event carrying ``payload`` (which must hold no line end)."""
    return b"data: " + payload + b"\n\n"
