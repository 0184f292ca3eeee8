"""A PD pair's streamed answer: the decode stream relayed, the prefill answer read beside it (merged into it for
``return_logprob``), and either side's stream refusal (:mod:`lb.pd_refusals`) ending the other side's call:
neither node would run the request, and each waits long for the other (a decode node for a KV cache, a prefill
node for a decode node to fetch it)."""

from __future__ import annotations

import asyncio
import functools
import logging
from typing import Any

from starlette.responses import Response

from handoff.protocol import errors as E
from handoff.service.disconnect import DisconnectWatch
from handoff.service.errors import ServiceError
from handoff.service.logs import rate_limit
from handoff.service.peer_json import PeerJSONError
from handoff.service.relay import sse_error_event
from handoff.service.upstream import UpstreamError, UpstreamResponse
from lb.errors import UpstreamFailed
from lb.node import Node, RequestLease
from lb.pd_logprobs import MERGE_ON_LOOP_BYTES, MergeInputLogprobs, stream_merge
from lb.pd_refusals import RefusalWatch, starts_with_refusal
from lb.relay import NodeCaller, buffered_response, relay_stream, translate

log = logging.getLogger(__name__)
rate_limit(log)  # a refusing or failing prefill node is a warning per request


class PairStreams:
    """One PD request's streamed answer, once both nodes took it; owns both responses and both in-flight leases.
    ``drains``: where the dispatcher keeps the background reads of prefill answers alive."""

    def __init__(self, caller: NodeCaller, path: str, watch: DisconnectWatch,
                 drains: set[asyncio.Task[None]]) -> None:
        self._caller = caller
        self._path = path
        self._watch = watch
        self._drains = drains

    async def _read_prefill(self, lease: RequestLease, upstream: UpstreamResponse) -> bytes:
        with lease:  # a 2xx answer
            return await self._caller.read_body(lease.node, upstream, self._path)

    async def relay_merged(self, prefill_lease: RequestLease, prefill_up: UpstreamResponse,
                           decode_lease: RequestLease, decode_up: UpstreamResponse) -> Response:
        """The decode stream relayed with the prefill's input logprobs merged into its events, once the prefill
        answer was read whole; the decode stream's first event is read meanwhile. A side's stream refusal is the
        client's answer as soon as it comes, and the other side's call is closed: a decode node that refused
        leaves the prefill node waiting for a decode node that never fetches the KV cache, a prefill node that
        refused leaves the decode node waiting for a KV cache that never comes."""
        prefill, decode = prefill_lease.node, decode_lease.node
        read = asyncio.ensure_future(self._read_prefill(prefill_lease, prefill_up))
        peek = asyncio.ensure_future(self._first_event(decode, decode_up))
        try:
            await asyncio.wait((read, peek), return_when=asyncio.FIRST_COMPLETED)
            if peek.done() and peek.result()[1]:
                _stop(read, prefill_up, prefill_lease)
                return relay_stream(decode_up, decode_lease, self._path, self._watch, cut=self._caller.streams_cut,
                                    head=peek.result()[0])
            raw = await read
            if starts_with_refusal(raw):
                _stop(peek, decode_up, decode_lease)
                _log_prefill_refusal(prefill, self._path, raw)
                return buffered_response(prefill_up, raw)
            merge = await _stream_merge(raw)
            head, _ = await peek
        except BaseException as exc:
            _stop(read, prefill_up, prefill_lease)
            _stop(peek, decode_up, decode_lease)
            if isinstance(exc, PeerJSONError):
                raise UpstreamFailed(f"cannot merge the input logprobs of {prefill.url} into the stream of "
                                     f"{decode.url}: {exc}", extra={"node": prefill.url}) from exc
            raise
        return relay_stream(decode_up, decode_lease, self._path, self._watch, cut=self._caller.streams_cut,
                            transform=merge, head=head, cut_for=functools.partial(_merge_failure, merge, prefill,
                                                                                  decode, self._path))

    async def _first_event(self, node: Node, upstream: UpstreamResponse) -> tuple[bytes, bool]:
        """What a stream sent until its first event that carries data came whole (or its end), and whether that
        event is a refusal; a failure is a 502/504 naming ``node``."""
        seen, head = RefusalWatch(), bytearray()
        try:
            while not seen.is_decided and (chunk := await upstream.next_chunk()):
                head += seen.feed(chunk)
        except UpstreamError as exc:
            node.record_error(str(exc))
            raise translate(node, self._path, exc, self._caller.timeout_s) from exc
        return bytes(head), seen.is_refusal

    def relay_beside_prefill(self, prefill_lease: RequestLease, prefill_up: UpstreamResponse,
                             decode_lease: RequestLease, decode_up: UpstreamResponse) -> Response:
        """The decode stream relayed while the prefill answer is read to its end beside it. Each side's stream
        refusal ends the other: the prefill's cuts the decode stream (its node waits for a KV cache that never
        comes) and ends the client's stream with that refusal; the decode's (or the client leaving) closes the
        prefill call (its node waits for a decode node that never fetches the KV cache)."""
        prefill_refusal: list[bytes] = []
        decode_seen = RefusalWatch()
        drain = asyncio.ensure_future(self._drain(prefill_lease, prefill_up, decode_up, prefill_refusal))
        self._drains.add(drain)
        drain.add_done_callback(self._drains.discard)
        # a drain cancelled before its first turn (the relay can end without yielding) never runs its own clean-up
        drain.add_done_callback(lambda _: (prefill_up.close(), prefill_lease.release()))

        def on_close(is_aborted: bool) -> None:
            if is_aborted or decode_seen.is_refusal:
                drain.cancel()

        return relay_stream(decode_up, decode_lease, self._path, self._watch, cut=self._caller.streams_cut,
                            transform=decode_seen,
                            on_close=on_close, cut_for=lambda: prefill_refusal[0] if prefill_refusal else None)

    async def _drain(self, lease: RequestLease, upstream: UpstreamResponse,
                     decode_up: UpstreamResponse, refusal: list[bytes]) -> None:
        """The prefill answer read to its end; a stream refusal is put in ``refusal`` and cuts ``decode_up``."""
        try:
            raw = await self._read_prefill(lease, upstream)
        except ServiceError as exc:  # the client already has the decode stream: log, nothing to answer
            log.warning("prefill answer lost while the decode stream went on: %s", exc.message)
            return
        finally:
            upstream.close()
        if starts_with_refusal(raw):
            _log_prefill_refusal(lease.node, self._path, raw)
            refusal.append(raw)
            decode_up.cut()


def _merge_failure(merge: MergeInputLogprobs, prefill: Node, decode: Node, path: str) -> bytes | None:
    """What ends a merged stream that reached a decode event of a prompt the prefill answer has no input logprobs
    for: an ``upstream_error`` event naming the prefill node (the decode node did not fail); None otherwise."""
    if merge.missing_index is None:
        return None
    message = (f"cannot merge the input logprobs of {prefill.url} into the stream of {decode.url} on {path}: "
               f"the prefill answer has none for prompt {merge.missing_index}")
    log.warning("%s", message)
    return sse_error_event(E.UPSTREAM_ERROR.name, message)


async def _stream_merge(prefill_raw: bytes) -> MergeInputLogprobs:
    """:func:`stream_merge`, on a thread for a large prefill answer (a long prompt's logprobs)."""
    if len(prefill_raw) > MERGE_ON_LOOP_BYTES:
        return await asyncio.to_thread(stream_merge, prefill_raw, in_turns=True)
    return stream_merge(prefill_raw)


def _stop(task: asyncio.Future[Any], upstream: UpstreamResponse, lease: RequestLease) -> None:
    """A side's read no longer wanted: cancelled, its response closed (which is how its node learns to abort;
    a task cancelled before its first turn closes nothing itself) and its in-flight count given back."""
    task.cancel()
    task.add_done_callback(_retrieved)
    upstream.close()
    lease.release()


def _retrieved(task: asyncio.Future[Any]) -> None:
    """Its failure is known to whoever stopped it (or moot): not one for asyncio to log as never retrieved."""
    if not task.cancelled():
        task.exception()


def _log_prefill_refusal(node: Node, path: str, raw: bytes) -> None:
    log.warning("prefill node %s refused the stream on %s; its decode call was closed: %s", node.url, path,
                raw[:512].decode("utf-8", "replace"))
