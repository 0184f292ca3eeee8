"""SGLang's ``POST /generate`` served by vLLM: the request as a completion with token ids, the answer back in
SGLang's shape, so an RL client that speaks SGLang works against a vLLM node.

Request (SGLang ``GenerateReqInput``, ``sampling_params`` as in SGLang's
``SamplingParams``) → ``POST /v1/completions`` with ``return_token_ids`` (and
``return_tokens_as_token_ids`` for logprobs, so every token is an id, never a
string to guess from). A field vLLM cannot honour is a 400 ``unsupported``
naming it, never silently dropped; PD routing fields the LB adds
(``bootstrap_*``) are accepted and unused, as a mixed engine does.
``sampling_params.n`` > 1 is vLLM's ``n`` (choices come prompt by prompt, as
SGLang orders them), or, greedy, each prompt sent n times (vLLM refuses
``n`` > 1 at temperature 0; SGLang answers n equal samples).

The answer's way back: :mod:`node_sidecar.engines.vllm_answer`.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from typing import Any

from pydantic import BaseModel

from handoff.protocol.generate_request import MAX_SEQUENCES, STRICT, SamplingParamsBody
from handoff.protocol.ignored_fields import note_ignored
from handoff.service.bodies import parse_value
from handoff.service.errors import InvalidRequest, Unsupported, parse_json_bytes
from node_sidecar.engines.vllm_answer import GenerateRequest
from node_sidecar.engines.vllm_logprob_mode import is_number, logprob_mismatch

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
# SGLang's /generate samples with SamplingParams' own defaults (sampling_params.py:157-163); vLLM fills a field a
# completion leaves out (or sends null) from the model's generation_config.json (--generation-config auto, its
# default): each is sent, always. top_k 0 is vLLM's "off" (SGLang's -1, the whole vocabulary).
SGLANG_SAMPLING_DEFAULTS: dict[str, Any] = {
    "temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "frequency_penalty": 0.0, "presence_penalty": 0.0,
    "repetition_penalty": 1.0}
SGLANG_GREEDY_BELOW = 1e-6    # SGLang samples greedily for 0 <= temperature < this (sampling_params.py:245)
VLLM_MAX_TEMPERATURE = 2.0    # vLLM refuses a temperature above this; SGLang takes any finite one
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


class _SamplingTypes(BaseModel):
    """SGLang's types for ``sampling_params`` (its HTTP contract refuses a value of another type, a null inside
    ``stop_token_ids`` included: the types handoff's engine checks), so vLLM never coerces one."""

    model_config = STRICT
    sampling_params: SamplingParamsBody


def _is_unset(value: Any) -> bool:
    return value is None or value is False or value == 0 or value == [] or value == {}


def to_completion(raw: bytes, *, max_model_len: int | None = None,
                  logprobs_mode: str | None = None) -> tuple[bytes, GenerateRequest]:
    """An SGLang ``/generate`` body as a vLLM ``/v1/completions`` body; 400 for what cannot be served.
    ``max_model_len``: vLLM's context, what an explicit null ``max_new_tokens`` asks for (None: not known);
    ``logprobs_mode``: vLLM's ``--logprobs-mode`` (None: not known, its default), which logprobs it can answer
    with SGLang's meaning (:mod:`node_sidecar.engines.vllm_logprob_mode`)."""
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
                                  "stream": bool(body.get("stream", False)),
                                  **_sampling(params, max_model_len)}
    rid = body.get("rid")
    if rid is not None:
        if is_batch or not isinstance(rid, str):
            raise Unsupported("rid on a batch is not supported on vLLM nodes (vLLM takes one request id per call)",
                              extra={"field": "rid"})
        completion["request_id"] = rid
    n = _sample_count(params, len(prompts))
    if n > 1:
        is_batch = True  # SGLang answers a list for n > 1, prompt by prompt, each prompt's samples together
        if completion["temperature"] == 0:  # vLLM refuses n > 1 when greedy; SGLang gives n equal answers
            completion["prompt"] = [prompt for prompt in prompts for _ in range(n)]
        else:  # vLLM's choices come in SGLang's order: index = prompt * n + sample
            completion["prompt"], completion["n"] = prompts, n
    request = GenerateRequest(is_batch, rid, bool(body.get("return_logprob")), _int(body, "top_logprobs_num", 0),
                              _int(body, "logprob_start_len", -1), bool(body.get("return_prompt_token_ids")),
                              num_prompts=len(completion["prompt"]) if is_batch else 1,
                              num_choices=len(completion["prompt"]) * completion.get("n", 1) if is_batch else 1,
                              prompt_only=is_number(params.get("max_new_tokens")) and params["max_new_tokens"] == 0)
    if request.return_logprob:
        if body.get("return_text_in_logprobs"):
            raise Unsupported("return_text_in_logprobs is not supported on vLLM nodes",
                              extra={"field": "return_text_in_logprobs"})
        completion["logprobs"] = request.top_logprobs_num
        completion["return_tokens_as_token_ids"] = True
        if request.prompt_only:  # SGLang's row after the prompt is untempered, its token dropped: sample plainly
            completion.update(SGLANG_SAMPLING_DEFAULTS)
            completion.pop("logit_bias", None)
            completion.pop("min_tokens", None)
        problem = logprob_mismatch(completion, logprobs_mode)
        if problem is not None:
            raise Unsupported(problem, extra={"field": "return_logprob"})
        if request.logprob_start_len >= 0:
            if completion["stream"]:
                raise Unsupported("prompt logprobs (logprob_start_len >= 0) in a stream are not available on vLLM "
                                  "nodes; ask without stream", extra={"field": "logprob_start_len"})
            completion["prompt_logprobs"] = request.top_logprobs_num
    return json.dumps(completion).encode(), request


def _sampling(params: dict[str, Any], max_model_len: int | None) -> dict[str, Any]:
    """SGLang's ``sampling_params`` (but ``n``) as vLLM's completion fields, SGLang's defaults filled in."""
    for name, value in params.items():
        if name != "n" and name not in SAMPLING_FIELDS:
            if name not in SAMPLING_UNSUPPORTED:
                raise InvalidRequest(f"unknown field sampling_params.{name!r}")
            if value is not None:
                raise Unsupported(f"sampling_params.{name} is not supported on vLLM nodes",
                                  extra={"field": f"sampling_params.{name}"})
    parse_value({"sampling_params": params}, _SamplingTypes)
    out: dict[str, Any] = {"max_tokens": SGLANG_MAX_NEW_TOKENS, **SGLANG_SAMPLING_DEFAULTS}
    for name, value in params.items():
        target = SAMPLING_FIELDS.get(name)
        if target is None:
            continue
        if name == "max_new_tokens" and value is None:
            out[target] = _whole_context(max_model_len)
        elif name == "max_new_tokens" and value == 0:
            out[target] = 1  # vLLM's least; the answer drops the token (GenerateRequest.prompt_only)
        elif name == "temperature" and value is not None:
            out[target] = _temperature(value)
        elif value is not None and not (name == "top_k" and value == -1):
            out[target] = value
    if out["temperature"] == 0:  # SGLang's greedy takes any top_k (sampling_params.py:245-248); vLLM refuses < -1
        out["top_k"] = 0
    return out


def _temperature(value: float) -> float:
    """SGLang's temperature as vLLM's: greedy below SGLang's threshold (vLLM would raise a temperature under 0.01
    to 0.01 and sample); above 2, which vLLM refuses, 400 ``unsupported``. A negative one is vLLM's to refuse."""
    if 0 <= value < SGLANG_GREEDY_BELOW:
        return 0.0
    if value > VLLM_MAX_TEMPERATURE:
        raise Unsupported(f"sampling_params.temperature above {VLLM_MAX_TEMPERATURE:g} is not supported on vLLM "
                          f"nodes (vLLM refuses it), got {value!r}", extra={"field": "sampling_params.temperature"})
    return value


def _whole_context(max_model_len: int | None) -> int:
    """An explicit null ``max_new_tokens``, SGLang's "up to the context": vLLM's ``max_model_len`` (vLLM caps it at
    what the prompt leaves of the context)."""
    if max_model_len is None:
        raise Unsupported("sampling_params.max_new_tokens null (up to the context) needs vLLM's max_model_len, not "
                          "read from its /server_info; give a number",
                          extra={"field": "sampling_params.max_new_tokens"})
    return max_model_len


def _refuse_unknown(body: dict[str, Any]) -> None:
    """400 ``unsupported`` for a field vLLM nodes cannot honour; a key SGLang does not know either is ignored (as
    SGLang's contract ignores it, its name logged once) and, the completion being built field by field, never
    reaches vLLM."""
    unknown = []
    for name, value in body.items():
        if name in KNOWN_FIELDS or name in IGNORED_FIELDS:
            continue
        if name not in UNSUPPORTED_FIELDS:
            unknown.append(name)
        elif not _is_unset(value):
            raise Unsupported(f"{name} is not supported on vLLM nodes", extra={"field": name})
    if unknown:
        note_ignored("/generate body (vLLM node)", unknown)


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


def _sample_count(params: dict[str, Any], num_prompts: int) -> int:
    """``sampling_params.n``: samples per prompt (at most :data:`MAX_SEQUENCES` sequences in all)."""
    n = params.get("n", 1)
    if n is None:
        n = 1  # SGLang's default; the batch itself still counts against the bound
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise InvalidRequest(f"sampling_params.n must be an integer >= 1, got {n!r}")
    if n * num_prompts > MAX_SEQUENCES:
        raise InvalidRequest(f"{num_prompts} prompt(s) x n={n} is more than {MAX_SEQUENCES} sequences in one "
                             "request", extra={"field": "sampling_params.n"})
    return n


def _is_token(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _int(body: dict[str, Any], name: str, default: int) -> int:
    value = body.get(name, default)
    if value is None:
        return default
    if not isinstance(value, int) or isinstance(value, bool):
        raise InvalidRequest(f"{name} must be an integer")
    return value


class PromptCounts:
    """How many vLLM requests each client request id became (a greedy prompt sent ``n`` times is ``n``), so
    an abort by id reaches all of them; the newest ``capacity`` ids are kept (an id not known counts 1)."""

    def __init__(self, capacity: int = 4096) -> None:
        self._counts: OrderedDict[str, int] = OrderedDict()
        self._capacity = capacity

    def add(self, rid: str, count: int) -> None:
        self._counts[rid] = count
        self._counts.move_to_end(rid)
        while len(self._counts) > self._capacity:
            self._counts.popitem(last=False)

    def get(self, rid: str) -> int:
        return self._counts.get(rid, 1)
