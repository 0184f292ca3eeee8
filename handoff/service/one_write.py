"""uvicorn's HTTP/1.1 protocol writing a response's head and the start of its body in one system call.

uvicorn writes a response's head when the app sends ``http.response.start``
and its body when the app sends ``http.response.body``: two ``send`` system
calls and two packets for every buffered answer (the LB's and the sidecar's
non-stream generation relays, every JSON answer). Here the head is held until
the first body write of the same event-loop turn and both go out together; a
head with no body write in that turn (a stream whose first chunk is not in
yet) goes out by itself at the end of the turn, so no client waits longer for
it. Writes after the first pass straight through.
"""

from __future__ import annotations

import asyncio
from typing import Any

from handoff.service.head_timeout import HeadTimeoutProtocol

__all__ = ["OneWriteProtocol"]


class _HeadWithBody:
    """The transport of one request's response cycle: holds its first write until the second or the end of
    the loop turn, whichever comes first; anything else goes to the real transport."""

    __slots__ = ("_transport", "_loop", "_held", "_has_held")

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self._transport = transport
        self._loop = loop
        self._held: bytes | None = None
        self._has_held = False

    def write(self, data: bytes) -> None:
        if self._held is not None:
            held, self._held = self._held, None
            self._transport.write(held + data)
        elif not self._has_held:
            self._has_held = True
            self._held = data
            self._loop.call_soon(self._flush)
        else:
            self._transport.write(data)

    def _flush(self) -> None:
        held, self._held = self._held, None
        if held is not None and not self._transport.is_closing():  # a client gone meanwhile gets nothing
            self._transport.write(held)

    def close(self) -> None:
        self._flush()
        self._transport.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


class OneWriteProtocol(HeadTimeoutProtocol):
    """:class:`HeadTimeoutProtocol` whose response cycles write a head and the first body bytes together."""

    def on_headers_complete(self) -> None:
        super().on_headers_complete()
        cycle = self.cycle
        if cycle is not None and cycle.transport is self.transport:
            cycle.transport = _HeadWithBody(self.transport, self.loop)  # type: ignore[assignment]
