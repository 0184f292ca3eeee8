"""The synchronous client."""

from __future__ import annotations

import threading
import time
from concurrent import futures
from concurrent.futures import Future
from typing import Any, Callable, Iterator, TypeVar

import httpx

from handoff.client.answers import AnswerReader, decode, error_of, node_list, transport_failure
from handoff.client.calls import (DEFAULT_MAX_CONNECTIONS, RetryPolicy, _Base, _Call, _Calls, _control,
                                  _retry_delay, _SseDecoder, _time_left)
from handoff.client.errors import FanoutResult, HandoffError, ServiceUnavailable

T = TypeVar("T")


def _within(timeout_s: float, work: Callable[[], T], late: str, *, abandon: Callable[[T], None] | None = None) -> T:
    """``work()`` on a thread of its own, waited for ``timeout_s``: httpx bounds each read, not a whole answer,
    so a server dribbling its head a byte at a time would hold the caller past the call's timeout. Past it:
    ``timeout`` (``late`` says what was late); what the work returns afterwards goes to ``abandon``, as it does
    when the wait itself is interrupted (a Ctrl-C), which is raised."""
    outcome: Future[T] = Future()
    lock = threading.Lock()
    is_abandoned = False

    def run() -> None:
        try:
            result = work()
        except BaseException as exc:  # handed to the caller, who raises it
            outcome.set_exception(exc)
            return
        with lock:
            if not is_abandoned:
                outcome.set_result(result)
                return
        if abandon is not None:
            abandon(result)

    def give_up() -> bool:
        """Abandon the work unless it is done: True when it was abandoned (what it returns goes to ``abandon``)."""
        nonlocal is_abandoned
        with lock:
            if not outcome.done():
                is_abandoned = True
        return is_abandoned

    threading.Thread(target=run, name="handoff-client-call", daemon=True).start()
    try:
        is_done = bool(futures.wait([outcome], timeout=timeout_s).done)
    except BaseException:  # a Ctrl-C while waiting: what the work still returns (an open stream) is abandoned too
        if not give_up():
            _discard(outcome, abandon)
        raise
    if not is_done and give_up():
        raise HandoffError(0, "timeout", late)
    failure = outcome.exception()
    if isinstance(failure, TimeoutError):  # the work's own (a transport's), never to be taken for the wait's
        raise HandoffError(0, "timeout", f"{late}: {failure}") from failure
    return outcome.result()


def _discard(outcome: Future[T], abandon: Callable[[T], None] | None) -> None:
    """Hand a result the caller will never take to ``abandon``."""
    if abandon is not None and outcome.exception() is None:
        abandon(outcome.result())


class HandoffClient(_Base):
    """Synchronous client of the LB, or of one sidecar: the generation and control paths are the same, and a
    sidecar's control answer is returned as one node's result."""

    def __init__(self, base_url: str, *, admin_token: str | None = None, api_key: str | None = None,
                 timeout: float = 600.0, retry: RetryPolicy | None = None, max_answer_bytes: int | None = None,
                 max_connections: int = DEFAULT_MAX_CONNECTIONS,
                 transport: httpx.BaseTransport | None = None) -> None:
        """``timeout``: a call's whole time, answer included (control calls: at least the LB's per-node default
        plus a margin, or what their own ``timeout`` says); ``max_answer_bytes``: the longest non-stream
        answer read (default 256 MiB, the LB's cap); ``max_connections``: the calls in flight at once (more wait
        for a connection, within their timeout)."""
        super().__init__(base_url, admin_token=admin_token, api_key=api_key, retry=retry, timeout=timeout,
                         max_answer_bytes=max_answer_bytes, max_connections=max_connections)
        self._http = httpx.Client(base_url=self.base_url, timeout=timeout, transport=transport,
                                  limits=self._limits)

    def _send(self, call: _Call) -> Any:
        deadline = self._deadline_of(call)
        return self._retrying(lambda: self._once(call, deadline), deadline)

    def _retrying(self, attempt_once: Callable[[], T], deadline: float) -> T:
        waited = 0.0
        for attempt in range(1, self.retry.max_attempts + 1):
            try:
                return attempt_once()
            except ServiceUnavailable as exc:
                delay = _retry_delay(self.retry, exc, attempt, waited, deadline)
                if delay is None:
                    raise
                time.sleep(delay)
                waited += delay
        raise RuntimeError("unreachable: the last attempt returns or raises")  # pragma: no cover

    def _once(self, call: _Call, deadline: float) -> Any:
        late = "the answer did not arrive whole within the call's timeout"
        timeout_s = _time_left(deadline, late)

        def read_whole() -> tuple[httpx.Response, bytes]:
            try:
                with self._http.stream(call.method, call.path, **self._request_args(call, timeout_s)) as response:
                    reader = AnswerReader(self.max_answer_bytes, deadline, response.status_code)
                    for chunk in response.iter_bytes():
                        reader.feed(chunk)
            except httpx.RequestError as exc:
                raise transport_failure(exc) from exc
            return response, reader.body

        response, body = _within(timeout_s, read_whole, late)
        return decode(response.status_code, response.headers, body, shape=call.decode,
                      node=self.base_url)

    def generate(self, text: str | list[str] | None = None, *, input_ids: Any = None,
                 sampling_params: dict[str, Any] | None = None, **extra: Any) -> Any:
        """One answer (or a list for a batch): ``text``, ``output_ids``, ``meta_info`` (with ``weight_version``)."""
        return self._send(_Calls.generate(text, input_ids, sampling_params, False, extra))

    def stream_generate(self, text: str | list[str] | None = None, *, input_ids: Any = None,
                        sampling_params: dict[str, Any] | None = None, **extra: Any) -> Iterator[dict[str, Any]]:
        """The stream's events; an error event raises :class:`HandoffError`. A 503 before the stream starts is
        retried as the :class:`RetryPolicy` allows (nothing was generated)."""
        call = _Calls.generate(text, input_ids, sampling_params, True, extra)
        deadline = self._deadline_of(call)
        response = self._retrying(lambda: self._open_stream(call, deadline), deadline)
        try:
            decoder = _SseDecoder()
            try:
                for chunk in response.iter_bytes():
                    yield from decoder.feed(chunk)
                    decoder.raise_pending()
                    if decoder.is_done:
                        return
            except httpx.RequestError as exc:
                raise transport_failure(exc, is_stream=True) from exc
            decoder.finish()
        finally:
            response.close()

    def _open_stream(self, call: _Call, deadline: float) -> httpx.Response:
        """The stream's response once its status is 2xx; an error answer is read (within the cap), closed and
        raised."""
        late = "the stream did not start within the call's timeout"
        timeout_s = _time_left(deadline, late)

        def open_stream() -> httpx.Response:
            try:
                response = self._http.send(
                    self._http.build_request(call.method, call.path,
                                             **self._request_args(call, timeout_s, is_stream=True)),
                    stream=True)
                if response.is_success:
                    return response
                try:
                    reader = AnswerReader(self.max_answer_bytes, deadline, response.status_code)
                    for chunk in response.iter_bytes():
                        reader.feed(chunk)
                finally:
                    response.close()
            except httpx.RequestError as exc:
                raise transport_failure(exc) from exc
            raise error_of(response.status_code, response.headers, reader.body, response.reason_phrase)

        return _within(timeout_s, open_stream, late, abandon=lambda response: response.close())

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
        return node_list(self._send(_Call("GET", "/nodes")))

    def memory_occupation(self) -> dict[str, Any]:
        return self._send(_Call("GET", "/memory_occupation", decode="object"))

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> "HandoffClient":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
