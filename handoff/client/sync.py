"""The synchronous client."""

from __future__ import annotations

import time
from typing import Any, Iterator

import httpx

from handoff.client.calls import (RetryPolicy, _Base, _Call, _Calls, _control, _decode, _raise_for, _retry_delay,
                                  _SseDecoder)
from handoff.client.errors import FanoutResult, ServiceUnavailable


class HandoffClient(_Base):
    """Synchronous client of the LB (or of one sidecar: the generation and control paths are the same)."""

    def __init__(self, base_url: str, *, admin_token: str | None = None, api_key: str | None = None,
                 timeout: float = 600.0, retry: RetryPolicy | None = None,
                 transport: httpx.BaseTransport | None = None) -> None:
        super().__init__(base_url, admin_token=admin_token, api_key=api_key, retry=retry)
        self._http = httpx.Client(base_url=self.base_url, timeout=timeout, transport=transport)

    def _send(self, call: _Call) -> Any:
        waited = 0.0
        for attempt in range(1, self.retry.max_attempts + 1):
            try:
                return _decode(call, self._http.request(call.method, call.path, **self._request_args(call)))
            except ServiceUnavailable as exc:
                delay = _retry_delay(self.retry, exc, attempt, waited)
                if delay is None:
                    raise
                time.sleep(delay)
                waited += delay
        raise AssertionError("unreachable")  # pragma: no cover

    def generate(self, text: str | list[str] | None = None, *, input_ids: Any = None,
                 sampling_params: dict[str, Any] | None = None, **extra: Any) -> Any:
        """One answer (or a list for a batch): ``text``, ``output_ids``, ``meta_info`` (with ``weight_version``)."""
        return self._send(_Calls.generate(text, input_ids, sampling_params, False, extra))

    def stream_generate(self, text: str | list[str] | None = None, *, input_ids: Any = None,
                        sampling_params: dict[str, Any] | None = None, **extra: Any) -> Iterator[dict[str, Any]]:
        """The stream's events; an error event raises :class:`HandoffError`."""
        call = _Calls.generate(text, input_ids, sampling_params, True, extra)
        with self._http.stream(call.method, call.path, **self._request_args(call)) as response:
            if not response.is_success:
                response.read()
                _raise_for(response)
            decoder = _SseDecoder()
            for chunk in response.iter_bytes():
                yield from decoder.feed(chunk)
                if decoder.is_done:
                    return
            decoder.finish()

    def release(self, tags: list[str] | None = None, *, mode: str = "wait", drain_timeout: float | None = None,
                stage_to_cpu: bool | None = None, role: str | None = None,
                timeout: float | None = None) -> FanoutResult:
        """Release ``tags`` (None: all) on every node (``role`` narrows); ``timeout`` bounds each node."""
        return self._send(_Calls.release(tags, mode, drain_timeout, stage_to_cpu, role, timeout))

    def resume(self, tags: list[str] | None = None, *, role: str | None = None,
               timeout: float | None = None) -> FanoutResult:
        return self._send(_Calls.resume(tags, role, timeout))

    def update_weights_from_disk(self, model_path: str, *, weight_version: str | None = None,
                                 role: str | None = None, timeout: float | None = None) -> FanoutResult:
        return self._send(_Calls.update_weights(model_path, weight_version, role, timeout))

    def flush_cache(self, *, role: str | None = None, timeout: float | None = None) -> FanoutResult:
        return self._send(_control("/flush_cache", None, role, timeout))

    def pause_generation(self, *, mode: str = "abort", role: str | None = None,
                         timeout: float | None = None) -> FanoutResult:
        return self._send(_Calls.pause(mode, role, timeout))

    def continue_generation(self, *, role: str | None = None, timeout: float | None = None) -> FanoutResult:
        return self._send(_control("/continue_generation", None, role, timeout))

    def nodes(self) -> list[dict[str, Any]]:
        body = self._send(_Call("GET", "/nodes"))
        return body["nodes"] if isinstance(body, dict) else body

    def memory_occupation(self) -> dict[str, Any]:
        return self._send(_Call("GET", "/memory_occupation"))

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> "HandoffClient":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
