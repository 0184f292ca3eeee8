"""Server-sent-event framing, written once for every process and the client.

An SSE stream is lines ending in CRLF, LF or CR (all three, mixed); an empty
line ends an event; ``data:`` lines carry its payload (several are joined with
LF; one space after the colon is dropped); lines starting with ``:`` are
comments. handoff's events are one ``data:`` line of JSON, and ``data: [DONE]``
ends a complete answer.

:class:`EventSplitter` cuts a byte stream, fed as it arrives, into whole
events without altering their bytes, so a relay can pass them on as they were
or rewrite only the ones it must.
"""

from __future__ import annotations

import re

DONE = b"[DONE]"

_LINE_END = re.compile(rb"\r\n|\r|\n")


class EventSplitter:
    """Whole events out of an SSE byte stream fed in arbitrary pieces.

    An event is handed out as soon as its blank line is in, whatever follows:
    a CR that ends one read may be half of a CRLF, so an LF starting the next
    read is taken as its second half (it travels with the next event's bytes,
    so no byte is lost or added).
    """

    def __init__(self) -> None:
        self._buffer = b""
        self._scan_from = 0      # where the next line starts in the buffer
        self._after_cr = False   # the last read ended with a CR line end
        self._has_line = False   # the event being read has a non-blank line (blank lines before one are kept, not events)

    def feed(self, chunk: bytes) -> list[bytes]:
        """The events ``chunk`` completes, each with the line ends that closed it."""
        buffer = self._buffer + chunk
        events: list[bytes] = []
        event_start = 0
        line_start = self._scan_from
        has_line = self._has_line
        is_after_cr = self._after_cr and line_start == len(buffer)  # an empty read leaves the CR pending
        if self._after_cr and buffer[line_start:line_start + 1] == b"\n":
            line_start += 1  # the second half of a CRLF cut between two reads; the CR is no longer pending
        for match in _LINE_END.finditer(buffer, line_start):
            if match.start() > line_start:
                has_line = True
            elif has_line:  # an empty line ends the event
                events.append(buffer[event_start:match.end()])
                event_start = match.end()
                has_line = False
            line_start = match.end()
            is_after_cr = match.group() == b"\r" and line_start == len(buffer)
        self._after_cr = is_after_cr
        self._has_line = has_line
        self._buffer = buffer[event_start:]
        self._scan_from = line_start - event_start
        return events

    def finish(self) -> bytes:
        """The stream ended: what is left, an event cut short (or blank lines), else ``b""``."""
        rest, self._buffer, self._scan_from, self._after_cr, self._has_line = self._buffer, b"", 0, False, False
        return rest


def event_data(event: bytes) -> bytes | None:
    """The ``data`` payload of one event (its ``data:`` lines joined by LF), or None if it has none."""
    parts = [line[5:].removeprefix(b" ") for line in _LINE_END.split(event) if line.startswith(b"data:")]
    return b"\n".join(parts) if parts else None


def data_event(payload: bytes) -> bytes:
    """One event carrying ``payload`` (which must hold no line end)."""
    return b"data: " + payload + b"\n\n"
