"""What a relay (the LB in front of a node, the sidecar in front of its engine) passes back from a peer's answer.

Only the headers that describe the relayed bytes or ask something of the
client: its type and encoding (a gzip body stays a gzip body), caching, a
``Retry-After`` and the request id. Framing headers (length, chunking,
connection) are the relay's own; anything else a peer says stays with it.
"""

from __future__ import annotations

from handoff.service.upstream import UpstreamResponse

RELAYED_RESPONSE_HEADERS = frozenset({b"content-type", b"content-encoding", b"cache-control", b"retry-after",
                                      b"x-request-id"})


def relayed_headers(upstream: UpstreamResponse, *, default_type: bytes | None = None) -> list[tuple[bytes, bytes]]:
    """The peer's headers a client gets, as raw ASGI headers (``default_type`` if it sent no type)."""
    headers = [(name, value) for name, value in upstream.headers if name in RELAYED_RESPONSE_HEADERS]
    if default_type is not None and not any(name == b"content-type" for name, _ in headers):
        headers.append((b"content-type", default_type))
    return headers
