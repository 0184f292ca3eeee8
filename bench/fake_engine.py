"""A fake engine for sidecar benchmarks: answers at once, over raw asyncio + httptools (uvloop).

It speaks just enough of the engine's HTTP API (SPEC section 5) for a real
``python -m node_sidecar`` to consider it serving and to release and resume it,
and costs as little CPU as possible so that what is measured is the sidecar:

- ``GET /health``, ``GET /memory_occupation`` (the shape of
  ``node_engine.engine.Engine.occupation``: every tag, weights valid, memory
  saver on), ``POST /release_memory_occupation`` and
  ``POST /resume_memory_occupation`` (the engine's answers, tag states kept),
  ``POST /abort_request`` (ends held streams with ``finish_reason: abort``),
  ``POST /flush_cache``.
- ``POST /generate``: an SGLang-shaped JSON answer, or with ``"stream": true``
  in the body, ``--stream-chunks`` SSE events then ``data: [DONE]``, chunked
  like uvicorn (one write per event). Query parameters shape the answer:
  ``delay_ms=D`` answers a non-stream request after ``D`` ms; ``pace_ms=P``
  writes the events ``P`` ms apart instead of all at once; ``hold=1`` writes
  the first event and then one every ``--hold-tick-ms`` until
  ``POST /_bench/end_streams`` ends the held streams.
- ``POST /_bench/end_streams?gap_ms=G``: end every held stream, ``G`` ms apart,
  each with a final event and ``[DONE]``. ``GET /_bench/timings`` tells, on this
  process's ``time.perf_counter`` clock, when the last held stream's final
  byte was written and when each ``/release_memory_occupation`` arrived (and
  how many streams are held and connections open); ``POST /_bench/reset``
  forgets the times.

    python bench/fake_engine.py --port 0 --port-file /tmp/engine.port
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from pathlib import Path
from typing import cast
from urllib.parse import parse_qs

import httptools

TAGS = ("weights", "kv_cache", "cuda_graph", "workspace")
TAG_BYTES = {"weights": 1 << 30, "kv_cache": 4 << 30, "cuda_graph": 256 << 20, "workspace": 64 << 20}
GENERATE_ANSWER = json.dumps({
    "text": " a short completion of sixteen tokens, more or less, as a fast engine would answer",
    "output_ids": list(range(1000, 1016)),
    "meta_info": {"id": "c0ffee", "prompt_tokens": 12, "completion_tokens": 16,
                  "finish_reason": {"type": "stop", "matched": 2}, "weight_version": "default", "e2e_latency": 0.001}}
).encode()
_STREAM_HEAD = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncache-control: no-cache\r\n"
                b"transfer-encoding: chunked\r\n\r\n")
_DONE_CHUNK = b"e\r\ndata: [DONE]\n\n\r\n"
_LAST_CHUNK = b"0\r\n\r\n"


def _event(index: int, finish_reason: str | None) -> bytes:
    """One SSE event as the engine writes it, framed as one HTTP chunk."""
    reason = b"null" if finish_reason is None else b'{"type": "%s"}' % finish_reason.encode()
    event = (b'data: {"text": " tok%d", "output_ids": [%d], "meta_info": {"id": "c0ffee", "prompt_tokens": 12, '
             b'"completion_tokens": %d, "finish_reason": %s, "weight_version": "default", '
             b'"e2e_latency": 0.001}}\n\n' % (index, 1000 + index, index + 1, reason))
    return b"%x\r\n%s\r\n" % (len(event), event)


class EngineState:
    """What the fake engine remembers across connections."""

    def __init__(self, num_stream_chunks: int, hold_tick_s: float) -> None:
        self.num_stream_chunks = num_stream_chunks
        self.hold_tick_s = hold_tick_s
        self.tags = {t: "resident" for t in TAGS}
        self.held: list[HeldStream] = []
        self.last_held_end: float | None = None
        self.release_arrivals: list[float] = []
        self.num_connections = 0

    def occupation(self) -> bytes:
        return json.dumps({
            "tags": {t: {"state": self.tags[t], "bytes": TAG_BYTES[t]} for t in TAGS},
            "weights_valid": self.tags["weights"] == "resident", "weight_version": "default",
            "memory_saver": "fake", "weights_backup": "none",
            "device": {"type": "cpu", "free_bytes": 1 << 34, "total_bytes": 1 << 35},
            "process_rss_bytes": 1 << 28, "running_requests": len(self.held), "queued_requests": 0}).encode()

    def release(self, body: bytes) -> bytes:
        started = time.perf_counter()
        wanted = json.loads(body or b"{}").get("tags") or list(TAGS)
        released = [t for t in wanted if self.tags[t] == "resident"]
        already = [t for t in wanted if self.tags[t] == "released"]
        for tag in released:
            self.tags[tag] = "released"
        return json.dumps({"success": True, "released": released, "already_released": already,
                           "bytes_freed": {t: TAG_BYTES[t] for t in released},
                           "duration_s": round(time.perf_counter() - started, 6)}).encode()

    def resume(self, body: bytes) -> bytes:
        started = time.perf_counter()
        wanted = json.loads(body or b"{}").get("tags") or list(TAGS)
        resumed = [t for t in wanted if self.tags[t] == "released"]
        already = [t for t in wanted if self.tags[t] == "resident"]
        for tag in resumed:
            self.tags[tag] = "resident"
        return json.dumps({"success": True, "resumed": resumed, "already_resident": already,
                           "bytes_restored": {t: TAG_BYTES[t] for t in resumed},
                           "weights_valid": self.tags["weights"] == "resident",
                           "duration_s": round(time.perf_counter() - started, 6)}).encode()

    def end_held(self, gap_s: float, finish_reason: str) -> int:
        """End every held stream, ``gap_s`` apart (0: all in this turn of the loop)."""
        streams, self.held = self.held, []
        loop = asyncio.get_running_loop()
        for index, stream in enumerate(streams):
            if gap_s:
                loop.call_later(index * gap_s, stream.end, finish_reason)
            else:
                stream.end(finish_reason)
        return len(streams)


class HeldStream:
    """A stream that ticks until it is told to end."""

    def __init__(self, state: EngineState, transport: asyncio.Transport) -> None:
        self.state = state
        self.transport = transport
        self.index = 0
        self.timer: asyncio.TimerHandle | None = None

    def start(self) -> None:
        self.transport.write(_STREAM_HEAD)
        self.tick()

    def tick(self) -> None:
        if self.transport.is_closing():
            return
        self.transport.write(_event(self.index, None))
        self.index += 1
        self.timer = asyncio.get_running_loop().call_later(self.state.hold_tick_s, self.tick)

    def end(self, finish_reason: str) -> None:
        if self.timer is not None:
            self.timer.cancel()
        if self.transport.is_closing():
            return
        self.transport.write(_event(self.index, finish_reason) + _DONE_CHUNK + _LAST_CHUNK)
        self.state.last_held_end = time.perf_counter()


class EngineProtocol(asyncio.Protocol):
    """One HTTP/1.1 keep-alive connection; requests are answered in order, one at a time."""

    def __init__(self, state: EngineState) -> None:
        self.state = state
        self.parser = httptools.HttpRequestParser(self)
        self.loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self.url = b""
        self.body = b""
        self.arrived = 0.0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's transports do not subclass asyncio's
        self.state.num_connections += 1

    def connection_lost(self, exc: Exception | None) -> None:
        self.state.num_connections -= 1
        self.state.held = [s for s in self.state.held if s.transport is not self.transport]

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            assert self.transport is not None
            self.transport.close()

    def on_message_begin(self) -> None:
        self.url, self.body = b"", b""
        self.arrived = time.perf_counter()

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_body(self, body: bytes) -> None:
        self.body += body

    def on_message_complete(self) -> None:
        path, _, query = self.url.partition(b"?")
        state = self.state
        if path == b"/generate":
            params = parse_qs(query.decode()) if query else {}
            if b'"stream": true' not in self.body and b'"stream":true' not in self.body:
                if "delay_ms" in params:
                    self.loop.call_later(float(params["delay_ms"][0]) / 1000, self._json, GENERATE_ANSWER)
                else:
                    self._json(GENERATE_ANSWER)
            else:
                if "hold" in params:
                    assert self.transport is not None
                    stream = HeldStream(state, self.transport)
                    state.held.append(stream)
                    stream.start()
                else:
                    pace_s = float(params["pace_ms"][0]) / 1000 if "pace_ms" in params else 0.0
                    self._stream(0, pace_s)
        elif path == b"/health":
            self._json(b'{"status": "ok"}')
        elif path == b"/memory_occupation":
            self._json(state.occupation())
        elif path == b"/release_memory_occupation":
            state.release_arrivals.append(self.arrived)
            self._json(state.release(self.body))
        elif path == b"/resume_memory_occupation":
            self._json(state.resume(self.body))
        elif path == b"/abort_request":
            state.end_held(0.0, "abort")
            self._json(b'{"success": true, "aborted": "all"}')
        elif path == b"/flush_cache":
            self._json(b'{"success": true}')
        elif path == b"/_bench/end_streams":
            params = parse_qs(query.decode()) if query else {}
            gap_s = float(params["gap_ms"][0]) / 1000 if "gap_ms" in params else 0.0
            self._json(json.dumps({"ended": state.end_held(gap_s, "stop")}).encode())
        elif path == b"/_bench/timings":
            self._json(json.dumps({"last_held_end": state.last_held_end, "release_arrivals": state.release_arrivals,
                                   "held_streams": len(state.held),
                                   "open_connections": state.num_connections}).encode())
        elif path == b"/_bench/reset":
            state.last_held_end = None
            state.release_arrivals = []
            self._json(b'{"success": true}')
        else:
            self._json(b'{"error": {"type": "not_found", "message": "no such endpoint"}}', b"404 Not Found")

    def _json(self, body: bytes, status: bytes = b"200 OK") -> None:
        assert self.transport is not None
        if not self.transport.is_closing():
            self.transport.write(b"HTTP/1.1 %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
                                 % (status, len(body), body))

    def _stream(self, index: int, pace_s: float) -> None:
        """Event ``index`` onwards: all at once, or one every ``pace_s``."""
        transport = self.transport
        assert transport is not None
        if index == 0:
            transport.write(_STREAM_HEAD)
        num_chunks = self.state.num_stream_chunks
        while index < num_chunks:
            if transport.is_closing():
                return
            transport.write(_event(index, "stop" if index == num_chunks - 1 else None))
            index += 1
            if pace_s and index < num_chunks:
                self.loop.call_later(pace_s, self._stream, index, pace_s)
                return
        transport.write(_DONE_CHUNK + _LAST_CHUNK)


async def serve(host: str, port: int, port_file: Path | None, state: EngineState) -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: EngineProtocol(state), host, port, backlog=2048)
    bound = server.sockets[0].getsockname()[1]
    if port_file is not None:
        tmp = port_file.with_suffix(".tmp")
        tmp.write_text(str(bound))
        os.replace(tmp, port_file)
    async with server:
        await server.serve_forever()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--port-file", type=Path, default=None)
    parser.add_argument("--stream-chunks", type=int, default=16, help="SSE events per stream, [DONE] aside")
    parser.add_argument("--hold-tick-ms", type=float, default=10.0, help="event interval of a held stream")
    args = parser.parse_args()
    state = EngineState(args.stream_chunks, args.hold_tick_ms / 1000)
    import uvloop

    uvloop.run(serve(args.host, args.port, args.port_file, state))


if __name__ == "__main__":
    main()
