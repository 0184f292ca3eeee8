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
    """Whole events out of an SSE byte stream fed in arbitrary pieces."""

    def __init__(self) -> None:
        self._buffer = b""
        self._scan_from = 0   # where the next line starts in the buffer

    def feed(self, chunk: bytes) -> list[bytes]:
        """The events ``chunk`` completes, each with the line ends that closed it."""
        return self._split(self._buffer + chunk, is_end=False)

    def finish(self) -> tuple[list[bytes], bytes]:
        """The stream ended: the events still completed (a last CR), and what is left: an event cut short
        (or blank lines), else ``b""``."""
        events = self._split(self._buffer, is_end=True)
        rest, self._buffer, self._scan_from = self._buffer, b"", 0
        return events, rest

    def _split(self, buffer: bytes, *, is_end: bool) -> list[bytes]:
        events: list[bytes] = []
        event_start = 0
        line_start = self._scan_from
        for match in _LINE_END.finditer(buffer, line_start):
            if match.group() == b"\r" and match.end() == len(buffer) and not is_end:
                break  # maybe the first half of a CRLF: decide when the next piece comes
            if match.start() == line_start and line_start > event_start:  # an empty line ends the event
                events.append(buffer[event_start:match.end()])
                event_start = match.end()
            elif match.start() == line_start:  # empty lines between events: kept with the next one
                pass
            line_start = match.end()
        self._buffer = buffer[event_start:]
        self._scan_from = line_start - event_start
        return events


def event_data(event: bytes) -> bytes | None:
    """The ``data`` payload of one event (its ``data:`` lines joined by LF), or None if it has none."""
    parts = [line[5:].removeprefix(b" ") for line in _LINE_END.split(event) if line.startswith(b"data:")]
    return b"\n".join(parts) if parts else None


def data_event(payload: bytes) -> bytes:
    """One event carrying ``payload`` (which must hold no line end)."""
    return b"data: " + payload + b"\n\n"
