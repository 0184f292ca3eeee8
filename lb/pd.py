"""Prefill/decode routing: the SGLang PD protocol, as SGLang's own mini load balancer speaks it.

The request body gets ``bootstrap_host`` (the prefill node's host),
``bootstrap_port`` (its ``@PORT``, or null) and a random ``bootstrap_room``,
each a list of the batch's size for a batch, and goes to a prefill and a
decode node at once. The client gets the decode node's answer; for
``/generate`` with ``return_logprob`` the prefill node's input logprobs are
put in front of the decode node's in ``meta_info``. The prefill answer is
always read to its end (closing it early would abort the KV transfer), unless
the decode node refused the request. A side's stream refusal (a 200 whose first
event is the error, :mod:`lb.pd_refusals`) ends the other side's call (:mod:`lb.pd_streams`).
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import random
from typing import Any, Mapping

from starlette.responses import Response

from handoff.service.disconnect import DisconnectWatch
from handoff.service.errors import InvalidRequest, ServiceError, parse_json_bytes
from handoff.service.logs import rate_limit
from handoff.service.peer_json import PeerJSONError
from handoff.service.relay import WholeAnswer
from handoff.service.upstream import UpstreamResponse
from lb.config import Role
from lb.errors import UpstreamFailed
from lb.node import Node, RequestLease
from lb.pd_logprobs import MERGE_ON_LOOP_BYTES, merged_answer
from lb.pd_streams import PairStreams
from lb.pd_retry import PairRetries
from lb.relay import NodeCaller, buffered_response, is_event_stream
from lb.routing import Router

log = logging.getLogger(__name__)
rate_limit(log)  # a failing prefill node is a warning per request

MAX_PD_BATCH = 4096  # prompts in one PD request; a handoff engine takes at most 256 (SGLang sets no limit)
Outcome = Any  # UpstreamResponse | Response | Reroute | ServiceError: what one side of a pair did


def bootstrap_host(node: Node) -> str:
    authority = node.url[len("http://"):]
    if authority.startswith("["):
        return authority[:authority.index("]") + 1]
    return authority.partition(":")[0]


def batch_size(payload: Mapping[str, Any]) -> int | None:
    """The batch size of a ``/generate`` body, or None for a single request (SGLang's rule)."""
    text = payload.get("text")
    if text is not None:
        if isinstance(text, str):
            return None
        if not isinstance(text, list):
            raise InvalidRequest(f"text must be a string or a list of strings, not {type(text).__name__}")
        return len(text)
    input_ids = payload.get("input_ids")
    if isinstance(input_ids, list) and input_ids:
        return None if isinstance(input_ids[0], int) else len(input_ids)
    return None


def check_batch(payload: Mapping[str, Any]) -> int | None:
    """:func:`batch_size`, 400 past :data:`MAX_PD_BATCH` (each prompt gets bootstrap fields of its own: an
    unbounded batch of empty prompts would make the LB build and send bodies many times the request's size)."""
    size = batch_size(payload)
    if size is not None and size > MAX_PD_BATCH:
        raise InvalidRequest(f"a prefill/decode batch holds at most {MAX_PD_BATCH} prompts, got {size}")
    return size


def with_bootstrap(payload: dict[str, Any], prefill: Node, size: int | None) -> dict[str, Any]:
    """A copy of ``payload`` (a batch of ``size`` prompts, None for one) with the bootstrap fields of
    ``prefill`` (lists for a batch)."""
    host, port = bootstrap_host(prefill), prefill.bootstrap_port
    if size is None:
        return {**payload, "bootstrap_host": host, "bootstrap_port": port, "bootstrap_room": random.getrandbits(63)}
    return {**payload, "bootstrap_host": [host] * size, "bootstrap_port": [port] * size,
            "bootstrap_room": [random.getrandbits(63) for _ in range(size)]}


class PDDispatcher:
    def __init__(self, router: Router, caller: NodeCaller) -> None:
        self._router = router
        self._caller = caller
        self._drains: set[asyncio.Task[None]] = set()

    async def dispatch(self, path: str, body: bytes, headers: Mapping[str, str], watch: DisconnectWatch,
                       version: str | None = None) -> Response:
        """``version``: the weight version the request pins (its header, read as UTF-8): both nodes of the pair
        must serve it."""
        payload = _parse_object(body)
        size = check_batch(payload)
        wants_logprobs = path == "/generate" and bool(payload.get("return_logprob"))
        retries = PairRetries(payload)
        while True:
            prefill = self._router.pick(Role.PREFILL, retries.tried[Role.PREFILL], avoid=retries.sent,
                                        weight_version=version)
            decode = self._router.pick(Role.DECODE, retries.tried[Role.DECODE], avoid=retries.sent,
                                       weight_version=version)
            for refusal in retries.take_refusals():
                self._caller.count_retry(refusal)
            # not escaped: non-ASCII text written as \uXXXX would reach the nodes up to three times as large
            data = json.dumps(with_bootstrap(payload, prefill, size), ensure_ascii=False).encode()
            with prefill.begin_request() as prefill_lease, decode.begin_request() as decode_lease:
                prefill_out, decode_out = await self._call_pair(prefill, decode, path, data, headers)
                if not (isinstance(prefill_out, UpstreamResponse) and isinstance(decode_out, UpstreamResponse)):
                    final = _settle_failed_pair(prefill_out, decode_out)
                    refused_by = decode if isinstance(decode_out, Response) else prefill
                    if final is not None and not retries.is_abort_pending(refused_by, final):
                        return final
                    retries.record((prefill, decode), (prefill_out, decode_out))
                elif await _is_stream_abort_pending(retries, (prefill, prefill_out), (decode, decode_out), path,
                                                    self._caller.timeout_s):
                    retries.record((prefill, decode), (None, None))  # both sides closed: both got the request
                else:
                    return await self._answer(path, prefill_lease.hand_over(), prefill_out,
                                              decode_lease.hand_over(), decode_out, wants_logprobs, watch)
            await retries.pause()  # out of the pair's leases: neither node counts this request meanwhile

    async def _call_pair(self, prefill: Node, decode: Node, path: str, data: bytes,
                         headers: Mapping[str, str]) -> tuple[Outcome | None, Outcome | None]:
        """Both calls at once, each in a task of its own; a failure is returned, not raised.

        Either node of a pair waits long for the other, so the first to fail decides the pair and the other
        call is given up at once (None), not awaited: a call that failed or refused (no response: a reroute or
        an error; or an answer other than 2xx, read whole for the client). A prefill node's such answer
        decides the pair whenever it comes: that node made no KV cache, so the decode node would wait for it
        in vain (a decode stream that already began is closed). If this task is cancelled meanwhile (the
        client left), both calls are given up (a response that came, closed): neither node goes on for nobody.
        """
        prefill_call = asyncio.ensure_future(self._caller.call(prefill, path, data, headers))
        decode_call = asyncio.ensure_future(self._caller.call(decode, path, data, headers))
        try:
            await asyncio.wait((prefill_call, decode_call), return_when=asyncio.FIRST_COMPLETED)
            if not decode_call.done() and not _took(prefill_out := _outcome(prefill_call)):
                _give_up(decode_call)
                return await self._settle(prefill, prefill_out, path), None
            decode_out = await _settled(decode_call)
            if not _took(decode_out):
                _give_up(prefill_call)  # the decode node took nothing: the prefill node would wait for it in vain
                return None, await self._settle(decode, decode_out, path)
            prefill_out = await _settled(prefill_call)
            if not _took(prefill_out):
                decode_out.close()
                return await self._settle(prefill, prefill_out, path), None
            return prefill_out, decode_out
        except BaseException:
            _give_up(prefill_call)
            _give_up(decode_call)
            raise

    async def _settle(self, node: Node, out: Outcome, path: str) -> Outcome:
        """The outcome of a side that did not take the request (its pair given up), an answer other than 2xx
        read whole for the client; a prefill node's is logged (the client may take it for the decode node's)."""
        if isinstance(out, UpstreamResponse):
            out = await self._whole_refusal(node, out, path)
        if node.role is Role.PREFILL and isinstance(out, Response):
            log.warning("prefill node %s answered %d on %s; its decode call was given up: %s", node.url,
                        out.status_code, path, bytes(out.body[:512]).decode("utf-8", "replace"))
        return out

    async def _whole_refusal(self, node: Node, upstream: UpstreamResponse, path: str) -> Response | ServiceError:
        """A node's error answer, read whole for the client (or the error reading it)."""
        try:
            return buffered_response(upstream, await self._caller.read_body(node, upstream, path))
        except ServiceError as exc:
            return exc
        finally:
            upstream.close()

    async def _answer(self, path: str, prefill_lease: RequestLease, prefill_up: UpstreamResponse,
                      decode_lease: RequestLease, decode_up: UpstreamResponse, wants_logprobs: bool,
                      watch: DisconnectWatch) -> Response:
        """Both nodes took the request; owns both responses and both in-flight leases from here."""
        prefill, decode = prefill_lease.node, decode_lease.node
        if is_event_stream(decode_up):
            streams = PairStreams(self._caller, path, watch, self._drains)
            if not wants_logprobs:
                return streams.relay_beside_prefill(prefill_lease, prefill_up, decode_lease, decode_up)
            return await streams.relay_merged(prefill_lease, prefill_up, decode_lease, decode_up)
        # both bodies are already streaming into their connections: reading one after the other costs no time
        with decode_lease:
            try:
                try:
                    prefill_raw: bytes | ServiceError = await self._read_prefill(prefill_lease, prefill_up, path)
                except ServiceError as exc:
                    prefill_raw = exc
                decode_raw = await self._caller.read_body(decode, decode_up, path)
            finally:
                prefill_up.close()
                decode_up.close()
        if isinstance(prefill_raw, ServiceError) and not wants_logprobs:
            log.warning("prefill answer lost, answering with the decode node's: %s", prefill_raw)
        if not wants_logprobs or not 200 <= decode_up.status < 300:
            return buffered_response(decode_up, decode_raw)
        if isinstance(prefill_raw, ServiceError):
            raise prefill_raw
        merge = functools.partial(merged_answer, prefill_raw, decode_raw)
        try:
            if len(prefill_raw) + len(decode_raw) > MERGE_ON_LOOP_BYTES:
                merged = await asyncio.to_thread(merge)
            else:
                merged = merge()
        except PeerJSONError as exc:
            raise UpstreamFailed(f"cannot merge input logprobs of {prefill.url} and {decode.url}: {exc}",
                                 extra={"node": prefill.url}) from exc
        # in pieces, as every buffered answer: its bytes stay in the request's answer share until the last went out
        return WholeAnswer(merged, status=decode_up.status, deadline=decode_up.deadline,
                           headers=[(b"content-type", b"application/json"),
                                    (b"content-length", str(len(merged)).encode())])

    async def _read_prefill(self, lease: RequestLease, upstream: UpstreamResponse, path: str) -> bytes:
        node = lease.node
        with lease:  # a 2xx answer (:meth:`_call_pair`)
            return await self._caller.read_body(node, upstream, path)


async def _is_stream_abort_pending(retries: PairRetries, prefill: tuple[Node, UpstreamResponse],
                                   decode: tuple[Node, UpstreamResponse], path: str, timeout_s: float) -> bool:
    """:meth:`PairRetries.is_stream_abort_pending`; both responses closed when it is so, or on a failure."""
    try:
        is_pending = await retries.is_stream_abort_pending((prefill, decode), path, timeout_s)
    except BaseException:
        prefill[1].close()
        decode[1].close()
        raise
    if is_pending:
        prefill[1].close()
        decode[1].close()
    return is_pending


def _took(out: Outcome) -> bool:
    """Whether a node took the request: it answered 2xx (its body may still fail)."""
    return isinstance(out, UpstreamResponse) and 200 <= out.status < 300


def _give_up(call: asyncio.Future[Outcome]) -> None:
    """A node call no longer wanted: cancelled while under way; its response closed (its error read) if it
    came anyway."""
    if not call.done():
        call.cancel()
    call.add_done_callback(_discard)


async def _settled(call: asyncio.Future[Outcome]) -> Outcome:
    """What a node call came to, once it finished (:func:`_outcome`); cancelling the waiter leaves it running."""
    await asyncio.wait((call,))
    return _outcome(call)


def _outcome(call: asyncio.Future[Outcome]) -> Outcome:
    """A finished node call's result, or the :class:`ServiceError` it raised (any other exception raises)."""
    error = call.exception()
    return error if isinstance(error, ServiceError) else call.result()


def _discard(call: asyncio.Future[Outcome]) -> None:
    if call.cancelled() or call.exception() is not None:
        return
    if isinstance(call.result(), UpstreamResponse):
        call.result().close()


def _settle_failed_pair(prefill_out: Outcome | None, decode_out: Outcome | None) -> Response | None:
    """One side did not take the request: close the other side; raise, answer, or None to re-pick."""
    for out in (prefill_out, decode_out):
        if isinstance(out, UpstreamResponse):
            out.close()
    for out in (decode_out, prefill_out):
        if isinstance(out, ServiceError):
            raise out
    for out in (decode_out, prefill_out):
        if isinstance(out, Response):
            return out
    return None


def _parse_object(body: bytes) -> dict[str, Any]:
    payload = parse_json_bytes(body)
    if not isinstance(payload, dict):
        raise InvalidRequest(f"body must be a JSON object, got {type(payload).__name__}")
    return payload
