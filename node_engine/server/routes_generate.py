"""``POST /generate``: SGLang-shaped native generation, single or batch, stream or not."""

from __future__ import annotations

import time
from typing import Any, AsyncIterator

from fastapi import APIRouter, Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from handoff.service.bodies import openapi_body, parse_body
from handoff.service.errors import InvalidRequest, ServiceError
from node_engine.engine import Engine
from node_engine.request import RequestOutput
from node_engine.sampling import SamplingParams
from node_engine.server.generation import (DONE_EVENT, Completion, GenerationRun, collect_unless_disconnected,
                                           first_unless_disconnected, sse_event, stream_with_abort, tokenize)
from node_engine.server.protocol import MAX_BATCH, GenerateBody

router = APIRouter()
CLIENT_CLOSED = 499


async def build_prompts(engine: Engine, body: GenerateBody) -> tuple[list[tuple[list[int], SamplingParams]], bool]:
    """Tokenized prompts with their sampling params, and whether the request is a batch."""
    if (body.text is None) == (body.input_ids is None):
        raise InvalidRequest("give exactly one of text or input_ids")
    if body.return_logprob:
        raise InvalidRequest("return_logprob is not supported by this engine")
    if body.text is not None:
        is_batch = isinstance(body.text, list)
        texts = body.text if is_batch else [body.text]
        if any(not t for t in texts):
            raise InvalidRequest("text must not be empty")
        if len(texts) > MAX_BATCH:  # before any tokenizing
            raise InvalidRequest(f"a batch holds at most {MAX_BATCH} prompts, got {len(texts)}")
        id_lists = await tokenize(engine, texts)
    elif body.input_ids is None:  # unreachable after the check above; an explicit 400, not an assert
        raise InvalidRequest("give exactly one of text or input_ids")
    else:
        is_batch = bool(body.input_ids) and isinstance(body.input_ids[0], list)
        id_lists = body.input_ids if is_batch else [body.input_ids]  # type: ignore[list-item]
    if not id_lists:
        raise InvalidRequest("the batch is empty")
    if len(id_lists) > MAX_BATCH:
        raise InvalidRequest(f"a batch holds at most {MAX_BATCH} prompts, got {len(id_lists)}")
    sp = body.sampling_params
    prompts = []
    for ids in id_lists:
        default = engine.default_max_new_tokens(len(ids))
        try:
            params = sp.to_params(default) if sp is not None else SamplingParams(max_new_tokens=default)
        except ValueError as exc:
            raise InvalidRequest(f"sampling_params: {exc}") from exc
        prompts.append((list(ids), params))
    if body.rid is not None:
        rids = body.rid if isinstance(body.rid, list) else [body.rid]
        if len(rids) != len(prompts):
            raise InvalidRequest(f"rid has {len(rids)} entries for {len(prompts)} prompts")
    return prompts, is_batch


def _rids(body: GenerateBody) -> list[str | None] | None:
    if body.rid is None:
        return None
    return list(body.rid) if isinstance(body.rid, list) else [body.rid]


def meta_info(engine: Engine, rid: str, prompt_tokens: int, completion_tokens: int, finish_reason: str | None,
              matched_stop: Any, started: float) -> dict[str, Any]:
    return {"id": rid, "prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "finish_reason": finish_reason, "matched_stop": matched_stop, "weight_version": engine.weight_version,
            "e2e_latency": round(time.monotonic() - started, 6)}


def _result(engine: Engine, c: Completion, started: float) -> dict[str, Any]:
    return {"text": c.text, "output_ids": c.output_ids,
            "meta_info": meta_info(engine, c.rid, c.prompt_tokens, c.completion_tokens, c.finish_reason,
                                   c.matched_stop, started)}


@router.post("/generate", openapi_extra=openapi_body(GenerateBody))
async def generate(request: Request) -> Response:
    engine: Engine = request.app.state.engine
    body = await parse_body(request, GenerateBody)
    prompts, is_batch = await build_prompts(engine, body)
    run = GenerationRun(engine, prompts, _rids(body), stream=body.stream)
    if body.stream:
        first = await first_unless_disconnected(request, run)
        if first is None:
            return Response(status_code=CLIENT_CLOSED)
        return StreamingResponse(stream_with_abort(run, _sse(engine, run, first, is_batch)),
                                 media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    completions = await collect_unless_disconnected(request, run)
    if completions is None:
        return Response(status_code=CLIENT_CLOSED)
    results = [_result(engine, c, run.started) for c in completions]
    return JSONResponse(results if is_batch else results[0])


async def _sse(engine: Engine, run: GenerationRun, first: tuple[AsyncIterator, tuple[int, RequestOutput]],
               is_batch: bool) -> AsyncIterator[bytes]:
    events, head = first
    rids = [h.rid for h in run.handles]

    def event(index: int, out: RequestOutput) -> bytes:
        payload: dict[str, Any] = {
            "text": out.text_delta, "output_ids": out.token_ids_delta,
            "meta_info": meta_info(engine, rids[index], out.num_prompt_tokens, out.num_output_tokens,
                                   out.finish_reason.value if out.finish_reason else None, out.matched_stop,
                                   run.started)}
        if is_batch:
            payload["index"] = index
        return sse_event(payload)

    yield event(*head)
    try:
        async for index, out in events:
            yield event(index, out)
    except ServiceError as exc:
        # A failure mid-stream ends with an error event and no [DONE]: [DONE] means complete.
        yield sse_event(exc.envelope())
        return
    yield DONE_EVENT
