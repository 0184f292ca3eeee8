"""Read Server-Sent Events the way a client would, and check their framing."""

from __future__ import annotations

import json
from typing import Any, Iterator

import httpx

DONE = "[DONE]"


def iter_events(response: httpx.Response) -> Iterator[str]:
    """The ``data:`` payloads of an SSE response, in order (``[DONE]`` included)."""
    buffer = ""
    for chunk in response.iter_text():
        buffer += chunk
        while "\n\n" in buffer:
            frame, buffer = buffer.split("\n\n", 1)
            for line in frame.replace("\r\n", "\n").split("\n"):  # not splitlines: U+2028 and co. are text
                if line.startswith("data: "):
                    yield line[len("data: "):]
    if buffer.strip():
        raise AssertionError(f"stream ended inside a frame: {buffer!r}")


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
