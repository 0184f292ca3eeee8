"""The envelope and choices of an OpenAI answer (SGLang 0.5.23's shapes), whole or streamed: ids, usage,
finish fields, and a chat stream's deltas (:mod:`node_engine.server.routes_openai` builds the requests)."""

from __future__ import annotations

import asyncio
import time
from typing import Any, AsyncIterator, Callable

from fastapi import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from handoff.protocol.generation import SequenceAnswer, SequenceChunk, finish_matched, finish_type
from handoff.service.disconnect import CLIENT_CLOSED
from handoff.service.errors import ServiceError
from handoff.service.json_pieces import render_in_pieces
from node_engine.engine import Engine
from node_engine.request import RequestOutput
from node_engine.server.generate_plan import GeneratePlan
from node_engine.server.generation import DONE_EVENT, openai_error, sse_event
from node_engine.server.generation_run import (GenerationRun, collect_unless_disconnected, first_unless_disconnected,
                                               stream_with_abort)
from node_engine.server.openai_bodies import ChatCompletionBody, CompletionBody
from node_engine.server.openai_shapes import usage

__all__ = ["Answer", "ChatDeltas", "Choice", "continuous_usage_of", "finish_fields", "include_usage_of",
           "render_in_pieces", "token_id_fields"]

# (index, chunk, first of its index) -> the choice of its stream chunk, or None for no chunk
Choice = Callable[[int, SequenceChunk, bool], dict[str, Any] | None]


def token_id_fields(body: CompletionBody | ChatCompletionBody, plan: GeneratePlan) -> Callable[[int, list[int], bool],
                                                                                         dict[str, Any]]:
    """The output ids' field of choice ``i`` (SGLang's ``return_token_ids``: ``token_ids`` in a completion,
    ``response_token_ids`` in a chat) and ``prompt_token_ids`` (chat's ``return_prompt_token_ids`` gives the
    prompt's alone); ``first``: the choice's first chunk of a stream."""
    with_outputs = body.return_token_ids
    with_prompt = with_outputs or getattr(body, "return_prompt_token_ids", False)
    outputs_key = "response_token_ids" if isinstance(body, ChatCompletionBody) else "token_ids"

    def fields(i: int, output_ids: list[int], first: bool) -> dict[str, Any]:
        out: dict[str, Any] = {outputs_key: list(output_ids)} if with_outputs else {}
        if with_prompt and first:
            out["prompt_token_ids"] = plan.sequences[i].prompt_ids
        return out
    return fields


def include_usage_of(body: CompletionBody | ChatCompletionBody) -> bool:
    return body.stream_options is not None and bool(body.stream_options.include_usage)


def continuous_usage_of(body: CompletionBody | ChatCompletionBody) -> bool:
    return body.stream_options is not None and bool(body.stream_options.continuous_usage_stats)


class Answer:
    """The OpenAI envelope of one answer (``object``, id, model, weight version), whole or streamed."""

    def __init__(self, engine: Engine, obj: str, rids: list[str], n: int, model: str | None, *,
                 completion_chunks: bool = False) -> None:
        """``rids``: the engine's request id of each choice. As SGLang's, the answer's ``id`` is the first's and
        a stream chunk's is its choice's, so a client can abort the request by the id it was given.
        ``completion_chunks``: stream chunks as SGLang dumps its ``CompletionStreamResponse``
        (``serving_completions.py``): ``usage`` on each, null unless continuous, and the usage chunk without its
        null fields (``exclude_none``). A chat's chunks carry ``usage`` only when it has one (its msgspec
        ``StreamChunk`` omits defaults) and its usage chunk keeps the nulls."""
        self.engine = engine
        self.completion_chunks = completion_chunks
        self.model = model or engine.config.model_name  # SGLang repeats the request's model
        self.obj = obj
        self.n = n
        self.rids = rids
        self.created = int(time.time())

    def payload(self, choices: list[dict[str, Any]], usage: dict[str, int] | None = None,
                obj: str | None = None, index: int = 0, version: str | None = None,
                versions: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        """``version``: the one its tokens were made under (a request aborted by a version update keeps its
        own); None for a chunk without tokens, which reports the version serving now. ``versions``: a whole
        answer's spans (SGLang's ``metadata.weight_versions``)."""
        metadata: dict[str, Any] = {"weight_version": version or self.engine.weight_version}
        if versions is not None:
            metadata["weight_versions"] = versions
        body: dict[str, Any] = {"id": self.rids[index], "object": obj or self.obj, "created": self.created,
                                "model": self.model, "metadata": metadata, "choices": choices}
        if usage is not None:
            body["usage"] = usage
        return body

    async def stream(self, run: GenerationRun, first: tuple[AsyncIterator[tuple[int, RequestOutput]],
                                                            tuple[int, RequestOutput]],
                     choice: Choice, *, include_usage: bool, continuous_usage: bool, chunk_obj: str,
                     preamble: Callable[[int], dict[str, Any]] | None = None,
                     finale: Callable[[int, SequenceChunk], dict[str, Any]] | None = None) -> AsyncIterator[bytes]:
        """The SSE body: a chunk per output that ``choice`` gives one for; then ``finale``'s chunk per choice
        (SGLang's chat streams end each choice with one, for its finish reason); usage last if asked; on a
        failure an error event, then ``[DONE]`` as SGLang's stream generators send it (``serving_chat.py``,
        ``serving_completions.py``: the ``except`` branch falls through to ``[DONE]``). ``continuous_usage``: each
        output's chunk carries its choice's usage so far (SGLang's ``continuous_usage_stats``)."""
        events, head = first
        last: dict[int, SequenceChunk] = {}

        def chunk(index: int, out: RequestOutput) -> bytes:
            piece = run.chunk(index, out)
            is_first = index not in last
            last[index] = piece
            lead = sse_event(self.payload([preamble(index)], obj=chunk_obj, index=index)) if is_first and preamble \
                else b""
            content = choice(index, piece, is_first)
            if content is None:
                return lead
            so_far = usage([piece], 1) if continuous_usage else None
            body = self.payload([content], so_far, obj=chunk_obj, index=index, version=piece.weight_version)
            if self.completion_chunks:
                body["usage"] = so_far
            return lead + sse_event(body)

        yield chunk(*head)
        try:
            async for index, out in events:
                yield chunk(index, out)
        except ServiceError as exc:
            yield sse_event(openai_error(exc).envelope()) + DONE_EVENT
            return
        if finale is not None:
            for index in sorted(last):
                yield sse_event(self.payload([finale(index, last[index])], obj=chunk_obj, index=index,
                                             version=last[index].weight_version))
        if include_usage:
            total = usage([last[i] for i in sorted(last)], self.n)
            if self.completion_chunks:
                total = {key: value for key, value in total.items() if value is not None}
            yield sse_event(self.payload([], total, obj=chunk_obj))
        yield DONE_EVENT

    async def respond(self, request: Request, run: GenerationRun, choice: Callable[[int, SequenceAnswer], dict],
                      stream_choice: Choice, *, stream: bool, include_usage: bool, continuous_usage: bool,
                      chunk_obj: str, preamble: Callable[[int], dict[str, Any]] | None = None,
                      finale: Callable[[int, SequenceChunk], dict[str, Any]] | None = None) -> Response:
        if stream:
            first = await first_unless_disconnected(request, run)
            if first is None:
                return Response(status_code=CLIENT_CLOSED)
            chunks = self.stream(run, first, stream_choice, include_usage=include_usage,
                                 continuous_usage=continuous_usage, chunk_obj=chunk_obj, preamble=preamble,
                                 finale=finale)
            return StreamingResponse(stream_with_abort(run, chunks), media_type="text/event-stream")
        answers = await collect_unless_disconnected(request, run)
        if answers is None:
            return Response(status_code=CLIENT_CLOSED)
        if any(spec.logprobs is not None for spec in run.sequences):
            # a dict per token and per top entry, then their JSON: on a thread and in pieces, so the event loop
            # keeps its turns (64 chat choices of 100 tokens with 64 top logprobs each held it 4 to 8.5 s, 200
            # tokens 11.5 s: past the sidecar's 5 s health timeout)
            whole = await asyncio.to_thread(lambda: render_in_pieces(self._whole(answers, choice)).encode())
            return Response(whole, media_type="application/json")
        return JSONResponse(self._whole(answers, choice))

    def _whole(self, answers: list[SequenceAnswer], choice: Callable[[int, SequenceAnswer], dict]) -> dict[str, Any]:
        return self.payload([choice(i, a) for i, a in enumerate(answers)], usage(answers, self.n),
                            version=answers[-1].weight_version if answers else None,
                            versions=answers[-1].weight_versions if answers else None)


def finish_fields(reason: dict | None) -> dict[str, Any]:
    return {"finish_reason": finish_type(reason), "matched_stop": finish_matched(reason)}


class ChatDeltas:
    """A chat stream's choices, as SGLang's stream loop sends them (``serving_chat.py``
    ``_generate_stream_content``): a chunk only for an output with text, so an output whose tokens decode to no
    text yet (part of a character, a stop string held back) sends none. Its logprobs wait for the choice's next
    chunk, or its finish chunk, so each token's reaches the client (SGLang drops them)."""

    def __init__(self, lists: Callable[[Any, Any], dict[str, Any] | None]) -> None:
        self.lists = lists
        self.tokens: dict[int, list[Any]] = {}
        self.tops: dict[int, list[Any]] = {}

    def _take(self, index: int) -> dict[str, Any] | None:
        tokens, tops = self.tokens.pop(index, []), self.tops.pop(index, [])
        return self.lists(tokens, tops) if tokens else None

    def choice(self, index: int, piece: SequenceChunk, first: bool) -> dict[str, Any] | None:
        self.tokens.setdefault(index, []).extend(piece.output_token_logprobs)
        self.tops.setdefault(index, []).extend(piece.output_top_logprobs)
        if not piece.text:
            return None
        return {"index": index, "delta": {"content": piece.text, "reasoning_content": None},
                "logprobs": self._take(index), "finish_reason": None, "matched_stop": None}

    def finale(self, index: int, piece: SequenceChunk) -> dict[str, Any]:
        return {"index": index, "delta": {"reasoning_content": None}, "logprobs": self._take(index),
                **finish_fields(piece.finish_reason)}
