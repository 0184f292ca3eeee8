"""vLLM completion answers back in SGLang's ``/generate`` shape (SGLang 0.5.23,
``managers/tokenizer_manager.py:2506-2669``), whole or as a stream; the request side is
:mod:`node_sidecar.engines.vllm_generate`.

``{"text", "output_ids", "meta_info": {"id", "finish_reason", "prompt_tokens",
"completion_tokens", "cached_tokens", "weight_version", logprobs...}}``, a
list for a batch (or ``n`` > 1); a finished answer also has ``weight_versions``
(:mod:`node_sidecar.engines.vllm_versions`). ``finish_reason``: ``{"type": "length", "length": n}``,
``{"type": "stop", "matched": token id or string}`` (vLLM's ``stop_reason``;
the last token, the EOS, when vLLM gives none), ``{"type": "abort", "message"}``.
Logprobs: ``output_token_logprobs`` ``[[logprob, token_id, null], ...]``,
``output_top_logprobs`` (per position, or null), ``input_token_logprobs``
from ``logprob_start_len`` (the first prompt token's logprob is null),
``input_top_logprobs``. A stream repeats the whole text, ids and logprobs so
far in every event (SGLang's default, ``incremental_streaming_output`` off),
with ``index`` for a batch, then ``data: [DONE]``.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass
from typing import Any

from handoff.protocol import errors as E
from handoff.protocol.generation import finish_abort, finish_length, finish_stop
from handoff.protocol.sse import DEFAULT_MAX_EVENT_BYTES, DONE, EventSplitter, data_event, event_data
from handoff.service.errors import ServiceError
from handoff.service.relay import ChunkTransform, sse_error_event
from node_sidecar.engines.vllm_choice import (
    MALFORMED,
    ChoiceState,
    MalformedChoice,
    peer_object,
    prompt_logprob,
    prompt_top,
    read_choice_index,
    top_rows,
)
from node_sidecar.engines.vllm_versions import ServedVersions, VersionTrail


@dataclass(frozen=True)
class GenerateRequest:
    """What the answer's translation needs to know of the request."""

    is_batch: bool
    rid: str | None
    return_logprob: bool
    top_logprobs_num: int
    logprob_start_len: int
    return_prompt_token_ids: bool = False
    num_prompts: int = 1  # vLLM's requests: "cmpl-<rid>-0" to "cmpl-<rid>-<num_prompts - 1>"
    num_choices: int = 1  # the choices the answer must hold, indexes 0 to num_choices - 1 (prompts x n)
    prompt_only: bool = False  # max_new_tokens 0: vLLM generates one token (its least), the answer drops it


# the most a stream's choices may hold put together (the data of the events read): SGLang's events each repeat the
# whole answer so far, so one answer past an event's bound could not be relayed anyway
MAX_STREAM_ANSWER_BYTES = DEFAULT_MAX_EVENT_BYTES


class Translator:
    """vLLM completion answers → SGLang ``/generate`` answers, for one request."""

    def __init__(self, request: GenerateRequest, versions: ServedVersions) -> None:
        self.request = request
        self.versions = versions
        self.start = versions.trail()  # the version served as the request starts
        self.base_id = request.rid or uuid.uuid4().hex
        self.started = time.monotonic()  # SGLang's e2e_latency is counted from here

    def add(self, state: ChoiceState, choice: dict[str, Any]) -> None:
        """A choice (or a stream's piece of it) added to its state, after the renames its earlier tokens preceded."""
        self._trail(state).follow(self.versions, len(state.token_ids))
        state.add(choice)

    def _trail(self, state: ChoiceState) -> VersionTrail:
        if state.trail is None:
            state.trail = VersionTrail(self.start.version, self.start.started, self.start.seen)
        return state.trail

    def answer(self, raw: bytes) -> bytes:
        """A whole (non-stream) answer; 502 ``upstream_error`` if the engine's cannot be read."""
        try:
            completion = peer_object(raw)
        except ValueError as exc:
            raise ServiceError(str(exc), kind=E.UPSTREAM_ERROR) from exc
        choices = completion.get("choices")
        if not isinstance(choices, list) or not choices:
            raise ServiceError("the engine's completion has no choices", kind=E.UPSTREAM_ERROR)
        states: dict[int, ChoiceState] = {}
        try:
            for choice in choices:
                index = self.choice_index(choice)
                if index in states:
                    raise MalformedChoice(f"two choices have the index {index}")
                states[index] = ChoiceState()
                self.add(states[index], choice)
            if len(states) != self.request.num_choices:
                raise MalformedChoice(f"{len(states)} choice(s), not the {self.request.num_choices} asked for")
            results = [self.result(index, states[index]) for index in sorted(states)]
        except MALFORMED as exc:
            raise ServiceError(f"the engine's completion cannot be read: {exc}", kind=E.UPSTREAM_ERROR) from exc
        return json.dumps(results if self.request.is_batch else results[0]).encode()

    def choice_index(self, choice: Any) -> int:
        """A choice's index, checked to be one the request asked for; :class:`MalformedChoice` otherwise."""
        if not isinstance(choice, dict):
            raise MalformedChoice(f"a choice is {type(choice).__name__}, not an object")
        index = read_choice_index(choice)
        if index >= self.request.num_choices:
            raise MalformedChoice(f"a choice's index is {index}, past the {self.request.num_choices} asked for")
        return index

    def stream(self) -> ChunkTransform:
        return _StreamTranslator(self)

    def result(self, index: int, state: ChoiceState) -> dict[str, Any]:
        rid = self.base_id if not self.request.is_batch else f"{self.base_id}-{index}"
        finish_reason = self._finish_reason(state)
        logprobs = self._logprobs(state) if self.request.return_logprob else {}
        text, token_ids = state.text, list(state.token_ids)
        if self.request.prompt_only:  # SGLang's max_new_tokens 0: nothing generated, finished by length 0
            text, token_ids = "", []
            if finish_reason is not None and finish_reason.get("type") != "abort":
                finish_reason = finish_length(0)
            if logprobs:  # the row after the prompt stays (SGLang's scoring request), the token it sampled not
                logprobs["output_token_logprobs"] = []
                if "output_top_logprobs" in logprobs:
                    logprobs["output_top_logprobs"] = logprobs["output_top_logprobs"][:1]
        trail = self._trail(state)
        meta: dict[str, Any] = {
            "id": rid, "finish_reason": finish_reason, "prompt_tokens": len(state.prompt_token_ids),
            "completion_tokens": len(token_ids), "cached_tokens": 0, "weight_version": trail.version, **logprobs}
        if finish_reason is not None:  # as SGLang: a finished answer says how long it took (sglang-router needs it)
            spans = trail.spans(len(token_ids))  # and which tokens each version made
            if spans is not None:
                meta["weight_versions"], meta["weight_version"] = spans, spans[-1]["version"]
            meta["e2e_latency"] = round(time.monotonic() - self.started, 6)
        result = {"text": text, "output_ids": token_ids, "meta_info": meta}
        if self.request.return_prompt_token_ids:
            result["prompt_token_ids"] = list(state.prompt_token_ids)
        return result

    def _finish_reason(self, state: ChoiceState) -> dict[str, Any] | None:
        reason = state.finish_reason
        if reason is None:
            return None
        if reason == "length":
            return finish_length(len(state.token_ids))
        if reason == "stop":
            return finish_stop(state.stop_reason if state.stop_reason is not None else (
                state.token_ids[-1] if state.token_ids else None))
        return finish_abort(f"the request ended early ({reason})")

    def _logprobs(self, state: ChoiceState) -> dict[str, Any]:
        if len(state.token_logprobs) != len(state.token_ids):
            raise MalformedChoice(f"{len(state.token_logprobs)} token logprobs for {len(state.token_ids)} tokens")
        if not all(isinstance(lp, (int, float)) and not isinstance(lp, bool) for lp in state.token_logprobs):
            raise MalformedChoice("token_logprobs holds something other than numbers")
        if self.request.top_logprobs_num > 0 and len(state.top_logprobs) != len(state.token_ids):
            raise MalformedChoice(f"{len(state.top_logprobs)} top logprob rows for {len(state.token_ids)} tokens")
        out: dict[str, Any] = {"output_token_logprobs": [
            [lp, token, None] for lp, token in zip(state.token_logprobs, state.token_ids)]}
        if self.request.top_logprobs_num > 0:
            out["output_top_logprobs"] = [top_rows(row, self.request.top_logprobs_num) for row in state.top_logprobs]
        start = self.request.logprob_start_len
        if start >= 0:
            prompt = state.prompt_token_ids
            rows = list(state.prompt_logprobs or [])
            rows += [None] * (len(prompt) - len(rows))  # a short list: the missing positions have none
            out["input_token_logprobs"] = [
                [prompt_logprob(rows[i], token), token, None] for i, token in enumerate(prompt) if i >= start]
            if self.request.top_logprobs_num > 0:
                out["input_top_logprobs"] = [prompt_top(rows[i], self.request.top_logprobs_num)
                                             for i in range(len(prompt)) if i >= start]
        return out


class _StreamTranslator(ChunkTransform):
    """vLLM's SSE events → SGLang's (each event the whole answer so far, for the choice it moved).

    An event that cannot be read ends the translated stream as SGLang ends a failed one (an error event, then
    ``[DONE]``): the choices' states may hold half of it, so nothing the engine sends later is translated. So
    does a stream that ends without ``[DONE]`` (never silence), and one whose choices grow past
    :data:`MAX_STREAM_ANSWER_BYTES`; what comes after ``[DONE]`` is dropped. The engine's own error event
    (``{"error": ...}``) passes as it is.
    """

    def __init__(self, translator: Translator) -> None:
        self.translator = translator
        self.splitter = EventSplitter()
        self.states: dict[int, ChoiceState] = {}
        self.has_ended = False  # [DONE] passed on, or the stream failed: nothing more is sent
        self.read_bytes = 0

    def feed(self, chunk: bytes) -> bytes:
        return b"".join(self._event(event) for event in self.splitter.feed(chunk))

    def finish(self) -> bytes:
        rest = self.splitter.finish()
        out = self._event(rest) if rest.strip() else b""
        if self.has_ended:
            return out
        return out + self._failed("the engine's stream ended without [DONE]")

    def _failed(self, message: str) -> bytes:
        self.has_ended = True
        return b"".join([sse_error_event(E.UPSTREAM_ERROR.name, message), data_event(DONE)])

    def _event(self, event: bytes) -> bytes:
        data = event_data(event)
        if data is None or self.has_ended:
            return b""
        if data.strip() == DONE:
            self.has_ended = True
            return data_event(DONE)
        self.read_bytes += len(data)
        if self.read_bytes > MAX_STREAM_ANSWER_BYTES:
            return self._failed(f"the engine's stream holds more than {MAX_STREAM_ANSWER_BYTES} bytes of answer")
        try:
            chunk = peer_object(data)
        except ValueError as exc:
            return self._failed(f"the engine's stream cannot be read: {exc}")
        choices = chunk.get("choices")
        if not isinstance(choices, list):
            if "error" in chunk:
                return event  # the engine's error event passes as it is
            return self._failed("the engine's stream cannot be read: an event without a list of choices")
        out = []
        try:
            for choice in choices:
                index = self.translator.choice_index(choice)
                state = self.states.setdefault(index, ChoiceState())
                self.translator.add(state, choice)
                result = self.translator.result(index, state)
                if self.translator.request.is_batch:
                    result["index"] = index
                out.append(data_event(json.dumps(result).encode()))
        except MALFORMED as exc:
            return self._failed(f"the engine's stream cannot be read: {exc}")
        return b"".join(out)
