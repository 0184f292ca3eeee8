"""The asyncio client: the same API as :class:`HandoffClient`."""

from __future__ import annotations

import asyncio
import weakref
from typing import Any, AsyncIterator, Awaitable, Callable, TypeVar

import httpx

from handoff.client.answers import AnswerReader, decode, error_of, node_list, transport_failure
from handoff.client.calls import (DEFAULT_MAX_CONNECTIONS, RetryPolicy, _Base, _Call, _Calls, _control,
                                  _retry_delay, _SseDecoder, _time_left)
from handoff.client.errors import FanoutResult, HandoffError, ServiceUnavailable

T = TypeVar("T")


class AsyncHandoffClient(_Base):
    """The same API for asyncio orchestrators (see :class:`handoff.client.HandoffClient`)."""

    def __init__(self, base_url: str, *, admin_token: str | None = None, api_key: str | None = None,
                 timeout: float = 600.0, retry: RetryPolicy | None = None, max_answer_bytes: int | None = None,
                 max_connections: int = DEFAULT_MAX_CONNECTIONS,
                 transport: httpx.AsyncBaseTransport | None = None) -> None:
        super().__init__(base_url, admin_token=admin_token, api_key=api_key, retry=retry, timeout=timeout,
                         max_answer_bytes=max_answer_bytes, max_connections=max_connections)
        self._http = httpx.AsyncClient(base_url=self.base_url, timeout=timeout, transport=transport,
                                       limits=self._limits)
        self._loop: weakref.ref[asyncio.AbstractEventLoop] | None = None

    def _check_loop(self) -> None:
        """Bind the client to the event loop of its first call; a call from another raises before anything is
        sent: the pooled connections belong to the first loop (used from another, they fail with httpx's "Event
        loop is closed", or worse, while that loop still runs)."""
        loop = asyncio.get_running_loop()
        if self._loop is None:
            self._loop = weakref.ref(loop)
        elif self._loop() is not loop:
            raise RuntimeError("this AsyncHandoffClient was first used on another event loop, whose connections "
                               "it pools: make one client per event loop (per asyncio.run)")

    async def _send(self, call: _Call) -> Any:
        self._check_loop()
        deadline = self._deadline_of(call)
        return await self._retrying(lambda: self._once(call, deadline), deadline)

    async def _retrying(self, attempt_once: Callable[[], Awaitable[T]], deadline: float) -> T:
        waited = 0.0
        for attempt in range(1, self.retry.max_attempts + 1):
            try:
                return await attempt_once()
            except ServiceUnavailable as exc:
                delay = _retry_delay(self.retry, exc, attempt, waited, deadline)
                if delay is None:
                    raise
                await asyncio.sleep(delay)
                waited += delay
        raise RuntimeError("unreachable: the last attempt returns or raises")  # pragma: no cover

    async def _once(self, call: _Call, deadline: float) -> Any:
        late = "the answer did not arrive whole within the call's timeout"
        timeout_s = _time_left(deadline, late)
        try:
            async with asyncio.timeout(timeout_s):  # the head too: httpx bounds each read, not the answer
                async with self._http.stream(call.method, call.path,
                                             **self._request_args(call, timeout_s)) as response:
                    reader = AnswerReader(self.max_answer_bytes, deadline, response.status_code)
                    async for chunk in response.aiter_bytes():
                        reader.feed(chunk)
        except TimeoutError as exc:
            raise HandoffError(0, "timeout", late) from exc
        except httpx.RequestError as exc:
            raise transport_failure(exc) from exc
        return decode(response.status_code, response.headers, reader.body, shape=call.decode,
                      node=self.base_url)

    async def generate(self, text: str | list[str] | None = None, *, input_ids: Any = None,
                       sampling_params: dict[str, Any] | None = None, **extra: Any) -> Any:
        return await self._send(_Calls.generate(text, input_ids, sampling_params, False, extra))

    async def stream_generate(self, text: str | list[str] | None = None, *, input_ids: Any = None,
                              sampling_params: dict[str, Any] | None = None,
                              **extra: Any) -> AsyncIterator[dict[str, Any]]:
        call = _Calls.generate(text, input_ids, sampling_params, True, extra)
        self._check_loop()
        deadline = self._deadline_of(call)
        response = await self._retrying(lambda: self._open_stream(call, deadline), deadline)
        try:
            decoder = _SseDecoder()
            try:
                async for chunk in response.aiter_bytes():
                    for event in decoder.feed(chunk):
                        yield event
                    decoder.raise_pending()
                    if decoder.is_done:
                        return
            except httpx.RequestError as exc:
                raise transport_failure(exc, is_stream=True) from exc
            decoder.finish()
        finally:
            await response.aclose()

    async def _open_stream(self, call: _Call, deadline: float) -> httpx.Response:
        """The stream's response once its status is 2xx; an error answer is read (within the cap), closed and
        raised."""
        late = "the stream did not start within the call's timeout"
        timeout_s = _time_left(deadline, late)
        try:
            async with asyncio.timeout(timeout_s):
                response = await self._http.send(
                    self._http.build_request(call.method, call.path,
                                             **self._request_args(call, timeout_s, is_stream=True)),
                    stream=True)
                if response.is_success:
                    return response
                try:
                    reader = AnswerReader(self.max_answer_bytes, deadline, response.status_code)
                    async for chunk in response.aiter_bytes():
                        reader.feed(chunk)
                finally:
                    await response.aclose()
        except TimeoutError as exc:
            raise HandoffError(0, "timeout", late) from exc
        except httpx.RequestError as exc:
            raise transport_failure(exc) from exc
        raise error_of(response.status_code, response.headers, reader.body, response.reason_phrase)

    async def release(self, tags: list[str] | None = None, *, mode: str = "wait", drain_timeout: float | None = None,
                      stage_to_cpu: bool | None = None, role: str | None = None,
                      timeout: float | None = None) -> FanoutResult:
        return await self._send(_Calls.release(tags, mode, drain_timeout, stage_to_cpu, role, timeout))

    async def resume(self, tags: list[str] | None = None, *, role: str | None = None,
                     timeout: float | None = None) -> FanoutResult:
        return await self._send(_Calls.resume(tags, role, timeout))

    async def update_weights_from_disk(self, model_path: str, *, weight_version: str | None = None,
                                       role: str | None = None, timeout: float | None = None) -> FanoutResult:
        return await self._send(_Calls.update_weights(model_path, weight_version, role, timeout))

    async def flush_cache(self, *, role: str | None = None, timeout: float | None = None) -> FanoutResult:
        return await self._send(_control("/flush_cache", None, role, timeout))

    async def pause_generation(self, *, mode: str = "abort", role: str | None = None,
                               timeout: float | None = None) -> FanoutResult:
        return await self._send(_Calls.pause(mode, role, timeout))

    async def continue_generation(self, *, role: str | None = None, timeout: float | None = None) -> FanoutResult:
        return await self._send(_control("/continue_generation", None, role, timeout))

    async def nodes(self) -> list[dict[str, Any]]:
        return node_list(await self._send(_Call("GET", "/nodes")))

    async def memory_occupation(self) -> dict[str, Any]:
        return await self._send(_Call("GET", "/memory_occupation", decode="object"))

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> "AsyncHandoffClient":
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()
