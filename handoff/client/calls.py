"""The API's calls, described once, sent by either client; decoding, retries and SSE parsing."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import httpx

from handoff.client.answers import DEFAULT_MAX_ANSWER_BYTES, envelope_fields
from handoff.client.errors import HandoffError, ServiceUnavailable
from handoff.protocol.bearer import checked_token
from handoff.protocol.sse import DONE, EventSplitter, EventTooLarge, event_data
from handoff.service.flag_types import MAX_SECONDS, seconds_problem
from handoff.service.peer_json import PeerJSONError, loads_bounded

DEFAULT_CONTROL_TIMEOUT_S = 120.0
DEFAULT_WEIGHT_SYNC_TIMEOUT_S = 600.0  # the LB's per-node default for the calls that move weights, disk reloads too
_MARGIN_S = 10.0  # the LB answers within the per-node timeout; give its answer time to arrive
DEFAULT_MAX_CONNECTIONS = 1024  # calls in flight at once (httpx's own default, 100, queues a rollout's gather)


@dataclass(frozen=True)
class RetryPolicy:
    """Retries of 503 answers (``no_available_node``, ``node_released``...): bounded by attempts and time.

    The default retries nothing. ``max_attempts`` counts the first try; ``max_wait_s`` bounds the waits between
    attempts. The client's timeout (or a control call's) bounds the whole call, its retries included: a wait
    that would end past it is not made (the last 503 is raised), and each attempt has what is left of it.
    """

    max_attempts: int = 1
    max_wait_s: float = 60.0
    default_retry_after_s: float = 1.0

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {self.max_attempts}")
        for name, problem in (("max_wait_s", seconds_problem(self.max_wait_s, allow_zero=True)),
                              ("default_retry_after_s", seconds_problem(self.default_retry_after_s))):
            if problem is not None:  # time.sleep overflows past 2**63 ns
                raise ValueError(f"{name}: {problem}")


@dataclass
class _Call:
    """One HTTP call, described independently of the sync/async client that sends it."""

    method: str
    path: str
    auth: str | None = None                  # "admin", "api" or None
    body: dict[str, Any] | None = None
    params: dict[str, Any] = field(default_factory=dict)
    timeout: float | None = None
    decode: str = "json"                     # the answer's shape: one of handoff.client.answers.SHAPES
    lb_default_timeout: float = DEFAULT_CONTROL_TIMEOUT_S  # a fan-out's per-node deadline when no ?timeout= is sent


def _bearer(token: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"} if token else {}


def _checked_base_url(base_url: str) -> str:
    parts = urlsplit(base_url.rstrip("/"))
    if "@" in parts.netloc:  # httpx would send it as Basic auth in place of the token; never echoed: a password
        raise ValueError("base_url must not hold user:password@ (give the token as admin_token or api_key)")
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.query or parts.fragment:
        raise ValueError(f"base_url must be http(s)://host[:port][/prefix], got {base_url!r}")
    try:
        parts.port  # noqa: B018 (raises for a port that is not a number in range)
    except ValueError as exc:
        raise ValueError(f"base_url has a bad port: {base_url!r}") from exc
    return base_url.rstrip("/")


def _drop_none(values: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in values.items() if v is not None}


def _control(path: str, body: dict[str, Any] | None, role: str | None, timeout: float | None) -> _Call:
    """A control call; ``timeout`` bounds each node (the LB's ``?timeout=``), and the client waits that long
    plus a margin (without one: the client's own timeout, at least the LB's default per node plus the margin).
    A ``timeout`` that is not a number of seconds within :data:`MAX_SECONDS` is a ``ValueError``: nothing is sent."""
    problem = None if timeout is None else seconds_problem(timeout)
    if problem is not None:
        raise ValueError(f"timeout: {problem}")
    params = _drop_none({"role": role, "timeout": timeout})
    client_timeout = None if timeout is None else timeout + _MARGIN_S
    return _Call("POST", path, auth="admin", body=body, params=params, timeout=client_timeout, decode="fanout")


class _Calls:
    """The calls of the API, shared by both clients."""

    @staticmethod
    def generate(text: str | list[str] | None, input_ids: list[int] | list[list[int]] | None,
                 sampling_params: dict[str, Any] | None, stream: bool, extra: dict[str, Any]) -> _Call:
        body = _drop_none({"text": text, "input_ids": input_ids, "sampling_params": sampling_params, **extra})
        if stream:
            body["stream"] = True
        return _Call("POST", "/generate", auth="api", body=body,
                     decode=_generation_shape(text, input_ids, sampling_params))

    @staticmethod
    def release(tags: list[str] | None, mode: str, drain_timeout: float | None, stage_to_cpu: bool | None,
                role: str | None, timeout: float | None) -> _Call:
        """Without ``timeout``, the LB picks each node's deadline: its ``--control-timeout``, raised to cover a
        longer ``drain_timeout`` (sending ``drain_timeout`` plus a margin cut the LB's default 120 s to 10 s for
        ``drain_timeout=0``: a release staging large weights was reported timed out while it still ran); the
        client waits for the longer of the two, plus its margin."""
        body = _drop_none({"tags": tags, "mode": mode, "drain_timeout": drain_timeout, "stage_to_cpu": stage_to_cpu})
        call = _control("/release_memory_occupation", body, role, timeout)
        if timeout is None and seconds_problem(drain_timeout, allow_zero=True) is None:
            call.lb_default_timeout = min(max(DEFAULT_CONTROL_TIMEOUT_S, drain_timeout + _MARGIN_S), MAX_SECONDS)
        return call

    @staticmethod
    def resume(tags: list[str] | None, role: str | None, timeout: float | None) -> _Call:
        return _control("/resume_memory_occupation", _drop_none({"tags": tags}), role, timeout)

    @staticmethod
    def update_weights(model_path: str, weight_version: str | None, role: str | None, timeout: float | None) -> _Call:
        body = _drop_none({"model_path": model_path, "weight_version": weight_version})
        call = _control("/update_weights_from_disk", body, role, timeout)
        call.lb_default_timeout = DEFAULT_WEIGHT_SYNC_TIMEOUT_S  # without ?timeout=, the LB waits this long per node
        return call

    @staticmethod
    def pause(mode: str, role: str | None, timeout: float | None) -> _Call:
        return _control("/pause_generation", {"mode": mode}, role, timeout)


def _generation_shape(text: Any, input_ids: Any, sampling_params: Any) -> str:
    """What ``/generate`` answers, by SGLang's rule (``GenerateReqInput``): a list for a batch (``text`` a list,
    ``input_ids`` a list of lists) or ``n`` > 1 (not a beam search), an object for one prompt; either when the
    request leaves it open (no prompt the client can read, several ``sampling_params``)."""
    if isinstance(text, list) or (isinstance(input_ids, list) and input_ids and isinstance(input_ids[0], list)):
        return "list"
    if not isinstance(text, str) and not isinstance(input_ids, list):
        return "object_or_list"
    params = sampling_params if sampling_params is not None else {}
    if not isinstance(params, dict):
        return "object_or_list"
    n, beam_width = params.get("n"), params.get("beam_width")
    if n is None or n == 1 or (isinstance(beam_width, int) and beam_width > 1):
        return "object"
    return "list" if isinstance(n, int) and not isinstance(n, bool) and n > 1 else "object_or_list"


def _retry_delay(policy: RetryPolicy, exc: ServiceUnavailable, attempt: int, waited: float,
                 deadline: float) -> float | None:
    """Seconds to wait before the next attempt, or None when the policy says stop, or when the wait would end
    at or past the call's ``deadline`` (``time.monotonic()``): the 503 is raised then, not a timeout later."""
    if attempt >= policy.max_attempts:
        return None
    delay = exc.retry_after if exc.retry_after is not None else policy.default_retry_after_s
    if waited + delay > policy.max_wait_s or time.monotonic() + delay >= deadline:
        return None
    return delay


def _time_left(deadline: float, late: str) -> float:
    """Seconds from now to the call's ``deadline``; ``timeout`` (``late`` says what was late) once it passed."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise HandoffError(0, "timeout", late)
    return left


class _SseDecoder:
    """Turns an SSE body, fed as bytes as they arrive, into its events, up to ``[DONE]``; error events raise.

    Framing is :class:`handoff.protocol.sse.EventSplitter`'s: events end at a blank line made of CRLF, LF or
    CR line ends, never at U+2028, U+0085, form feeds... which the engine's events carry raw inside their JSON
    strings. :meth:`finish` raises if the body ended without ``[DONE]``: a stream cut short is never taken for
    a complete one. The events before a bad one are returned first, however the bytes were cut into chunks;
    its error is raised by :meth:`raise_pending` (the caller's, once it handed them on), or the next :meth:`feed`
    or :meth:`finish`.
    """

    def __init__(self) -> None:
        self._splitter = EventSplitter()
        self._error: HandoffError | None = None
        self.is_done = False

    def raise_pending(self) -> None:
        """Raise the error of a bad event that followed the events :meth:`feed` returned, if one did."""
        if self._error is not None:
            raise self._error

    def feed(self, chunk: bytes) -> list[dict[str, Any]]:
        """The events completed by ``chunk`` (none once ``[DONE]`` was seen)."""
        self.raise_pending()
        try:
            raw_events = self._splitter.feed(chunk)
        except EventTooLarge as exc:
            raise HandoffError(200, "invalid_stream", str(exc)) from exc
        events: list[dict[str, Any]] = []
        for raw in raw_events:
            if self.is_done:
                break
            try:
                event = self._event(raw)
            except HandoffError as exc:
                if not events:
                    raise
                self._error = exc
                break
            if event is not None:
                events.append(event)
        return events

    def _event(self, raw: bytes) -> dict[str, Any] | None:
        """One event's object; None for a comment, an event without data or ``[DONE]`` (then :attr:`is_done`)."""
        data = event_data(raw)
        if data is None:
            return None
        if data == DONE:
            self.is_done = True
            return None
        try:
            event = loads_bounded(data)
        except PeerJSONError as exc:
            raise HandoffError(200, "invalid_stream", f"an event is not JSON: {exc}") from exc
        if not isinstance(event, dict):  # SGLang's events are objects (a batch's carry their ``index``)
            raise HandoffError(200, "invalid_stream", f"an event must be a JSON object, got "
                                                      f"{type(event).__name__}", event)
        if event.get("error"):  # as the openai client: ``"error": null`` is no error
            raise HandoffError(200, *envelope_fields(event["error"], "stream_error", "an error event"), event)
        return event

    def finish(self) -> None:
        """The body ended: ``incomplete_stream`` unless ``[DONE]`` came (an event without its blank line is cut
        short, never parsed; only a final ``[DONE]`` is accepted without it)."""
        self.raise_pending()
        try:
            rest = self._splitter.finish()
        except EventTooLarge as exc:
            raise HandoffError(200, "invalid_stream", str(exc)) from exc
        if not self.is_done and event_data(rest.strip()) == DONE:
            self.is_done = True
        if not self.is_done:
            raise HandoffError(200, "incomplete_stream", "the stream ended without [DONE]")


class _Base:
    def __init__(self, base_url: str, *, admin_token: str | None, api_key: str | None,
                 retry: RetryPolicy | None, timeout: float, max_answer_bytes: int | None,
                 max_connections: int) -> None:
        """Raises ``ValueError`` naming the parameter (never a token's value) for a URL that is not
        ``http(s)://host[:port]``, a timeout that is not a positive number, a token that cannot be sent, or a
        ``max_answer_bytes`` (None: the default) or ``max_connections`` below 1."""
        self.base_url = _checked_base_url(base_url)
        problem = seconds_problem(timeout)
        if problem is not None:  # past a week, Python's own waits overflow (OverflowError from a call)
            raise ValueError(f"timeout: {problem}")
        self.retry = retry or RetryPolicy()
        self.timeout_s = float(timeout)
        for name, value in (("max_answer_bytes", 1 if max_answer_bytes is None else max_answer_bytes),
                            ("max_connections", max_connections)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        self.max_answer_bytes = DEFAULT_MAX_ANSWER_BYTES if max_answer_bytes is None else max_answer_bytes
        # every call in flight at once has a connection; idle ones are kept for the next wave of calls
        self._limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections)
        admin = checked_token(admin_token, "admin_token") if admin_token else None  # "" or None: no token
        api = checked_token(api_key, "api_key") if api_key else None
        # the services take the admin token wherever they take the API key, and with no admin token set, the API
        # key for control calls (SGLang's rule: handoff.service.auth.admin_token_of)
        self._headers = {"admin": _bearer(admin or api), "api": _bearer(api or admin)}

    def _timeout_of(self, call: _Call) -> float:
        """The whole call's time, in seconds from its start, retries included (see :func:`_control` for control
        calls)."""
        if call.timeout is not None:
            return call.timeout
        if call.decode == "fanout":
            return max(self.timeout_s, call.lb_default_timeout + _MARGIN_S)
        return self.timeout_s

    def _deadline_of(self, call: _Call) -> float:
        """When the whole call, every retry and the waits between them included, must be over
        (``time.monotonic()``)."""
        return time.monotonic() + self._timeout_of(call)

    def _request_args(self, call: _Call, timeout_s: float, *, is_stream: bool = False) -> dict[str, Any]:
        """httpx's arguments for one attempt, given the ``timeout_s`` left of the call. A stream's reads are each
        bounded by the client's whole timeout, not by what was left of the call when it started: its head is
        bounded by the caller (within ``timeout_s``), and its events, once it started, by no call deadline."""
        timeout = httpx.Timeout(timeout_s, read=self.timeout_s) if is_stream else timeout_s
        args: dict[str, Any] = {"headers": self._headers.get(call.auth or "", {}), "params": call.params,
                                "timeout": timeout}
        if call.body is not None:
            args["json"] = call.body
        return args
