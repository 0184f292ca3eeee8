"""What counts as SGLang's answer to the calls :class:`~node_sidecar.engines.sglang.SglangEngine` sends (line
numbers: ``sglang/srt/`` of 0.5.23): its own refusal (a 400 with its JSON) passed on, anything else that is not
its word (a proxy's page, a redirect, a 5xx) a 502 naming SGLang, nothing taken as done; and the idle barrier
(``/flush_cache`` until SGLang flushes, which it does only when idle)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from typing import Any

from handoff.protocol import errors as E
from handoff.protocol.control import FLUSHED
from handoff.service.errors import Conflict, ServiceError
from handoff.service.peer_json import PeerJSONError, loads_bounded
from handoff.service.upstream import UpstreamError
from node_sidecar.engine_client import EngineClient, deadline_spent
from node_sidecar.engines.base import not_understood
from node_sidecar.errors import EngineRefused, EngineUnavailable, LoadedNotFlushed

log = logging.getLogger(__name__)
ACKNOWLEDGED = ("status", "ok")  # in every 2xx of SGLang's /pause_generation and /continue_generation (1831-1857)

# SGLang's answers to a reload refused before any weight was read (model_runner_components/weight_updater.py:
# 62-67 through 183-185, 202, 226)
NOTHING_LOADED = ("Failed to get weights iterator", "Failed to get model loader",
                  "Online weight updates are not supported")
RELOAD_FAILED = ("SGLang may have loaded part or all of the checkpoint and does not roll back, so its weights are "
                 "not known: the node serves no generation until a reload succeeds")


def reload_may_have_loaded(exc: EngineRefused) -> bool:
    """A refused ``/update_weights_from_disk`` after which SGLang's weights are not known: only SGLang's own
    refusal (400, its JSON) says it ran the load (a 502, a proxy's page, does not), unless it says nothing was
    read (:data:`NOTHING_LOADED`)."""
    return exc.status == 400 and not any(words in exc.message for words in NOTHING_LOADED)


async def memory_call(engine: EngineClient, path: str, engine_tags: list[str]) -> None:
    """SGLang's release and resume answer 200 ``null`` (``http_server.py:1575-1596``) and 400 ``{"error":
    {"message"}}`` when they failed (2246-2250). Any other answer (a proxy's page, a 5xx) is not SGLang's word
    that it ran: a 502 naming SGLang, nothing taken as done (as for a redirect)."""
    response, raw = await engine.exchange("POST", path, {"tags": engine_tags})
    if 200 <= response.status < 300 and raw.strip() in (b"", b"null"):
        return
    error = _json_object(raw).get("error")
    if response.status == 400 and isinstance(error, dict) and isinstance(error.get("message"), str):
        raise EngineRefused(400, {"error": {"type": E.INVALID_REQUEST.name,
                                            "message": f"SGLang {path}: {error['message']}"}})
    if response.status < 400:
        raise sglang_not_understood(path, f"{response.status} ({_quoted(raw)!r}) where SGLang answers null")
    raise _failed(path, response.status, raw)


async def sglang_call(engine: EngineClient, path: str, body: dict[str, Any], *, resumed: list[str] | None = None,
                      acknowledged: tuple[str, object] = ("success", True), timeout: float | None = None
                      ) -> dict[str, Any]:
    """SGLang's weight calls answer ``{"success", "message", ...}``, 400 when they failed; its pause and continue
    ``{"message", "status": "ok"}`` (``acknowledged``: the field and value a 2xx must have to be its answer).
    ``timeout``: as :meth:`EngineClient.exchange`'s (None: ``--control-timeout``)."""
    response, raw = await engine.exchange("POST", path, body, timeout=timeout)
    answer = _json_object(raw)
    key, value = acknowledged
    is_2xx = 200 <= response.status < 300
    if is_2xx and type(answer.get(key)) is type(value) and answer[key] == value:
        return answer
    if response.status == 400 and answer:  # SGLang's own refusal (a JSON object, 400 in 0.5.23 for every
        # failed weight call: http_server.py:1300-1557), passed on with its message
        raise EngineRefused(400, {"error": {
            "type": E.INVALID_REQUEST.name, "message": f"SGLang {path}: {answer.get('message', _quoted(raw))}",
            **({"resumed": resumed} if resumed else {})}})
    if response.status < 400:  # not SGLang's answer (a 2xx without its word, a proxy's redirect)
        raise sglang_not_understood(path, f"{response.status} without {json.dumps({key: value})[1:-1]} "
                                          f"({_quoted(raw)})", resumed)
    raise _failed(path, response.status, raw, resumed)


async def wait_idle(engine: EngineClient, timeout: float, *, within_deadline: bool = False,
                    undone: str = "nothing was released") -> str:
    """``POST /flush_cache`` until SGLang flushes (it does only when idle), at most ``timeout`` seconds.

    ``within_deadline`` (a caller's ``flush_cache``): each call bounded by what is left of ``timeout``, none left
    a 504 at once, nothing sent (:func:`~node_sidecar.engine_client.deadline_spent`); otherwise (a release's idle
    barrier) each call gets at least 1 s."""
    deadline = time.monotonic() + timeout
    delay = 0.02
    while True:
        left = deadline - time.monotonic() if within_deadline else max(1.0, timeout)
        response, raw = await engine.exchange("POST", "/flush_cache", timeout=left)
        text = raw[:300].decode("utf-8", "replace").strip()
        if 200 <= response.status < 300 and text.startswith(FLUSHED):
            return text
        if response.status != 400:  # not SGLang's answer (a proxy's page, an error page): no word that it is idle
            raise EngineRefused(502, {"error": {"type": E.UPSTREAM_ERROR.name, "message": (
                f"SGLang answered /flush_cache with {response.status} {text[:200]!r}: not SGLang's answer, so it "
                "is not known to have flushed or to be idle (a release waiting for it is not sent)")}})
        if time.monotonic() + delay > deadline:
            raise Conflict(f"SGLang still has requests pending after {timeout:g}s (its /flush_cache: {text!r}); "
                           f"{undone}", kind=E.REQUESTS_IN_FLIGHT)
        await asyncio.sleep(delay)
        delay = min(delay * 2, 0.5)


async def retracted_flush(engine: EngineClient, timeout: float) -> str:
    """``/flush_cache`` under SGLang's own pause in mode retract (its running requests back to its queue, their KV
    freed, computed again after the continue: none lost; it flushes while paused, ``scheduler.py:5518-5520``), then
    ``/continue_generation``: SGLang is never left paused by a flush that failed or whose caller left. Its flush
    message; 409 past ``timeout``; a continue that failed after the flush is an error saying so."""
    deadline = time.monotonic() + timeout
    if timeout <= 0:
        raise deadline_spent("POST /pause_generation")
    try:
        await sglang_call(engine, "/pause_generation", {"mode": "retract"}, acknowledged=ACKNOWLEDGED,
                          timeout=timeout)
        message = await wait_idle(engine, deadline - time.monotonic(), within_deadline=True)
    except BaseException:
        with contextlib.suppress(ServiceError):  # the flush's own error is the answer; SGLang read again later
            await asyncio.shield(_continue(engine, deadline))
        raise
    await asyncio.shield(_continue(engine, deadline))  # sent even if the caller leaves now
    return message


async def _continue(engine: EngineClient, deadline: float) -> None:
    """The continue after a retracted flush, given what is left of the flush's deadline (at least 1 s)."""
    try:
        await sglang_call(engine, "/continue_generation", {"torch_empty_cache": False}, acknowledged=ACKNOWLEDGED,
                          timeout=max(deadline - time.monotonic(), 1.0))
    except ServiceError as exc:
        log.error("SGLang's continue after a flush failed: it may keep its requests paused until a "
                  "/continue_generation (%s)", exc.message)
        raise


async def flush_after_update(engine: EngineClient, path: str, timeout: float, answer: dict[str, Any]) -> None:
    """The flush an update asked for, sent after it (the update went with ``flush_cache: false``): SGLang fails an
    update it cannot flush once loaded, keeping the new weights, and it is busy one loop iteration after the drain's
    last answer. Refused before sending instead, a broadcast would leave the trainer's group without its receiver.
    Asked until it flushes, at most ``timeout``; past it, 409 saying the weights are updated (:class:`LoadedNotFlushed`
    with the update's ``answer``, recorded as a success would be)."""
    try:
        await wait_idle(engine, timeout, undone="the cache was not flushed")
    except Conflict as exc:
        raise LoadedNotFlushed(f"{path}: the weights are updated, but {exc.message}: cached prefixes may be the old "
                               "weights'; call /flush_cache once the running requests end", answer) from exc


async def read_paused(engine: EngineClient, timeout: float) -> bool | None:
    """Whether SGLang's generation is paused (``/pause_generation`` without a ``/continue_generation``), None when
    it does not say. SGLang's ``GET /ready`` is 503 while paused or not healthy, its ``GET /ping`` 503 only when
    not healthy (``entrypoints/http_server.py:714-718``, ``2190-2199``; ``managers/tokenizer_manager.py:728-734``):
    so paused is /ready 503 with /ping 200, and not paused is /ready 200."""
    try:
        ready, _ = await engine.peek("/ready", timeout=timeout, max_bytes=256)
        if ready == 200:
            return False
        healthy, _ = await engine.peek("/ping", timeout=timeout, max_bytes=256)
    except UpstreamError as exc:
        raise EngineUnavailable(f"SGLang's /ready or /ping got no answer: {exc}", retry_after=1) from exc
    return True if (ready, healthy) == (503, 200) else None


NOT_READ = object()  # :func:`version_after` could not read the version


async def version_after(engine: EngineClient, path: str, timeout: float) -> Any:
    """SGLang's weight version after an update ``path`` that named none (``/model_info``'s), or :data:`NOT_READ`:
    the update is done all the same, the version stays the one known."""
    try:
        return (await engine.call("GET", "/model_info", timeout=timeout)).get("weight_version")
    except ServiceError as exc:
        log.warning("the weight version after %s cannot be read: %s", path, exc.message)
        return NOT_READ


def outside_session(path: str) -> EngineRefused:
    """A tensor or broadcast update outside SGLang's update session: 400 before anything is resumed or sent."""
    return EngineRefused(400, {"error": {"type": E.INVALID_REQUEST.name, "message": (
        f"{path} must run between begin_weight_update and end_weight_update (SGLang 0.5.23 refuses it otherwise); "
        "nothing was resumed or sent")}})


def reached_sglang(exc: EngineUnavailable) -> bool:
    """SGLang got the call (it timed out, or the connection dropped) and is not gone: it will run it."""
    return exc.extra.get("sent") is not False and not exc.extra.get("engine_died")


def sglang_not_understood(path: str, what: str, resumed: list[str] | None = None) -> EngineRefused:
    """A 2xx (or 1xx, 3xx) answer that is not SGLang's word: a 502 naming SGLang (and what was resumed)."""
    return not_understood("SGLang", path, what, **({"resumed": resumed} if resumed else {}))


def _failed(path: str, status: int, raw: bytes, resumed: list[str] | None = None) -> EngineRefused:
    """An error answer that is not SGLang's refusal of the call (a 5xx, a 400 without its JSON, a 401 for the
    sidecar's own key): the peer failed, not the client: 502 naming SGLang and its status."""
    return EngineRefused(E.UPSTREAM_ERROR.status, {"error": {
        "type": E.UPSTREAM_ERROR.name, "engine_status": status, **({"resumed": resumed} if resumed else {}),
        "message": f"SGLang answered {path} with {status} ({_quoted(raw)!r}): the call failed in SGLang or on the "
                   "way to it, so what it did is not known"}})


def _quoted(raw: bytes) -> str:
    return raw[:200].decode("utf-8", "replace")


def _json_object(raw: bytes) -> dict[str, Any]:
    try:
        value = loads_bounded(raw) if raw else {}
    except PeerJSONError:
        return {}
    return value if isinstance(value, dict) else {}
