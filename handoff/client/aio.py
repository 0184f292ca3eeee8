"""The asyncio client: the same API as :class:`HandoffClient`."""

from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator

import httpx

from handoff.client.calls import (RetryPolicy, _Base, _Call, _Calls, _control, _decode, _raise_for, _retry_delay,
                                  _SseDecoder)
from handoff.client.errors import FanoutResult, ServiceUnavailable


class AsyncHandoffClient(_Base):
    """The same API for asyncio orchestrators."""

    def __init__(self, base_url: str, *, admin_token: str | None = None, api_key: str | None = None,
                 timeout: float = 600.0, retry: RetryPolicy | None = None,
                 transport: httpx.AsyncBaseTransport | None = None) -> None:
        super().__init__(base_url, admin_token=admin_token, api_key=api_key, retry=retry)
        self._http = httpx.AsyncClient(base_url=self.base_url, timeout=timeout, transport=transport)

    async def _send(self, call: _Call) -> Any:
        waited = 0.0
        for attempt in range(1, self.retry.max_attempts + 1):
            try:
                return _decode(call, await self._http.request(call.method, call.path, **self._request_args(call)))
            except ServiceUnavailable as exc:
                delay = _retry_delay(self.retry, exc, attempt, waited)
                if delay is None:
                    raise
                await asyncio.sleep(delay)
                waited += delay
        raise AssertionError("unreachable")  # pragma: no cover

    async def generate(self, text: str | list[str] | None = None, *, input_ids: Any = None,
                       sampling_params: dict[str, Any] | None = None, **extra: Any) -> Any:
        return await self._send(_Calls.generate(text, input_ids, sampling_params, False, extra))

    async def stream_generate(self, text: str | list[str] | None = None, *, input_ids: Any = None,
                              sampling_params: dict[str, Any] | None = None,
                              **extra: Any) -> AsyncIterator[dict[str, Any]]:
        call = _Calls.generate(text, input_ids, sampling_params, True, extra)
        async with self._http.stream(call.method, call.path, **self._request_args(call)) as response:
            if not response.is_success:
                await response.aread()
                _raise_for(response)
            decoder = _SseDecoder()
            async for chunk in response.aiter_bytes():
                for event in decoder.feed(chunk):
                    yield event
                if decoder.is_done:
                    return
            decoder.finish()

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
        body = await self._send(_Call("GET", "/nodes"))
        return body["nodes"] if isinstance(body, dict) else body

    async def memory_occupation(self) -> dict[str, Any]:
        return await self._send(_Call("GET", "/memory_occupation"))

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> "AsyncHandoffClient":
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()
