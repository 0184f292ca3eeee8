"""A PD side's stream refusal: SGLang refuses a streamed request it cannot take (a duplicate ``rid``, a prompt too
long, ...) with a 200 whose first event is ``{"error": ...}`` and then ``[DONE]`` (``http_server.py``
``stream_results``). Such a side never runs the request, so the other side would wait for it in vain: a decode
node for a KV cache that never comes, a prefill node for a decode node that never fetches it."""

from __future__ import annotations

from handoff.protocol.sse import DONE, EventSplitter, EventTooLarge, event_data
from handoff.service.peer_json import PeerJSONError, loads_bounded
from handoff.service.relay import ChunkTransform
from handoff.service.upstream import UpstreamResponse

# a stream whose first event that carries data has not come whole within this many bytes is no refusal (SGLang's is
# one small event): what came before it (comments, empty events) is not gathered further while a side is waited for
MAX_PEEK_BYTES = 1 << 20


def is_refusal_event(event: bytes) -> bool | None:
    """Whether ``event`` (one whole SSE event) is an error envelope; None for an event that says nothing
    (no ``data:``, a comment)."""
    data = event_data(event)
    if data is None:
        return None
    if data.strip() == DONE:
        return False
    try:
        payload = loads_bounded(data)
    except PeerJSONError:
        return False
    return isinstance(payload, dict) and "error" in payload


def starts_with_refusal(raw: bytes, piece_bytes: int = 1 << 16) -> bool:
    """Whether the first event of the SSE body ``raw`` that carries data is an error envelope (the body is
    split only as far as that event)."""
    watch = RefusalWatch()
    for start in range(0, len(raw), piece_bytes):
        watch.feed(raw[start:start + piece_bytes])
        if watch.is_decided:
            break
    return watch.is_refusal


async def first_event(upstream: UpstreamResponse) -> tuple[bytes, bool]:
    """What a stream sent until its first event that carries data came whole (or its end, or
    :data:`MAX_PEEK_BYTES`), and whether that event is a refusal; raises what reading it raises."""
    seen, head = RefusalWatch(), bytearray()
    while not seen.is_decided and (chunk := await upstream.next_chunk()):
        head += seen.feed(chunk)
    return bytes(head), seen.is_refusal


class RefusalWatch(ChunkTransform):
    """Passes a stream through unchanged, noting whether its first event that carries data is a refusal
    (:attr:`is_refusal`); past that event, or past :data:`MAX_PEEK_BYTES` without it, it does no work."""

    def __init__(self) -> None:
        self.is_refusal = False
        self._splitter: EventSplitter | None = EventSplitter()
        self._num_bytes = 0

    @property
    def is_decided(self) -> bool:
        """Whether the first event that carries data went by (or :data:`MAX_PEEK_BYTES` without it, or the stream
        can no longer be read)."""
        return self._splitter is None

    def feed(self, chunk: bytes) -> bytes:
        if self._splitter is not None:
            try:
                events = self._splitter.feed(chunk)
            except EventTooLarge:  # the relay's own bound ends such a stream
                events, self._splitter = [], None
            for event in events:
                said = is_refusal_event(event)
                if said is not None:
                    self.is_refusal, self._splitter = said, None
                    break
            self._num_bytes += len(chunk)
            if self._num_bytes > MAX_PEEK_BYTES:
                self._splitter = None
        return chunk
