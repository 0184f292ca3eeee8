"""Read Server-Sent Events the way a client would, and check their framing."""

from __future__ import annotations

import json
from typing import Any, Iterator

import httpx

from handoff.protocol.sse import EventSplitter, event_data

DONE = "[DONE]"


def iter_events(response: httpx.Response) -> Iterator[str]:
    """The ``data:`` payloads of an SSE response, in order (``[DONE]`` included), framed by the product's own
    :class:`~handoff.protocol.sse.EventSplitter`."""
    splitter = EventSplitter()
    for chunk in response.iter_bytes():
        for event in splitter.feed(chunk):
            data = event_data(event)
            if data is not None:
                yield data.decode()
    rest = splitter.finish()
    if rest.strip():
        raise AssertionError(f"stream ended inside a frame: {rest!r}")


def read_stream(client: httpx.Client, url: str, body: dict[str, Any], **kwargs: Any) -> tuple[list[dict], bool]:
    """POST a streaming request; returns the JSON events and whether ``[DONE]`` ended the stream."""
    events: list[dict] = []
    saw_done = False
    with client.stream("POST", url, json=body, **kwargs) as response:
        response.raise_for_status()
        assert response.headers["content-type"].startswith("text/event-stream")
        for data in iter_events(response):
            if data == DONE:
                saw_done = True
                continue
            assert not saw_done, "data after [DONE]"
            events.append(json.loads(data))
    return events, saw_done
