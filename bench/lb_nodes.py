"""Fake nodes for the load-balancer benchmark: many HTTP servers in one separate process (uvloop + httptools).

Each node answers as cheaply as possible, so that what a benchmark measures
is the router in front of it:

- ``GET /memory_occupation``: a sidecar's state (all tags resident, or all
  released once the node was released).
- ``GET /health``: 200. ``/server_info``, ``/model_info`` and their ``get_``
  forms: 404, so a router looks for no tokenizer (sglang-router would fetch one
  from a hub); other GETs: 404. A connection that does not speak HTTP/1.1 (a
  router probing for gRPC) is closed.
- ``POST /generate`` (``"stream": true`` in the body or not): ``decode`` and
  ``decode_paced`` nodes answer a completion (16 SSE chunks written back to
  back, or 1 ms apart); a ``prefill`` node answers the prefill part (what
  SGLang's prefill server sends, plus vLLM's ``kv_transfer_params``).
- The control calls (``CONTROL_ROUTES``): a sidecar's answer, at once
  (``instant``) or after 20 ms (``slow``), with the node's state in
  ``NODE_STATE_HEADER`` as a sidecar sends it, unless the node is made
  without (``sends_state=False``: an engine answered directly, or an older
  server), when the LB must ask ``/memory_occupation`` again.
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import re
from dataclasses import dataclass
from typing import Any

import httptools

from handoff.protocol.control import CONTROL_ROUTES, NODE_STATE_HEADER

SLOW_NODE_DELAY_S = 0.02
NUM_STREAM_CHUNKS = 16
_TAGS = ("weights", "kv_cache", "cuda_graph", "workspace")
DECODE_ANSWER = json.dumps({"text": "a short completion of a few words", "output_ids": list(range(16)),
                            "meta_info": {"prompt_tokens": 12, "completion_tokens": 16,
                                          "finish_reason": {"type": "stop", "matched": 2},
                                          "weight_version": "default"}}).encode()
PREFILL_ANSWER = json.dumps({"text": "", "meta_info": {"prompt_tokens": 12},
                             "kv_transfer_params": {"remote_engine_id": "bench", "remote_block_ids": [0]}}).encode()
RELEASE_ANSWER = json.dumps({"success": True, "released": [], "already_released": ["weights", "kv_cache"],
                             "bytes_freed": {}, "drained_requests": 0, "aborted_requests": 0,
                             "duration_s": 0.000012}).encode()
_STREAM_FLAG = re.compile(rb'"stream"\s*:\s*true')
_INFO_PATHS = frozenset({b"/server_info", b"/model_info", b"/get_server_info", b"/get_model_info"})
_CONTROL_PATHS = frozenset(path.encode() for path in CONTROL_ROUTES)


def sidecar_state(released: bool) -> bytes:
    """A sidecar's ``state_header``: the shape ``node_sidecar.node_views.state_view`` gives, compact (made once
    per state: a node here costs the router's fan-out as little time as it can)."""
    return _STATES[released]


def _encode_state(released: bool) -> bytes:
    tag_state = "released" if released else "resident"
    return json.dumps({
        "role": "mixed", "serving": not released, "admission": "open", "engine_reachable": True, "paused": False,
        "tags": {tag: {"state": tag_state, "bytes": 0 if released else 1 << 30} for tag in _TAGS},
        "weights_valid": True, "weight_version": "default", "weights_backup": None, "in_flight": 0, "held": 0,
    }, separators=(",", ":")).encode()


_STATES = {released: _encode_state(released) for released in (False, True)}


@dataclass(frozen=True)
class NodeSpec:
    """``behaviour``: ``prefill``, ``decode``, ``decode_paced``, ``instant`` or ``slow``; ``sends_state``:
    whether control answers carry the node's state header."""

    behaviour: str
    sends_state: bool = True


class _Node:
    """One fake node's state, shared by its connections."""

    def __init__(self, spec: NodeSpec) -> None:
        self.spec = spec
        self.is_released = False


class _Connection(asyncio.Protocol):
    def __init__(self, node: _Node) -> None:
        self.node = node
        self.parser = httptools.HttpRequestParser(self)
        self.loop = asyncio.get_running_loop()
        self.url = b""
        self.body = b""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:  # not HTTP/1.1 (an HTTP/2 preface): nothing to answer
            self.transport.close()

    def on_message_begin(self) -> None:
        self.url, self.body = b"", b""

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_body(self, body: bytes) -> None:
        self.body += body

    def on_message_complete(self) -> None:
        path = self.url.split(b"?")[0]
        behaviour = self.node.spec.behaviour
        if path == b"/generate":
            self._generate(behaviour, bool(_STREAM_FLAG.search(self.body)))
        elif path in _CONTROL_PATHS:
            self._control(path)
        elif path == b"/memory_occupation":
            self._answer(200, sidecar_state(self.node.is_released))
        elif path == b"/health":
            self._answer(200, b"{}")
        else:  # the routers' model and server info, anything else
            self._answer(404, b'{"detail": "Not Found"}')

    def _generate(self, behaviour: str, is_stream: bool) -> None:
        if behaviour == "prefill":
            self._stream(1) if is_stream else self._answer(200, PREFILL_ANSWER)
        else:
            self._stream(NUM_STREAM_CHUNKS) if is_stream else self._answer(200, DECODE_ANSWER)

    def _control(self, path: bytes) -> None:
        if path == b"/release_memory_occupation":
            self.node.is_released = True
            body = RELEASE_ANSWER
        else:
            body = b'{"success": true}'
        state = sidecar_state(self.node.is_released) if self.node.spec.sends_state else b""
        if self.node.spec.behaviour == "slow":
            self.loop.call_later(SLOW_NODE_DELAY_S, self._answer, 200, body, state)
        else:
            self._answer(200, body, state)

    def _answer(self, status: int, body: bytes, state: bytes = b"") -> None:
        if self.transport.is_closing():
            return
        reason = b"OK" if status == 200 else b"Not Found"
        extra = b"%s: %s\r\n" % (NODE_STATE_HEADER.encode(), state) if state else b""
        self.transport.write(b"HTTP/1.1 %d %s\r\nContent-Type: application/json\r\nContent-Length: %d\r\n%s\r\n%s"
                             % (status, reason, len(body), extra, body))

    def _stream(self, num_chunks: int) -> None:
        self.transport.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                             b"Transfer-Encoding: chunked\r\n\r\n")
        self._chunk(0, num_chunks)

    def _chunk(self, index: int, num_chunks: int) -> None:
        if self.transport.is_closing():
            return
        if index == num_chunks:
            self.transport.write(b"e\r\ndata: [DONE]\n\n\r\n0\r\n\r\n")
            return
        event = b'data: {"text": "token %d", "meta_info": {"completion_tokens": %d}}\n\n' % (index, index + 1)
        self.transport.write(b"%x\r\n%s\r\n" % (len(event), event))  # one write per chunk
        if self.node.spec.behaviour == "decode_paced":
            self.loop.call_later(0.001, self._chunk, index + 1, num_chunks)
        else:
            self._chunk(index + 1, num_chunks)


def _serve(specs: list[NodeSpec], conn: Any) -> None:
    import uvloop

    async def main() -> None:
        loop = asyncio.get_running_loop()
        ports = []
        for spec in specs:
            node = _Node(spec)
            server = await loop.create_server(lambda n=node: _Connection(n), "127.0.0.1", 0, backlog=1024)
            ports.append(server.sockets[0].getsockname()[1])
        conn.send(ports)
        await loop.run_in_executor(None, conn.recv)  # until the parent says stop

    uvloop.run(main())


class FakeNodes:
    """The nodes of ``specs``, each on its own loopback port, served by one child process while in scope."""

    def __init__(self, specs: list[NodeSpec]) -> None:
        self.specs = specs
        self.urls: list[str] = []

    def __enter__(self) -> "FakeNodes":
        self._parent, child = multiprocessing.Pipe()
        self._process = multiprocessing.Process(target=_serve, args=(self.specs, child), daemon=True)
        self._process.start()
        self.urls = [f"http://127.0.0.1:{port}" for port in self._parent.recv()]
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._parent.send("stop")
        self._process.join(10)
        if self._process.is_alive():
            self._process.kill()

    def of(self, behaviour: str, *, sends_state: bool = True) -> list[str]:
        """The URLs of the nodes with that behaviour (and header policy), in order."""
        return [url for url, spec in zip(self.urls, self.specs) if spec == NodeSpec(behaviour, sends_state)]
