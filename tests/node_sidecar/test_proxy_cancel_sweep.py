"""A generation's place in flight under a cancellation at every step of its life in the sidecar.

One request goes through :func:`node_sidecar.proxy.relay_generation` and its answer is sent as the fast path
sends it (held, admitted on resume, the engine's answer opened, read or streamed, sent); at each loop step in
turn, the serving task is cancelled, or the client disconnects (seen by the real :class:`DisconnectWatch`).
Whatever the step, the place in flight and the body's bytes are given back exactly once and a drain-mode release
proceeds. The engine and the node around admission are stand-ins (fault injection: a cancellation at a chosen
await cannot be timed over real HTTP); the steps are loop steps, never time.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any, cast

import pytest
from starlette.requests import Request

from handoff.service.errors import Unavailable
from node_sidecar.admission import Admission, HoldLimits
from node_sidecar.engines.base import GenerationCall
from node_sidecar.inflight_bytes import InFlightBytes
from node_sidecar.proxy import relay_generation

pytestmark = pytest.mark.timeout(30)

OPEN_AT, ENGINE_AT, ANSWER_AT = 3, 6, 9  # the loop steps at which admission opens, the engine answers, reads
NUM_STEPS = 16  # past the last: by then an unharmed request has been answered whole


class _Upstream:
    status, url, deadline = 200, "http://engine/generate", None

    def __init__(self, content_type: str, answered: asyncio.Event) -> None:
        self.content_type = content_type
        self.headers = [(b"content-type", content_type.encode())]
        self._answered = answered
        self._chunks = [b'data: {"text": "x"}\n\n', b"data: [DONE]\n\n"]

    async def next_chunk(self) -> bytes:
        await self._answered.wait()
        return self._chunks.pop(0) if self._chunks else b""

    def close(self) -> None:
        pass


class _Engine:
    def __init__(self, content_type: str) -> None:
        self.content_type = content_type
        self.opened, self.answered = asyncio.Event(), asyncio.Event()

    async def open(self, *args: Any, **kwargs: Any) -> _Upstream:
        await self.opened.wait()
        return _Upstream(self.content_type, self.answered)

    async def read(self, upstream: _Upstream, max_bytes: int, **kwargs: Any) -> bytes:
        await self.answered.wait()
        kwargs["count"](12)
        return b'{"text": "x"}'


class _Adapter:
    screens_media = False

    def generation_call(self, path: str, body: bytes, query: str) -> GenerationCall:
        return GenerationCall(path, body)


def _node(engine: _Engine) -> Any:
    admission = Admission(refuse=lambda: Unavailable("closed", type="node_released", retry_after=1),
                          hold_limits=lambda: HoldLimits(4, 60.0, 1 << 20))
    adapter = _Adapter()
    return SimpleNamespace(admission=admission, adapter=adapter, engine_adapter=adapter, engine=engine,
                           inflight_bytes=InFlightBytes(1 << 20), state=SimpleNamespace(weight_version="v"),
                           config=SimpleNamespace(generate_timeout=60.0, max_answer_bytes=1 << 20),
                           mark_unreachable=lambda exc: None)


@pytest.mark.parametrize("fault", ["cancel", "disconnect"])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("step", [*range(NUM_STEPS), None])
async def test_a_cancel_at_any_step_gives_the_place_in_flight_back_once(step: int | None, stream: bool,
                                                                       fault: str) -> None:
    engine = _Engine("text/event-stream" if stream else "application/json")
    node = _node(engine)
    admission = cast(Admission, node.admission)
    gone = asyncio.Event()
    bodies = [{"type": "http.request", "body": b'{"text": "hi"}', "more_body": False}]
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        if bodies:
            return bodies.pop(0)
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        await asyncio.sleep(0)  # the transport takes it
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": "/generate", "query_string": b"",
             "headers": [(b"content-type", b"application/json")]}

    async def serve() -> None:  # as the generation fast path serves it
        response = await relay_generation(node, Request(scope, receive), "/generate")
        await response(scope, receive, send)

    task = asyncio.create_task(serve())
    stages = {OPEN_AT: admission.open, ENGINE_AT: engine.opened.set, ANSWER_AT: engine.answered.set}
    strike = {"cancel": task.cancel, "disconnect": gone.set}[fault]
    for n in range(NUM_STEPS + 4):
        if n in stages:
            stages[n]()
        if n == step:  # in a stage's own step, right after it
            strike()
        await asyncio.sleep(0)
    await asyncio.wait({task}, timeout=5)
    assert task.done()
    if step is None:
        assert not task.cancelled() and task.exception() is None
        assert sent[-1].get("more_body", False) is False  # answered whole
    elif not task.cancelled():
        assert task.exception() is None  # a disconnect is absorbed: the request ends quietly
    assert admission.num_in_flight == 0 and admission.num_held == 0 and admission.held_bytes == 0
    assert node.inflight_bytes.in_use == 0
    admission.close()
    assert await admission.drain(0.05) is True  # a drain-mode release proceeds
