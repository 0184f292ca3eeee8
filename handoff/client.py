"""``HandoffClient`` / ``AsyncHandoffClient``: what an RL orchestrator imports to drive a cluster.

::

    from handoff.client import HandoffClient, FanoutFailed

    with HandoffClient("http://lb:8000", admin_token=TOKEN) as cluster:
        rollouts = cluster.generate(text=prompts, sampling_params={"max_new_tokens": 256})
        cluster.release(mode="wait")                 # every node drains, then frees its memory
        ...                                           # train
        cluster.resume(tags=["weights"])
        cluster.update_weights_from_disk("/ckpt/step-12", weight_version="step-12")
        cluster.resume(tags=["kv_cache", "cuda_graph", "workspace"])
        cluster.flush_cache()

Errors: a 502 from the LB (some nodes failed a control call) raises
:class:`FanoutFailed` with the failures and the successes per node; a 503
raises :class:`ServiceUnavailable` carrying ``retry_after``, after the
retries the caller's :class:`RetryPolicy` allows; anything else non-2xx
raises :class:`HandoffError` with the status and the envelope's type.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Iterator

import httpx

DEFAULT_CONTROL_TIMEOUT_S = 120.0
_MARGIN_S = 10.0  # the LB answers within the per-node timeout; give its answer time to arrive


class HandoffError(Exception):
    """A call answered with an error: ``status``, ``type`` and ``message`` from the envelope."""

    def __init__(self, status: int, type: str, message: str, body: Any = None) -> None:
        super().__init__(f"{status} {type}: {message}")
        self.status = status
        self.type = type
        self.message = message
        self.body = body


class ServiceUnavailable(HandoffError):
    """503: nothing can serve now; ``retry_after`` seconds is the server's hint."""

    def __init__(self, status: int, type: str, message: str, body: Any, retry_after: float | None) -> None:
        super().__init__(status, type, message, body)
        self.retry_after = retry_after


@dataclass(frozen=True)
class NodeResult:
    node: str
    role: str
    status: int | None
    body: Any = None


class FanoutFailed(HandoffError):
    """502: a control call failed on some nodes. Nodes are idempotent: retrying the whole call is safe."""

    def __init__(self, body: dict[str, Any]) -> None:
        super().__init__(502, "fanout_failed", str(body.get("message", "control call failed on some nodes")), body)
        self.total: int = int(body.get("total", 0))
        self.failed: int = int(body.get("failed", 0))
        self.failures: list[dict[str, Any]] = list(body.get("failures", []))
        self.succeeded: list[NodeResult] = [_node_result(r) for r in body.get("succeeded", [])]

    @property
    def failed_nodes(self) -> list[str]:
        return [f["node"] for f in self.failures]


@dataclass(frozen=True)
class FanoutResult:
    """A control call that succeeded on every node."""

    total: int
    results: tuple[NodeResult, ...]

    def bodies(self) -> dict[str, Any]:
        return {r.node: r.body for r in self.results}


@dataclass(frozen=True)
class RetryPolicy:
    """Retries of 503 answers (``no_available_node``, ``node_released``...): bounded by attempts and time.

    The default retries nothing. ``max_attempts`` counts the first try.
    """

    max_attempts: int = 1
    max_wait_s: float = 60.0
    default_retry_after_s: float = 1.0

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {self.max_attempts}")
        if self.max_wait_s < 0 or self.default_retry_after_s <= 0:
            raise ValueError("max_wait_s must be >= 0 and default_retry_after_s > 0")


@dataclass
class _Call:
    """One HTTP call, described independently of the sync/async client that sends it."""

    method: str
    path: str
    auth: str | None = None                  # "admin", "api" or None
    body: dict[str, Any] | None = None
    params: dict[str, Any] = field(default_factory=dict)
    timeout: float | None = None
    decode: str = "json"                     # "json" or "fanout"


def _node_result(item: dict[str, Any]) -> NodeResult:
    return NodeResult(node=item.get("node", ""), role=item.get("role", ""), status=item.get("status"),
                      body=item.get("body"))


def _drop_none(values: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in values.items() if v is not None}


def _control(path: str, body: dict[str, Any] | None, role: str | None, timeout: float | None) -> _Call:
    params = _drop_none({"role": role, "timeout": timeout})
    client_timeout = (timeout or DEFAULT_CONTROL_TIMEOUT_S) + _MARGIN_S
    return _Call("POST", path, auth="admin", body=body, params=params, timeout=client_timeout, decode="fanout")


class _Calls:
    """The calls of the API, shared by both clients."""

    @staticmethod
    def generate(text: str | list[str] | None, input_ids: list[int] | list[list[int]] | None,
                 sampling_params: dict[str, Any] | None, stream: bool, extra: dict[str, Any]) -> _Call:
        body = _drop_none({"text": text, "input_ids": input_ids, "sampling_params": sampling_params, **extra})
        if stream:
            body["stream"] = True
        return _Call("POST", "/generate", auth="api", body=body)

    @staticmethod
    def release(tags: list[str] | None, mode: str, drain_timeout: float | None, stage_to_cpu: bool | None,
                role: str | None, timeout: float | None) -> _Call:
        body = _drop_none({"tags": tags, "mode": mode, "drain_timeout": drain_timeout, "stage_to_cpu": stage_to_cpu})
        return _control("/release_memory_occupation", body, role, timeout)

    @staticmethod
    def resume(tags: list[str] | None, role: str | None, timeout: float | None) -> _Call:
        return _control("/resume_memory_occupation", _drop_none({"tags": tags}), role, timeout)

    @staticmethod
    def update_weights(model_path: str, weight_version: str | None, role: str | None, timeout: float | None) -> _Call:
        body = _drop_none({"model_path": model_path, "weight_version": weight_version})
        return _control("/update_weights_from_disk", body, role, timeout)

    @staticmethod
    def pause(mode: str, role: str | None, timeout: float | None) -> _Call:
        return _control("/pause_generation", {"mode": mode}, role, timeout)


def _raise_for(response: httpx.Response) -> None:
    if response.is_success:
        return
    try:
        body = response.json()
    except ValueError:
        body = {"error": {"type": "http_error", "message": response.text[:500]}}
    if response.status_code == 502 and isinstance(body, dict) and "failures" in body:
        raise FanoutFailed(body)
    error = body.get("error", {}) if isinstance(body, dict) else {}
    type_ = str(error.get("type", "http_error"))
    message = str(error.get("message", response.reason_phrase))
    if response.status_code == 503:
        retry_after = response.headers.get("retry-after")
        raise ServiceUnavailable(503, type_, message, body, float(retry_after) if retry_after else None)
    raise HandoffError(response.status_code, type_, message, body)


def _decode(call: _Call, response: httpx.Response) -> Any:
    _raise_for(response)
    body = response.json()
    if call.decode == "fanout":
        return FanoutResult(total=int(body.get("total", 0)),
                            results=tuple(_node_result(r) for r in body.get("results", [])))
    return body


def _retry_delay(policy: RetryPolicy, exc: ServiceUnavailable, attempt: int, waited: float) -> float | None:
    """Seconds to wait before the next attempt, or None when the policy says stop."""
    if attempt >= policy.max_attempts:
        return None
    delay = exc.retry_after if exc.retry_after is not None else policy.default_retry_after_s
    if waited + delay > policy.max_wait_s:
        return None
    return delay


_END = object()


def _parse_line(line: str) -> Any:
    """An SSE line: its event, ``None`` (nothing to yield) or ``_END`` at ``[DONE]``; error events raise."""
    if not line.startswith("data: "):
        return None
    data = line[len("data: "):]
    if data == "[DONE]":
        return _END
    event = json.loads(data)
    if "error" in event:
        error = event["error"]
        raise HandoffError(200, error.get("type", "stream_error"), error.get("message", ""), event)
    return event


class _Base:
    def __init__(self, base_url: str, *, admin_token: str | None, api_key: str | None,
                 retry: RetryPolicy | None) -> None:
        self.base_url = base_url.rstrip("/")
        self.retry = retry or RetryPolicy()
        self._headers = {"admin": {"Authorization": f"Bearer {admin_token}"} if admin_token else {},
                         "api": {"Authorization": f"Bearer {api_key}"} if api_key else {}}

    def _request_args(self, call: _Call) -> dict[str, Any]:
        args: dict[str, Any] = {"headers": self._headers.get(call.auth or "", {}), "params": call.params}
        if call.body is not None:
            args["json"] = call.body
        if call.timeout is not None:
            args["timeout"] = call.timeout
        return args


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
            for line in response.iter_lines():
                event = _parse_line(line)
                if event is _END:
                    return
                if event is not None:
                    yield event

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
            async for line in response.aiter_lines():
                event = _parse_line(line)
                if event is _END:
                    return
                if event is not None:
                    yield event

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
