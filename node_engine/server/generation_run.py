"""The engine requests of one HTTP request, run together: submitted, merged, collected or streamed, aborted.

Every sequence is checked before any is submitted, so a bad item in a batch
changes nothing; one within the context that the KV pool cannot hold to its
``max_new_tokens`` has that cut to what the pool holds (as SGLang's scheduler
does) and ends on its length. A client that goes away aborts whatever is still running, and
so does a sequence that fails: its siblings are aborted before the error is
raised.

``n`` samples share their prompt. When a prompt has more than one sequence
(and the prefix cache is on), a prefill-only request computes that prompt
first and leaves its KV to the prefix cache; the samples are submitted when it
is done, and each reuses all of the prompt but its last token: the prompt is
prefilled once, not ``n`` times (SGLang does the same, in
``TokenizerManager._handle_batch_request``). The samples' ids are held from
the start (``RequestGate.plan``): an abort that names one of them while the
prompt is prefilled makes that sample answer ``abort`` without running (an
abort of all, every sample); its siblings run.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass, replace
from typing import AsyncIterator

from starlette.requests import Request

from handoff.protocol.generate_sequences import LogprobOptions
from handoff.protocol.generation import LogprobShape, SequenceAnswer, SequenceChunk, finish_abort_waiting
from handoff.service.disconnect import ClientGone, unless_disconnected
from node_engine.engine import Engine
from node_engine.request import FinishReason, RequestHandle, RequestOutput
from node_engine.sampling import SamplingParams
from node_engine.server.answer_chunks import chunk_of
from node_engine.server.generation import output_error
from node_engine.vision.inputs import MultimodalPrompt

_PREFILL_ONLY = SamplingParams(max_new_tokens=0)


@dataclass(frozen=True)
class SequenceSpec:
    """One engine request: its prompt, parameters, id and logprob options."""

    prompt_ids: list[int]
    params: SamplingParams
    rid: str | None = None
    logprobs: LogprobOptions | None = None
    use_prefix_cache: bool = True
    prompt_index: int = 0   # sequences with the same index share one prompt (its n samples)
    mm: MultimodalPrompt | None = None  # the prompt's images (placeholders already expanded in prompt_ids)


def _own(mm: MultimodalPrompt | None) -> MultimodalPrompt | None:
    """Each request owns its image features (a prefill drops them): samples of one prompt get copies."""
    return None if mm is None else mm.fresh()


def _aborted_before_it_ran(rid: str, spec: SequenceSpec) -> RequestHandle:
    """A handle holding a sequence's final output, ``abort`` before it ran, that never reaches the engine."""
    handle = RequestHandle(rid)
    handle.put(RequestOutput(rid, "", [], len(spec.prompt_ids), 0, finish_reason=FinishReason.ABORT,
                             finish_json=finish_abort_waiting()))
    return handle


def logprob_shape(options: LogprobOptions | None) -> LogprobShape | None:
    if options is None:
        return None
    return LogprobShape(top_logprobs=options.top_logprobs_num > 0, token_ids=options.token_ids is not None)


class GenerationRun:
    """The engine requests of one HTTP request (one per sequence)."""

    def __init__(self, engine: Engine, sequences: list[SequenceSpec], *, stream: bool = False) -> None:
        for spec in sequences:
            engine.gate.check(spec.prompt_ids, spec.params, spec.logprobs)
        sequences = [replace(spec, params=engine.gate.cap_new_tokens(len(spec.prompt_ids), spec.params))
                     for spec in sequences]
        self.engine = engine
        self.sequences = sequences
        self.stream = stream
        self.started = time.monotonic()
        self.rids = [spec.rid or f"req-{uuid.uuid4().hex[:16]}" for spec in sequences]
        engine.gate.check_rids_free(self.rids)  # before any is submitted: nothing runs if one is taken
        self.handles: list[RequestHandle] = []
        self._finished = [False] * len(sequences)
        shared = self._shared_prompts()
        self._plan = engine.gate.plan(self.rids) if shared else None
        # A prefill's id is the engine's own, never derived from a client's id (SGLang regenerates it too): a
        # client may well have a request running under "<rid>_0-prefill", which an abort of ours would then end.
        self._prefills = [engine.submit(sequences[first].prompt_ids, _PREFILL_ONLY, f"prefill-{uuid.uuid4().hex}",
                                        mm=_own(sequences[first].mm), prefill=True)
                          for first in shared]
        if not self._prefills:
            self._submit()

    def _shared_prompts(self) -> list[int]:
        """The first sequence of every prompt that more than one sequence uses (and may share through the cache)."""
        if not self.engine.has_prefix_cache:
            return []
        firsts: dict[int, int] = {}
        shared: set[int] = set()
        for index, spec in enumerate(self.sequences):
            if not spec.use_prefix_cache:
                continue
            if spec.prompt_index in firsts:
                shared.add(spec.prompt_index)
            firsts.setdefault(spec.prompt_index, index)
        return [firsts[prompt] for prompt in sorted(shared)]

    def _submit(self, aborted: set[str] | frozenset[str] = frozenset()) -> None:
        """Submit every sequence but those in ``aborted``, which answer ``abort`` without reaching the engine."""
        self.handles = [_aborted_before_it_ran(rid, spec) if rid in aborted else
                        self.engine.submit(spec.prompt_ids, spec.params, rid, stream=self.stream, mm=_own(spec.mm),
                                           logprobs=spec.logprobs, use_prefix_cache=spec.use_prefix_cache)
                        for spec, rid in zip(self.sequences, self.rids, strict=True)]

    async def _prefill_shared_prompts(self) -> None:
        """Wait for the shared prompts' prefills (a refusal is raised), then submit every sequence; one that an
        abort named meanwhile answers ``abort`` instead."""
        plan = self._plan
        try:
            try:
                for handle in self._prefills:
                    output = await handle.next()
                    if output.error is not None:
                        self._finished = [True] * len(self._finished)
                        raise output_error(output)
            finally:
                prefills, self._prefills = self._prefills, []
                for handle in prefills:
                    self.engine.abort(handle.rid)  # a no-op for those that finished
            self._submit(plan.aborted if plan is not None else frozenset())  # each id claimed before the plan lets go
        finally:
            if plan is not None:
                plan.close()

    @property
    def num_prompts(self) -> int:
        return len(self.sequences)

    def abort_unfinished(self) -> None:
        """Abort every sequence not finished yet, once: a later call (the stream's end after a failed sequence)
        aborts nothing, so it can never reach a new request that took a freed id meanwhile. Nor does a sequence
        whose final output came but was not read yet (a client that left in the same loop turn): its id was
        given back when it came, and may name another client's request by now."""
        if self._plan is not None:
            self._plan.close()
        for handle in self._prefills:
            self.engine.abort(handle.rid)
        for handle, done in zip(self.handles, self._finished):
            if not done and not handle.is_over:
                self.engine.abort(handle.rid)
        self._finished = [True] * len(self._finished)

    async def events(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Outputs of every sequence as they come: ``(index, output)``; errors are raised."""
        if self._prefills:
            await self._prefill_shared_prompts()
        if len(self.handles) == 1:  # no merging: no tasks
            handle = self.handles[0]
            while True:
                output = await handle.next()
                self._finished[0] = output.is_final or output.error is not None
                if output.error is not None:
                    raise output_error(output)
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
                    # The other sequences would run on to their full length with nobody to answer, holding
                    # their KV and their ids (a retry under the same ids would be refused as duplicates).
                    self.abort_unfinished()
                    raise output_error(output)
                yield index, output
        finally:
            for task in pumps:
                task.cancel()

    def answers(self) -> list[SequenceAnswer]:
        """One empty answer per sequence, to fill with :meth:`chunk` of its outputs."""
        return [SequenceAnswer(rid, weight_version=self.engine.weight_version, started=self.started,
                               logprobs=logprob_shape(spec.logprobs))
                for rid, spec in zip(self.rids, self.sequences, strict=True)]

    def chunk(self, index: int, output: RequestOutput) -> SequenceChunk:
        """Output ``output`` of sequence ``index`` in SGLang's terms."""
        version = self.engine.weight_version if output.weight_version is None else output.weight_version
        return chunk_of(output, self.sequences[index].logprobs, self.engine.tokenizer, version)

    async def collect(self) -> list[SequenceAnswer]:
        answers = self.answers()
        async for index, output in self.events():
            if self.sequences[index].logprobs is None:
                chunk = self.chunk(index, output)
            else:  # a decode per logprob entry: on a thread, so the event loop keeps its turns meanwhile
                chunk = await asyncio.to_thread(self.chunk, index, output)
            answers[index].add(chunk)
        return answers


async def collect_unless_disconnected(request: Request, run: GenerationRun) -> list[SequenceAnswer] | None:
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
