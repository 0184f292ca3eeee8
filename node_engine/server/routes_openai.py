"""OpenAI-compatible ``/v1/completions``, ``/v1/chat/completions`` and ``/v1/models``."""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any, AsyncIterator, Callable

from fastapi import APIRouter, Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from handoff.protocol.generation import finish_matched, finish_type
from handoff.service.bodies import openapi_body, parse_body
from handoff.service.errors import InvalidRequest, ServiceError
from node_engine.engine import Engine
from node_engine.request import RequestOutput
from node_engine.sampling import SamplingParams
from node_engine.server.generation import DONE_EVENT, check_prompt_length, sse_event, tokenize
from node_engine.server.generation_run import (GenerationRun, SequenceSpec, collect_unless_disconnected,
                                               first_unless_disconnected, stream_with_abort)
from node_engine.server.protocol import MAX_BATCH, ChatCompletionBody, CompletionBody
from node_engine.server.routes_generate import CLIENT_CLOSED
from node_engine.tokenizer import ChatTemplateError

router = APIRouter()


def _params(engine: Engine, body: CompletionBody | ChatCompletionBody, num_prompt: int,
            max_tokens: int | None) -> SamplingParams:
    stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
    try:
        return SamplingParams(
            max_new_tokens=engine.default_max_new_tokens(num_prompt) if max_tokens is None else max_tokens,
            temperature=body.temperature, top_p=body.top_p, top_k=body.top_k, stop=stop,
            stop_token_ids=tuple(body.stop_token_ids or ()), ignore_eos=body.ignore_eos, seed=body.seed)
    except ValueError as exc:
        raise InvalidRequest(str(exc)) from exc


def _check_model(engine: Engine, model: str | None) -> None:
    if model is not None and model != engine.config.model_name:
        raise InvalidRequest(f"model {model!r} is not served here; this engine serves {engine.config.model_name!r}")


def _usage(prompt: int, completion: int) -> dict[str, int]:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _finish(out: RequestOutput) -> str | None:
    return finish_type(out.finish_json)


class _Answer:
    """The OpenAI envelope of one answer (``object``, id, model, weight version), whole or streamed."""

    def __init__(self, engine: Engine, obj: str, id_prefix: str) -> None:
        self.engine = engine
        self.obj = obj
        self.id = f"{id_prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())

    def payload(self, choices: list[dict[str, Any]], usage: dict[str, int] | None = None,
                obj: str | None = None) -> dict[str, Any]:
        body: dict[str, Any] = {"id": self.id, "object": obj or self.obj, "created": self.created,
                                "model": self.engine.config.model_name,
                                "metadata": {"weight_version": self.engine.weight_version}, "choices": choices}
        if usage is not None:
            body["usage"] = usage
        return body

    async def stream(self, first: tuple[AsyncIterator[tuple[int, RequestOutput]], tuple[int, RequestOutput]],
                     num_prompts: int, choice: Callable[[int, RequestOutput], dict[str, Any]],
                     include_usage: bool, chunk_obj: str, preamble: dict[str, Any] | None = None,
                     ) -> AsyncIterator[bytes]:
        """The SSE body: one chunk per output; usage last if asked; an error event (and no [DONE]) on failure."""
        events, head = first
        totals = [(0, 0)] * num_prompts

        def chunk(index: int, out: RequestOutput) -> bytes:
            totals[index] = (out.num_prompt_tokens, out.num_output_tokens)
            return sse_event(self.payload([choice(index, out)], obj=chunk_obj))

        if preamble is not None:
            yield sse_event(self.payload([preamble], obj=chunk_obj))
        yield chunk(*head)
        try:
            async for index, out in events:
                yield chunk(index, out)
        except ServiceError as exc:
            yield sse_event(exc.envelope())
            return
        if include_usage:
            totals_usage = _usage(sum(p for p, _ in totals), sum(c for _, c in totals))
            yield sse_event(self.payload([], totals_usage, obj=chunk_obj))
        yield DONE_EVENT


@router.post("/v1/completions", openapi_extra=openapi_body(CompletionBody))
async def completions(request: Request) -> Response:
    engine: Engine = request.app.state.engine
    body = await parse_body(request, CompletionBody)
    _check_model(engine, body.model)
    prompt = body.prompt
    if isinstance(prompt, str):
        id_lists = await tokenize(engine, [prompt]) if prompt else []
    elif prompt and isinstance(prompt[0], str):
        if len(prompt) > MAX_BATCH:  # before any tokenizing
            raise InvalidRequest(f"at most {MAX_BATCH} prompts per request, got {len(prompt)}")
        id_lists = await tokenize(engine, prompt)  # type: ignore[arg-type]
    elif prompt and isinstance(prompt[0], list):
        id_lists = list(prompt)  # type: ignore[arg-type]
    else:
        id_lists = [list(prompt)] if prompt else []  # type: ignore[arg-type]
    if not id_lists or any(not ids for ids in id_lists):
        raise InvalidRequest("prompt must not be empty")
    if len(id_lists) > MAX_BATCH:
        raise InvalidRequest(f"at most {MAX_BATCH} prompts per request, got {len(id_lists)}")
    prompts = [SequenceSpec(ids, _params(engine, body, len(ids), body.max_tokens)) for ids in id_lists]
    run = GenerationRun(engine, prompts, stream=body.stream)
    answer = _Answer(engine, "text_completion", "cmpl")
    if body.stream:
        first = await first_unless_disconnected(request, run)
        if first is None:
            return Response(status_code=CLIENT_CLOSED)
        chunks = answer.stream(first, run.num_prompts, lambda i, out: {
            "index": i, "text": out.text_delta, "logprobs": None, "finish_reason": _finish(out)},
            include_usage=bool((body.stream_options or {}).get("include_usage")), chunk_obj="text_completion")
        return StreamingResponse(stream_with_abort(run, chunks), media_type="text/event-stream")
    results = await collect_unless_disconnected(request, run)
    if results is None:
        return Response(status_code=CLIENT_CLOSED)
    return JSONResponse(answer.payload(
        [{"index": i, "text": c.text, "logprobs": None, "finish_reason": finish_type(c.finish_reason),
          "matched_stop": finish_matched(c.finish_reason)} for i, c in enumerate(results)],
        _usage(sum(c.prompt_tokens for c in results), sum(c.completion_tokens for c in results))))


def _messages(body: ChatCompletionBody) -> list[dict[str, Any]]:
    messages = []
    for n, message in enumerate(body.messages):
        content = message.content
        if isinstance(content, list):
            parts = []
            for part in content:
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise InvalidRequest(f"messages.{n}.content: only text parts are supported")
                parts.append(part["text"])
            content = "".join(parts)
        messages.append({**message.model_dump(exclude_none=True), "content": content or ""})
    return messages


@router.post("/v1/chat/completions", openapi_extra=openapi_body(ChatCompletionBody))
async def chat_completions(request: Request) -> Response:
    engine: Engine = request.app.state.engine
    body = await parse_body(request, ChatCompletionBody)
    _check_model(engine, body.model)
    messages = _messages(body)
    check_prompt_length(engine, ["".join(str(m.get("content", "")) for m in messages)])
    try:  # rendered and tokenized off the event loop, like every prompt
        ids = await asyncio.to_thread(engine.tokenizer.apply_chat_template, messages)
    except ChatTemplateError as exc:
        raise InvalidRequest(str(exc)) from exc
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    run = GenerationRun(engine, [SequenceSpec(ids, _params(engine, body, len(ids), max_tokens))], stream=body.stream)
    answer = _Answer(engine, "chat.completion", "chatcmpl")
    if body.stream:
        first = await first_unless_disconnected(request, run)
        if first is None:
            return Response(status_code=CLIENT_CLOSED)
        chunks = answer.stream(first, 1, lambda i, out: {
            "index": i, "delta": {"content": out.text_delta}, "logprobs": None, "finish_reason": _finish(out)},
            include_usage=bool((body.stream_options or {}).get("include_usage")), chunk_obj="chat.completion.chunk",
            preamble={"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                      "finish_reason": None})
        return StreamingResponse(stream_with_abort(run, chunks), media_type="text/event-stream")
    results = await collect_unless_disconnected(request, run)
    if results is None:
        return Response(status_code=CLIENT_CLOSED)
    c = results[0]
    return JSONResponse(answer.payload(
        [{"index": 0, "message": {"role": "assistant", "content": c.text}, "logprobs": None,
          "finish_reason": finish_type(c.finish_reason), "matched_stop": finish_matched(c.finish_reason)}],
        _usage(c.prompt_tokens, c.completion_tokens)))


@router.get("/v1/models")
async def models(request: Request) -> JSONResponse:
    engine: Engine = request.app.state.engine
    return JSONResponse({"object": "list", "data": [{
        "id": engine.config.model_name, "object": "model", "created": 0, "owned_by": "handoff",
        "max_model_len": engine.runner.kv_plan.context_len}]})
