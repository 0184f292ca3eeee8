"""One log line for each control or weight call the sidecar answers with an error.

The caller gets the error; without this the node's own log said nothing of a release that timed out draining, a
resume the engine refused or a reload that failed, and an operator reading it after a failed RL step found no trace.
A wrong token (401), a wrong method (405) and a client that left are left out: a stranger could write one line per
request. The lines are rate limited, as any line a caller can make the process write once per request.
"""

from __future__ import annotations

import json
import logging
import time

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from handoff.service.disconnect import CLIENT_CLOSED
from handoff.service.logs import rate_limit

MAX_KEPT_BYTES = 4096  # of an error answer's body: its envelope; a longer message is cut
MAX_SHOWN_CHARS = 1000
_LEFT_OUT = frozenset({401, 405, CLIENT_CLOSED})

log = logging.getLogger(__name__)
rate_limit(log)


def error_of(body: bytes) -> tuple[str, str]:
    """``(type, message)`` of an error envelope (cut to :data:`MAX_SHOWN_CHARS`); what cannot be read is ``?``."""
    try:
        error = json.loads(body)["error"]
        kind, message = error["type"], error["message"]
    except (ValueError, KeyError, TypeError):
        return "?", body[:MAX_SHOWN_CHARS].decode("utf-8", "replace")
    if not isinstance(kind, str) or not isinstance(message, str):
        return "?", "?"
    return kind[:MAX_SHOWN_CHARS], message[:MAX_SHOWN_CHARS]


class ControlFailureLog:
    """ASGI middleware: a request to one of ``paths`` answered 400 or above (401, 405 and a client gone aside) writes
    one WARNING naming the path, the status, the error's type and message, and how long the call took."""

    def __init__(self, app: ASGIApp, paths: frozenset[str]) -> None:
        self.app = app
        self._paths = paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] not in self._paths:
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        status = 0
        kept = bytearray()

        async def send_noting_error(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            elif message["type"] == "http.response.body" and status >= 400 and len(kept) < MAX_KEPT_BYTES:
                kept.extend(message.get("body", b"")[:MAX_KEPT_BYTES - len(kept)])
            await send(message)

        await self.app(scope, receive, send_noting_error)
        if status >= 400 and status not in _LEFT_OUT:
            kind, text = error_of(bytes(kept))
            log.warning("%s %s failed after %.3f s: %d %s: %s", scope["method"], scope["path"],
                        time.perf_counter() - started, status, kind, text,
                        extra={"path": scope["path"], "status": status, "error_type": kind})  # JSON logs' fields
