"""Between HTTP and the engine: run the prompts of one HTTP request, stream or collect them.

Every prompt is checked before any is submitted, so a bad item in a batch
changes nothing. A client that goes away aborts whatever is still running.
Prompts too long to ever fit are refused before they are tokenized, and the
others are tokenized off the event loop (:func:`tokenize`): a megabyte prompt
costs the tokenizer seconds, and the loop must keep answering ``/health``
meanwhile, or the sidecar takes the engine for dead.
"""

from __future__ import annotations

import asyncio
import json
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

from starlette.requests import Request

from handoff.service.disconnect import ClientGone, unless_disconnected
from handoff.service.errors import InvalidRequest, ServiceError
from node_engine.engine import Engine, RequestHandle
from node_engine.errors import EngineStopped, MemoryReleased, StepFailed, WeightsNotLoaded
from node_engine.request import RequestOutput
from node_engine.sampling import SamplingParams
from node_engine.tokenizer import Tokenizer

DONE_EVENT = b"data: [DONE]\n\n"
_LONGEST_TOKEN_CHARS: "weakref.WeakKeyDictionary[Tokenizer, int]" = weakref.WeakKeyDictionary()


def longest_token_chars(tokenizer: Tokenizer) -> int:
    """The most characters one token of ``tokenizer`` decodes to (computed once per tokenizer: call it at
    start, a large vocabulary takes a fraction of a second)."""
    longest = _LONGEST_TOKEN_CHARS.get(tokenizer)
    if longest is None:
        longest = max((len(tokenizer.decode([i], skip_special_tokens=False)) for i in range(tokenizer.vocab_size)),
                      default=1)
        _LONGEST_TOKEN_CHARS[tokenizer] = longest
    return longest


def max_prompt_chars(engine: Engine) -> int:
    """More characters than any prompt that fits the context can have: every token stands for at most the
    longest token's characters (one more for a leading space a decoder drops, doubled for normalizers that
    shrink text)."""
    return engine.runner.kv_plan.context_len * (longest_token_chars(engine.tokenizer) + 1) * 2


def check_prompt_length(engine: Engine, texts: list[str]) -> None:
    """400 for a text that cannot fit the context whatever it tokenizes to, before any tokenizing: a
    megabyte prompt costs the tokenizer seconds, and it holds the event loop meanwhile."""
    limit = max_prompt_chars(engine)
    for text in texts:
        if len(text) > limit:
            raise InvalidRequest(f"a prompt of {len(text)} characters can never fit the context of "
                                 f"{engine.runner.kv_plan.context_len} tokens (at most {limit} characters)")


async def tokenize(engine: Engine, texts: list[str]) -> list[list[int]]:
    """The token ids of ``texts`` (each checked with :func:`check_prompt_length` first), computed in a worker
    thread so that the event loop is free whenever the tokenizer releases the GIL."""
    check_prompt_length(engine, texts)
    return await asyncio.to_thread(lambda: [engine.tokenizer.encode(text) for text in texts])


def sse_event(payload: Any) -> bytes:
    return b"data: " + json.dumps(payload, ensure_ascii=False).encode() + b"\n\n"


def output_error(output: RequestOutput) -> ServiceError:
    """The HTTP error for a request the engine refused or failed: a failed step is a 500 ``engine_failed``,
    a refusal a 503 naming why (nothing ran, so the request may go elsewhere)."""
    message = output.error or "request failed"
    if output.error_type == StepFailed.type:
        return StepFailed(message)
    if output.error_type == MemoryReleased.type:
        return MemoryReleased(message, retry_after=1)
    if output.error_type == WeightsNotLoaded.type:
        return WeightsNotLoaded(message)
    return EngineStopped(message)


@dataclass
class Completion:
    """Everything one prompt produced."""

    rid: str
    text: str = ""
    output_ids: list[int] = field(default_factory=list)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    finish_reason: str | None = None
    matched_stop: str | int | None = None

    def add(self, output: RequestOutput) -> None:
        self.text += output.text_delta
        self.output_ids.extend(output.token_ids_delta)
        self.prompt_tokens = output.num_prompt_tokens
        self.completion_tokens = output.num_output_tokens
        if output.finish_reason is not None:
            self.finish_reason = output.finish_reason.value
            self.matched_stop = output.matched_stop


class GenerationRun:
    """The engine requests of one HTTP request (one per prompt)."""

    def __init__(self, engine: Engine, prompts: list[tuple[list[int], SamplingParams]],
                 rids: list[str | None] | None = None, *, stream: bool = False) -> None:
        for ids, params in prompts:
            engine.check_request(ids, params)
        self.engine = engine
        self.started = time.monotonic()
        rids = rids or [None] * len(prompts)
        self.handles: list[RequestHandle] = [engine.submit(ids, params, rid, stream=stream) for (ids, params), rid
                                             in zip(prompts, rids, strict=True)]
        self._finished = [False] * len(self.handles)

    @property
    def num_prompts(self) -> int:
        return len(self.handles)

    def abort_unfinished(self) -> None:
        for handle, done in zip(self.handles, self._finished):
            if not done:
                self.engine.abort(handle.rid)

    async def events(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Outputs of every prompt as they come: ``(index, output)``; errors are raised."""
        if len(self.handles) == 1:
            handle = self.handles[0]
            while True:
                output = await handle.next()
                if output.error is not None:
                    self._finished[0] = True
                    raise output_error(output)
                self._finished[0] = output.is_final
                yield 0, output
                if output.is_final:
                    return
        merged: asyncio.Queue[tuple[int, RequestOutput]] = asyncio.Queue()

        async def pump(index: int, handle: RequestHandle) -> None:
            while True:
                output = await handle.next()
                await merged.put((index, output))
                if output.is_final:
                    return

        pumps = [asyncio.create_task(pump(i, h)) for i, h in enumerate(self.handles)]
        try:
            num_open = len(self.handles)
            while num_open:
                index, output = await merged.get()
                if output.is_final:
                    self._finished[index] = True
                    num_open -= 1
                if output.error is not None:
                    raise output_error(output)
                yield index, output
        finally:
            for task in pumps:
                task.cancel()

    async def collect(self) -> list[Completion]:
        completions = [Completion(rid=h.rid) for h in self.handles]
        async for index, output in self.events():
            completions[index].add(output)
        return completions


async def collect_unless_disconnected(request: Request, run: GenerationRun) -> list[Completion] | None:
    """Collect ``run``; if the client leaves first, abort it and return ``None``."""
    try:
        return await unless_disconnected(request, run.collect())
    except ClientGone:
        run.abort_unfinished()
        return None


async def stream_with_abort(run: GenerationRun, body: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """Relay ``body``; if the stream is closed early (client gone), abort what is unfinished."""
    try:
        async for chunk in body:
            yield chunk
    finally:
        run.abort_unfinished()


async def first_unless_disconnected(
        request: Request, run: GenerationRun,
) -> tuple[AsyncIterator[tuple[int, RequestOutput]], tuple[int, RequestOutput]] | None:
    """Wait for the first output, so a refusal becomes an HTTP status rather than a stream event.

    Returns the event iterator and its first item, or ``None`` (run aborted) if the client left first.
    """
    events = run.events()
    try:
        return events, await unless_disconnected(request, events.__anext__())
    except ClientGone:
        run.abort_unfinished()
        return None
