"""SGLang's ``POST /generate`` served by vLLM: the request as a completion with token ids, the answer back in
SGLang's shape, so an RL client that speaks SGLang works against a vLLM node.

Request (SGLang ``GenerateReqInput``, ``sampling_params`` as in SGLang's
``SamplingParams``) → ``POST /v1/completions`` with ``return_token_ids`` (and
``return_tokens_as_token_ids`` for logprobs, so every token is an id, never a
string to guess from). A field vLLM cannot honour is a 400 ``unsupported``
naming it, never silently dropped; PD routing fields the LB adds
(``bootstrap_*``) are accepted and unused, as a mixed engine does.

Answer (SGLang 0.5.23, ``managers/tokenizer_manager.py:2506-2669``):
``{"text", "output_ids", "meta_info": {"id", "finish_reason", "prompt_tokens",
"completion_tokens", "cached_tokens", "weight_version", logprobs...}}``, a
list for a batch. ``finish_reason``: ``{"type": "length", "length": n}``,
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
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable

from handoff.protocol.sse import DONE, EventSplitter, data_event, event_data
from handoff.protocol import errors as E
from handoff.protocol.generation import finish_abort, finish_length, finish_stop
from handoff.service.errors import InvalidRequest, ServiceError, Unsupported, parse_json_bytes
from handoff.service.peer_json import PeerJSONError, loads_bounded
from handoff.service.relay import ChunkTransform

# SGLang sampling_params → vLLM completion fields (SGLang's defaults where vLLM's differ: max_new_tokens 128)
SAMPLING_FIELDS = {
    "max_new_tokens": "max_tokens", "temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
    "min_p": "min_p", "frequency_penalty": "frequency_penalty", "presence_penalty": "presence_penalty",
    "repetition_penalty": "repetition_penalty", "min_new_tokens": "min_tokens", "stop": "stop",
    "stop_token_ids": "stop_token_ids", "ignore_eos": "ignore_eos", "skip_special_tokens": "skip_special_tokens",
    "spaces_between_special_tokens": "spaces_between_special_tokens", "no_stop_trim": "include_stop_str_in_output",
    "logit_bias": "logit_bias", "seed": "seed", "sampling_seed": "seed", "stream_interval": "stream_interval",
}
# SGLang 0.5.23's other sampling parameters (sampling/sampling_params.py:149-181): accepted unset, refused set.
SAMPLING_UNSUPPORTED = frozenset({"stop_regex", "beam_width", "json_schema", "regex", "ebnf", "structural_tag",
                                  "custom_params", "watermark"})
SGLANG_MAX_NEW_TOKENS = 128
# GenerateReqInput's fields (managers/io_struct.py:177-330) beside those translated: ones that change nothing
# here (routing, logging, tracing: accepted and unused), and ones that ask for what vLLM nodes do not do
# (accepted unset: null, false, 0, empty; 400 unsupported otherwise).
IGNORED_FIELDS = frozenset({
    "bootstrap_host", "bootstrap_port", "bootstrap_room", "bootstrap_pair_key", "decode_tp_size", "routed_dp_rank",
    "data_parallel_rank", "disagg_prefill_dp_rank", "routing_key", "conversation_id", "log_metrics", "no_logs",
    "custom_labels", "external_trace_header", "received_time", "priority", "extra_key", "modalities",
    "http_worker_ipc", "num_items_assigned", "need_wait_for_mm_inputs", "session_id", "stream_options"})
UNSUPPORTED_FIELDS = frozenset({
    "input_embeds", "image_data", "video_data", "audio_data", "mm_hashes", "mm_content_hashes", "use_audio_in_video",
    "video_config", "watermark", "token_ids_logprob", "return_sampling_mask", "sampling_logprobs_mode",
    "return_flat_raw_top_logprobs", "return_flat_raw_output_top_logprobs", "return_flat_raw_top_logprobs_b64",
    "return_hidden_states", "return_routed_experts", "routed_experts_start_len", "return_indexer_topk",
    "session_params", "lora_path", "lora_id", "custom_logit_processor", "positional_embed_overrides", "background",
    "require_reasoning", "max_thinking_tokens", "return_bytes", "return_entropy", "encoder_urls", "max_dynamic_patch",
    "min_dynamic_patch", "image_max_dynamic_patch", "video_max_dynamic_patch", "images_config",
    "mm_processor_kwargs", "multi_item_delimiter_indices", "token_indices_to_pool", "cache_salt", "kv_hints"})
KNOWN_FIELDS = frozenset({"text", "input_ids", "sampling_params", "stream", "rid", "return_logprob",
                          "logprob_start_len", "top_logprobs_num", "return_text_in_logprobs",
                          "return_prompt_token_ids"})


def _is_unset(value: Any) -> bool:
    return value is None or value is False or value == 0 or value == [] or value == {}


@dataclass(frozen=True)
class GenerateRequest:
    """What the answer's translation needs to know of the request."""

    is_batch: bool
    rid: str | None
    return_logprob: bool
    top_logprobs_num: int
    logprob_start_len: int
    return_prompt_token_ids: bool = False


def to_completion(raw: bytes) -> tuple[bytes, GenerateRequest]:
    """An SGLang ``/generate`` body as a vLLM ``/v1/completions`` body; 400 for what cannot be served."""
    body = parse_json_bytes(raw)
    if not isinstance(body, dict):
        raise InvalidRequest("the body must be a JSON object")
    _refuse_unknown(body)
    prompts, is_batch = _prompts(body)
    params = body.get("sampling_params") or {}
    if not isinstance(params, dict):
        raise Unsupported("sampling_params as a list (one per prompt) is not supported on vLLM nodes; give one "
                          "object for the whole batch", extra={"field": "sampling_params"})
    completion: dict[str, Any] = {"prompt": prompts if is_batch else prompts[0], "return_token_ids": True,
                                  "stream": bool(body.get("stream", False)), "max_tokens": SGLANG_MAX_NEW_TOKENS}
    for name, value in params.items():
        if name == "n":
            continue  # below
        target = SAMPLING_FIELDS.get(name)
        if target is None:
            if name not in SAMPLING_UNSUPPORTED:
                raise InvalidRequest(f"unknown field sampling_params.{name!r}")
            if value is None:
                continue
            raise Unsupported(f"sampling_params.{name} is not supported on vLLM nodes",
                              extra={"field": f"sampling_params.{name}"})
        if value is not None and not (name == "top_k" and value == -1):
            completion[target] = value
    if params.get("n", 1) not in (1, None):
        raise Unsupported("sampling_params.n > 1 is not supported on vLLM nodes", extra={"field": "sampling_params.n"})
    rid = body.get("rid")
    if rid is not None:
        if is_batch or not isinstance(rid, str):
            raise Unsupported("rid on a batch is not supported on vLLM nodes (vLLM takes one request id per call)",
                              extra={"field": "rid"})
        completion["request_id"] = rid
    request = GenerateRequest(is_batch, rid, bool(body.get("return_logprob")), _int(body, "top_logprobs_num", 0),
                              _int(body, "logprob_start_len", -1), bool(body.get("return_prompt_token_ids")))
    if request.return_logprob:
        if body.get("return_text_in_logprobs"):
            raise Unsupported("return_text_in_logprobs is not supported on vLLM nodes",
                              extra={"field": "return_text_in_logprobs"})
        completion["logprobs"] = request.top_logprobs_num
        completion["return_tokens_as_token_ids"] = True
        if request.logprob_start_len >= 0:
            if completion["stream"]:
                raise Unsupported("prompt logprobs (logprob_start_len >= 0) in a stream are not available on vLLM "
                                  "nodes; ask without stream", extra={"field": "logprob_start_len"})
            completion["prompt_logprobs"] = request.top_logprobs_num
    return json.dumps(completion).encode(), request


def _refuse_unknown(body: dict[str, Any]) -> None:
    for name, value in body.items():
        if name in KNOWN_FIELDS or name in IGNORED_FIELDS:
            continue
        if name not in UNSUPPORTED_FIELDS:
            raise InvalidRequest(f"unknown field {name!r}")
        if not _is_unset(value):
            raise Unsupported(f"{name} is not supported on vLLM nodes", extra={"field": name})


def _prompts(body: dict[str, Any]) -> tuple[list[Any], bool]:
    text, ids = body.get("text"), body.get("input_ids")
    if (text is None) == (ids is None):
        raise InvalidRequest("give exactly one of text or input_ids")
    if text is not None:
        if isinstance(text, str):
            return [text], False
        if isinstance(text, list) and text and all(isinstance(t, str) for t in text):
            return list(text), True
        raise InvalidRequest("text must be a string or a non-empty list of strings")
    if isinstance(ids, list) and ids and all(_is_token(t) for t in ids):
        return [ids], False
    if isinstance(ids, list) and ids and all(isinstance(p, list) and p and all(_is_token(t) for t in p) for p in ids):
        return list(ids), True
    raise InvalidRequest("input_ids must be a non-empty list of token ids, or a list of such lists")


def _is_token(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _int(body: dict[str, Any], name: str, default: int) -> int:
    value = body.get(name, default)
    if value is None:
        return default
    if not isinstance(value, int) or isinstance(value, bool):
        raise InvalidRequest(f"{name} must be an integer")
    return value


# -- answers -----------------------------------------------------------------------------------------------------

@dataclass
class ChoiceState:
    """One prompt's answer so far (a stream's pieces put together)."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    prompt_token_ids: list[int] = field(default_factory=list)
    token_logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = field(default_factory=list)
    prompt_logprobs: list[Any] | None = None
    finish_reason: str | None = None
    stop_reason: Any = None

    def add(self, choice: dict[str, Any]) -> None:
        self.text += choice.get("text") or ""
        self.token_ids += list(choice.get("token_ids") or [])
        if choice.get("prompt_token_ids"):
            self.prompt_token_ids = list(choice["prompt_token_ids"])
        if choice.get("prompt_logprobs") is not None:
            self.prompt_logprobs = list(choice["prompt_logprobs"])
        logprobs = choice.get("logprobs")
        if isinstance(logprobs, dict):
            self.token_logprobs += list(logprobs.get("token_logprobs") or [])
            self.top_logprobs += list(logprobs.get("top_logprobs") or [])
        if choice.get("finish_reason") is not None:
            self.finish_reason = choice["finish_reason"]
            self.stop_reason = choice.get("stop_reason")


class Translator:
    """vLLM completion answers → SGLang ``/generate`` answers, for one request."""

    def __init__(self, request: GenerateRequest, weight_version: Callable[[], str | None]) -> None:
        self.request = request
        self.weight_version = weight_version
        self.base_id = request.rid or uuid.uuid4().hex

    def answer(self, raw: bytes) -> bytes:
        """A whole (non-stream) answer; 502 ``upstream_error`` if the engine's cannot be read."""
        try:
            completion = _peer_object(raw)
        except ValueError as exc:
            raise ServiceError(str(exc), kind=E.UPSTREAM_ERROR) from exc
        choices = completion.get("choices")
        if not isinstance(choices, list) or not choices:
            raise ServiceError("the engine's completion has no choices", kind=E.UPSTREAM_ERROR)
        states: dict[int, ChoiceState] = {}
        for choice in choices:
            if isinstance(choice, dict):
                states.setdefault(int(choice.get("index", 0)), ChoiceState()).add(choice)
        results = [self.result(index, states[index]) for index in sorted(states)]
        return json.dumps(results if self.request.is_batch else results[0]).encode()

    def stream(self) -> ChunkTransform:
        return _StreamTranslator(self)

    def result(self, index: int, state: ChoiceState) -> dict[str, Any]:
        rid = self.base_id if not self.request.is_batch else f"{self.base_id}-{index}"
        meta: dict[str, Any] = {
            "id": rid, "finish_reason": self._finish_reason(state), "prompt_tokens": len(state.prompt_token_ids),
            "completion_tokens": len(state.token_ids), "cached_tokens": 0, "weight_version": self.weight_version()}
        if self.request.return_logprob:
            meta.update(self._logprobs(state))
        result = {"text": state.text, "output_ids": list(state.token_ids), "meta_info": meta}
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
        out: dict[str, Any] = {"output_token_logprobs": [
            [lp, token, None] for lp, token in zip(state.token_logprobs, state.token_ids)]}
        if self.request.top_logprobs_num > 0:
            out["output_top_logprobs"] = [_top(row) for row in state.top_logprobs]
        start = self.request.logprob_start_len
        if start >= 0:
            prompt = state.prompt_token_ids
            rows = state.prompt_logprobs or [None] * len(prompt)
            out["input_token_logprobs"] = [
                [_prompt_logprob(rows[i], token), token, None] for i, token in enumerate(prompt) if i >= start]
            if self.request.top_logprobs_num > 0:
                out["input_top_logprobs"] = [_prompt_top(rows[i], self.request.top_logprobs_num)
                                             for i in range(len(prompt)) if i >= start]
        return out


class _StreamTranslator(ChunkTransform):
    """vLLM's SSE events → SGLang's (each event the whole answer so far, for the choice it moved)."""

    def __init__(self, translator: Translator) -> None:
        self.translator = translator
        self.splitter = EventSplitter()
        self.states: dict[int, ChoiceState] = {}

    def feed(self, chunk: bytes) -> bytes:
        return b"".join(self._event(event) for event in self.splitter.feed(chunk))

    def finish(self) -> bytes:
        rest = self.splitter.finish()
        return self._event(rest) if rest.strip() else b""

    def _event(self, event: bytes) -> bytes:
        data = event_data(event)
        if data is None:
            return b""
        if data.strip() == DONE:
            return data_event(DONE)
        try:
            chunk = _peer_object(data)
        except ValueError:
            return event  # not JSON: passed on as the engine wrote it
        choices = chunk.get("choices")
        if not isinstance(choices, list):
            return event  # an error event, or anything that is not a completion chunk, passes as it is
        out = []
        for choice in choices:
            if not isinstance(choice, dict):
                continue
            index = int(choice.get("index", 0))
            state = self.states.setdefault(index, ChoiceState())
            state.add(choice)
            result = self.translator.result(index, state)
            if self.translator.request.is_batch:
                result["index"] = index
            out.append(data_event(json.dumps(result).encode()))
        return b"".join(out)


def _peer_object(raw: bytes) -> dict[str, Any]:
    try:
        value = loads_bounded(raw)
    except PeerJSONError as exc:
        raise ValueError(f"the engine's answer is not JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise ValueError("the engine's answer is not a JSON object")
    return value


def _token_id(key: str) -> int | None:
    """``token_id:123`` (``return_tokens_as_token_ids``) → 123."""
    prefix, _, number = key.partition(":")
    return int(number) if prefix == "token_id" and number.isdigit() else None


def _top(row: dict[str, float] | None) -> list[list[Any]] | None:
    if not row:
        return None
    pairs = [(lp, _token_id(key)) for key, lp in row.items()]
    return [[lp, token, None] for lp, token in sorted(pairs, key=lambda p: -p[0]) if token is not None]


def _prompt_logprob(row: Any, token: int) -> float | None:
    if not isinstance(row, dict):
        return None
    entry = row.get(str(token))
    return entry.get("logprob") if isinstance(entry, dict) else None


def _prompt_top(row: Any, num: int) -> list[list[Any]] | None:
    """The ``num`` likeliest tokens at a prompt position (vLLM's row also holds the actual token, at its rank)."""
    if not isinstance(row, dict):
        return None
    ranked = sorted(((entry.get("rank", 0), int(key), entry.get("logprob")) for key, entry in row.items()
                     if isinstance(entry, dict) and key.isdigit()), key=lambda r: r[0])
    return [[lp, tok, None] for rank, tok, lp in ranked if rank <= num][:num]
