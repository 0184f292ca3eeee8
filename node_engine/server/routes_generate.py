"""``POST /generate``: SGLang's native generation, single or batch, ``n`` samples, stream or not."""

from __future__ import annotations

import asyncio
import json
from typing import Any, AsyncIterator

from fastapi import APIRouter, Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from handoff.protocol import errors as E
from handoff.protocol.generate_request import GenerateBody
from handoff.service.bodies import openapi_body, parse_body
from handoff.service.disconnect import CLIENT_CLOSED, unless_disconnected
from handoff.service.errors import ServiceError
from node_engine.engine import Engine
from node_engine.request import RequestOutput
from node_engine.server.generate_plan import GeneratePlan, plan_generate
from node_engine.server.generation import DONE_EVENT, generate_error_event, sse_event
from node_engine.server.generation_run import (GenerationRun, SequenceSpec, collect_unless_disconnected,
                                               first_unless_disconnected, stream_with_abort)

router = APIRouter()


@router.post("/generate", openapi_extra=openapi_body(GenerateBody))
async def generate(request: Request) -> Response:
    engine: Engine = request.app.state.engine
    body = await parse_body(request, GenerateBody)
    try:
        plan = await unless_disconnected(request, plan_generate(engine, body, request.app.state.images))
        run = GenerationRun(engine, plan.sequences, stream=body.stream) if plan.sequences else None
    except ServiceError as exc:
        # SGLang answers a stream 200 before its tokenizer manager checks the request: a refusal is an error
        # event, then [DONE]. A 503 stays a status: nothing ran, so the LB may send the request elsewhere.
        if body.stream and exc.status == E.INVALID_REQUEST.status:
            return _events(generate_error_event(exc), DONE_EVENT)
        raise
    if run is None:  # text: [] (SGLang: [], or a stream of only [DONE])
        return _events(DONE_EVENT) if body.stream else JSONResponse([])
    if body.stream:
        first = await first_unless_disconnected(request, run)
        if first is None:
            return Response(status_code=CLIENT_CLOSED)
        return StreamingResponse(stream_with_abort(run, _sse(engine, run, first, plan)),
                                 media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    answers = await collect_unless_disconnected(request, run)
    if answers is None:
        return Response(status_code=CLIENT_CLOSED)

    def respond() -> Response:
        results = [_with_prompt_ids(answer.answer(), spec, plan) for answer, spec in zip(answers, run.sequences)]
        if not plan.is_batch:
            return JSONResponse(results[0])
        # one sequence at a time: the JSON encoder holds the GIL for a whole call, the event loop gets it between
        return Response(b"[" + b",".join(_json(result) for result in results) + b"]", media_type="application/json")

    if any(spec.logprobs is not None for spec in run.sequences):  # maybe megabytes of JSON: off the loop
        return await asyncio.to_thread(respond)
    return respond()


def _events(*events: bytes) -> StreamingResponse:
    return StreamingResponse(iter(events), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


def _json(value: Any) -> bytes:
    """As :class:`JSONResponse` renders."""
    return json.dumps(value, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode("utf-8")


def _with_prompt_ids(payload: dict[str, Any], spec: SequenceSpec, plan: GeneratePlan) -> dict[str, Any]:
    if plan.return_prompt_token_ids:
        payload["prompt_token_ids"] = spec.prompt_ids
    return payload


async def _sse(engine: Engine, run: GenerationRun, first: tuple[AsyncIterator, tuple[int, RequestOutput]],
               plan: GeneratePlan) -> AsyncIterator[bytes]:
    """SGLang's stream: each event the whole answer so far, or only what is new with
    ``--incremental-streaming-output``; a batch's events carry ``index``."""
    events, head = first
    answers = run.answers()
    incremental = engine.config.incremental_streaming_output

    def event(index: int, out: RequestOutput) -> bytes:
        answer = answers[index]
        answer.add(run.chunk(index, out))
        payload = _with_prompt_ids(answer.event(incremental=incremental), run.sequences[index], plan)
        if plan.is_batch:
            payload["index"] = index
        return sse_event(payload)

    yield event(*head)
    try:
        async for index, out in events:
            yield event(index, out)
    except ServiceError as exc:
        # A failure mid-stream ends with an error event, then [DONE], as SGLang's stream_results ends it
        yield generate_error_event(exc) + DONE_EVENT
        return
    yield DONE_EVENT
