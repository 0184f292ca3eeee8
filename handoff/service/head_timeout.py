"""uvicorn's HTTP/1.1 protocol with a deadline on every request head.

uvicorn bounds the time between two requests of a kept-alive connection and
nothing else: a connection that never sends a byte, or sends its head one
byte a minute, stays open for good (thirty such connections were held
indefinitely). Here the head (request line and headers) must be complete
within ``head_timeout_s`` of the connection's opening or of the request's
first byte; if not, the client gets a 408 and the connection is closed. The
body has its own deadline (:mod:`handoff.service.limits`).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from handoff.service.errors import RequestTimeout

DEFAULT_HEAD_TIMEOUT_S = 30.0


class HeadTimeoutProtocol(HttpToolsProtocol):
    head_timeout_s: float = DEFAULT_HEAD_TIMEOUT_S

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._head_timer: asyncio.TimerHandle | None = None

    @classmethod
    def with_timeout(cls, head_timeout_s: float) -> type[HeadTimeoutProtocol]:
        """This protocol with its own deadline, as uvicorn's ``http=`` wants a class."""
        return type(cls.__name__, (cls,), {"head_timeout_s": head_timeout_s})

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_head_timer()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        if self._head_timer is None:  # a kept-alive connection's next request: its head starts now
            self._arm_head_timer()

    def on_headers_complete(self) -> None:
        self._disarm_head_timer()
        super().on_headers_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_head_timer()
        super().connection_lost(exc)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._disarm_head_timer()  # the keep-alive timer watches the idle time until the next request

    def _arm_head_timer(self) -> None:
        self._disarm_head_timer()
        self._head_timer = self.loop.call_later(self.head_timeout_s, self._head_timed_out)

    def _disarm_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self.transport.is_closing() or (self.cycle is not None and not self.cycle.response_complete):
            return
        error = RequestTimeout(f"the request head did not arrive within {self.head_timeout_s:g} s")
        body = json.dumps(error.envelope()).encode()
        self.transport.write(b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
                             b"content-length: %d\r\nconnection: close\r\n\r\n%s" % (len(body), body))
        self.transport.close()
