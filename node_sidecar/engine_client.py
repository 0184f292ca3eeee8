"""The sidecar's calls to its engine, over the process's one pooled client.

Transport failures become :class:`EngineUnavailable` (503) raised ``from`` the
transport error and reported to ``on_unreachable``; an error the engine
answers becomes :class:`EngineRefused` with the engine's own status and
envelope. One exception: a generation (a call that changes no state) that the
engine took and did not finish within its timeout is a 504 ``upstream_timeout``
(:func:`generation_overdue`), and the engine is not reported: it is slow, not
gone, and the request may have run, so it must not look like one that reached
no model (which the LB sends to another node). A JSON call that got no answer says which call it was and what
became of it: the engine died during it, did not answer in time, or was not
reached at all.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any, Callable
from urllib.parse import urlsplit

from handoff.protocol import errors as E
from handoff.service.errors import ServiceError
from handoff.service.peer_json import PeerJSONError, loads_bounded
from handoff.service.upstream import (ConnectFailed, ConnectionDropped, ResponseTooLarge, TimedOutConnecting,
                                     UpstreamClient, UpstreamError, UpstreamResponse, UpstreamTimeout)
from node_sidecar.errors import EngineRefused, EngineUnavailable

_JSON = {"Content-Type": "application/json"}
MAX_CONTROL_ANSWER_BYTES = 4 * 1024 * 1024


class EngineClient:
    def __init__(self, base_url: str, client: UpstreamClient, *, control_timeout: float,
                 on_unreachable: Callable[[UpstreamError], None]) -> None:
        self.base_url = base_url
        self.client = client
        self.control_timeout = control_timeout
        self._on_unreachable = on_unreachable

    async def open(self, method: str, path: str, *, body: bytes = b"", headers: dict[str, str] | None = None,
                   timeout: float, is_generation: bool = False) -> UpstreamResponse:
        """Send a request; the caller reads (or relays) the response. ``is_generation``: see the module docstring."""
        try:
            return await self.client.request(method, self.base_url + path, headers=headers, body=body,
                                             timeout=timeout)
        except UpstreamTimeout as exc:
            if is_generation and not isinstance(exc, TimedOutConnecting):  # taken, not answered (not: never sent)
                raise generation_overdue(exc, timeout) from exc
            self._on_unreachable(exc)
            raise EngineUnavailable(f"engine unreachable: {exc}", retry_after=1) from exc
        except UpstreamError as exc:
            self._on_unreachable(exc)
            raise EngineUnavailable(f"engine unreachable: {exc}", retry_after=1) from exc

    async def peek(self, path: str, *, timeout: float, max_bytes: int) -> tuple[int, bytes]:
        """``GET path``: its status and at most ``max_bytes`` of its body, for health probes and metrics
        scrapes. A transport failure is raised as the :class:`UpstreamError` it is and reported to no one: a
        late answer from a busy engine is not a dead engine, and the caller judges which it is."""
        response = await self.client.request("GET", self.base_url + path, timeout=timeout)
        async with response:
            return response.status, await response.read(max_bytes)

    async def scrape(self, path: str, *, timeout: float, max_bytes: int) -> bytes | None:
        """``GET path`` for a Prometheus text exposition: the whole body of a 200 ``text/plain`` answer, None for
        any other status (the engine serves none), :class:`ValueError` saying what came instead of one (an
        answer over ``max_bytes`` is one, never a cut body). A transport failure is raised as the
        :class:`UpstreamError` it is and reported to no one."""
        response = await self.client.request("GET", self.base_url + path, timeout=timeout)
        async with response:
            if response.status != 200:
                return None
            if not response.content_type.startswith("text/plain"):
                raise ValueError(f"answered Content-Type {response.content_type[:100]!r}, not text/plain")
            try:
                return await response.read_whole(max_bytes)
            except ResponseTooLarge:
                raise ValueError(f"answered more than {max_bytes} bytes") from None

    async def read(self, response: UpstreamResponse, max_bytes: int, *, is_generation: bool = False,
                   timeout: float = 0.0, count: Callable[[int], None] | None = None) -> bytes:
        """The whole body of an engine answer (the connection is released either way).

        An answer longer than ``max_bytes`` is a 502 ``upstream_error`` (never a cut body; the engine is
        alive, so it is not reported unreachable). A failure mid-answer is reported to ``on_unreachable``
        and raised as :class:`EngineUnavailable`, but a generation's answer not finished in its ``timeout``
        (the exchange's deadline) is :func:`generation_overdue`. ``count``: told each piece's size as it
        arrives (what it raises ends the read, the connection closed).
        """
        try:
            return await response.read_whole(max_bytes, count=count)
        except ResponseTooLarge as exc:
            raise ServiceError(f"the engine's answer to {response.url} is longer than {max_bytes} bytes "
                               "(--max-answer-bytes)", kind=E.UPSTREAM_ERROR, extra={"max_bytes": max_bytes}) from exc
        except UpstreamTimeout as exc:
            if is_generation:
                raise generation_overdue(exc, timeout) from exc
            self._on_unreachable(exc)
            raise EngineUnavailable(f"the engine failed while answering: {exc}", retry_after=1) from exc
        except UpstreamError as exc:
            self._on_unreachable(exc)
            raise EngineUnavailable(f"the engine failed while answering: {exc}", retry_after=1) from exc
        finally:
            response.close()

    async def exchange(self, method: str, path: str, body: dict[str, Any] | bytes | None = None, *,
                       timeout: float | None = None, is_generation: bool = False) -> tuple[UpstreamResponse, bytes]:
        """One call whatever the answer's status or type: the response (closed) and its body, at most
        :data:`MAX_CONTROL_ANSWER_BYTES`. Raises EngineUnavailable (saying what became of the call) only when
        no answer came. ``timeout`` None is ``--control-timeout``; 0 or less (a caller's deadline spent, as a
        flush's behind a long control call) is :func:`deadline_spent`, nothing sent."""
        payload = body if isinstance(body, bytes) else b"" if body is None else json.dumps(body).encode()
        if timeout is None:
            timeout = self.control_timeout
        elif timeout <= 0:
            raise deadline_spent(f"{method} {path}")
        try:
            response = await self.open(method, path, body=payload, headers=_JSON if body is not None else None,
                                       timeout=timeout, is_generation=is_generation)
            return response, await self.read(response, MAX_CONTROL_ANSWER_BYTES, is_generation=is_generation,
                                             timeout=timeout)
        except EngineUnavailable as exc:
            raise await self._unanswered(f"{method} {path}", exc, timeout) from exc.__cause__

    async def call(self, method: str, path: str, body: dict[str, Any] | bytes | None = None, *,
                   timeout: float | None = None, is_generation: bool = False) -> dict[str, Any]:
        """A JSON call (``body`` as an object, or bytes passed as they are); returns the engine's JSON
        object on 2xx, raises otherwise (the engine's error status, or a 502 ``upstream_error`` for a 1xx or a 3xx:
        a redirect passed on would read as the sidecar's own, without ``Location``). ``is_generation``: as
        :meth:`open`'s (a timeout is a 504, the engine not reported)."""
        response, raw = await self.exchange(method, path, body, timeout=timeout, is_generation=is_generation)
        try:
            value = loads_bounded(raw) if raw else {}
        except PeerJSONError as exc:
            if 200 <= response.status < 300:
                raise EngineUnavailable(f"the engine's answer to {method} {path} cannot be read: {exc}",
                                        retry_after=1) from exc
            value = {"error": {"message": raw[:200].decode("utf-8", "replace")}}  # typed by its status
        if 300 <= response.status < 400 or response.status < 200:  # a redirect is no answer: never passed on
            raise EngineRefused(E.UPSTREAM_ERROR.status, {"error": {"type": E.UPSTREAM_ERROR.name, "message": (
                f"the engine answered {method} {path} with {response.status}, not an answer to the call: what it "
                "did is not known")}})
        if not 200 <= response.status < 300:
            retry_after = response.header("retry-after")
            raise EngineRefused(response.status, value if isinstance(value, dict) else {},
                                headers={"Retry-After": retry_after} if retry_after else None)
        return value if isinstance(value, dict) else {"value": value}

    async def _unanswered(self, call: str, exc: EngineUnavailable, timeout: float) -> EngineUnavailable:
        """What became of ``call``, which got no answer: the engine died during it, did not answer within
        ``timeout``, or was not reached (then the call was not sent)."""
        cause = exc.__cause__
        extra: dict[str, Any] = {"call": call}
        if isinstance(cause, ConnectionDropped) and await self._is_gone():
            message = (f"the engine died during {call}: it closed the connection without answering and no longer "
                       "accepts connections (see its log); the node's state is read again once it is back")
            extra["engine_died"] = True
        elif isinstance(cause, UpstreamTimeout):
            message = f"the engine did not answer {call} within {timeout:g}s"
            extra["timeout_s"] = timeout
        elif isinstance(cause, ConnectFailed):
            message = f"{call} was not sent: the engine is unreachable ({cause})"
            extra["sent"] = False
        else:
            message = f"{call} got no answer: {exc.message}"
        return EngineUnavailable(message, retry_after=1, extra=extra)

    async def _is_gone(self, within_s: float = 1.0) -> bool:
        """Whether the engine stops accepting connections within ``within_s``, as a process that exits does
        (its listening socket can outlive the connection it dropped by a few milliseconds). Fresh connections:
        the pool's idle ones fail alike to a dead engine and to a live one that closed them."""
        url = urlsplit(self.base_url)
        deadline = time.monotonic() + within_s
        while time.monotonic() < deadline:
            try:
                _, writer = await asyncio.wait_for(asyncio.open_connection(url.hostname, url.port or 80),
                                                   timeout=max(0.01, deadline - time.monotonic()))
            except ConnectionRefusedError:
                return True
            except (OSError, asyncio.TimeoutError):
                return False
            writer.close()
            await asyncio.sleep(0.02)
        return False


def deadline_spent(call: str) -> ServiceError:
    """A call whose caller's deadline ran out before it was sent: 504, not sent (a zero timeout is no time, not
    ``--control-timeout``; sent, it would time out at once and count the engine unreachable)."""
    return ServiceError(f"the caller's deadline ran out before {call} was sent: not sent, nothing changed",
                        kind=E.UPSTREAM_TIMEOUT, extra={"call": call, "sent": False, "timeout_s": 0})


def generation_overdue(exc: UpstreamError, timeout: float) -> ServiceError:
    """A generation the engine took and did not finish within ``timeout`` (``--generate-timeout``): 504."""
    return ServiceError(f"the engine did not finish this generation within --generate-timeout ({timeout:g} s); it "
                        f"may have run, so it is not sent elsewhere ({exc})", kind=E.UPSTREAM_TIMEOUT,
                        extra={"timeout_s": timeout})
