"""SGLang's ``/generate`` request, torch-free: every field SGLang 0.5.23 accepts, and its normalization.

The bodies follow ``sglang/srt/managers/io_struct.py`` (``GenerateReqInput``)
and ``sglang/srt/sampling/sampling_params.py`` (``SamplingParams``), plus
``model``, which sglang-router (sgl-model-gateway) adds to every request it
forwards. A top-level key outside that set is ignored, as SGLang's contract
(``sglang/api/v1/api_types.py``, ``GenerateRequest``) ignores it, and its name
logged once (:mod:`handoff.protocol.ignored_fields`); one inside
``sampling_params`` is a typo: 400, as there. Types are SGLang's contract's
(``tests/handoff/test_generate_contract_differential.py``). Each field is in one of
three groups (:data:`GENERATE_FIELDS`, :data:`SAMPLING_FIELDS`, listed in
``docs/api.md``):

- ``implemented``: it does what SGLang does;
- ``accepted``: metadata with no effect on the tokens (routing keys, metric
  labels, PD bootstrap fields that a mixed engine does not need);
- ``default only``: accepted at its default or empty value (``null``,
  ``false``, ``[]``, ``{}``, ``""``); any other value asks for what this engine
  cannot do and is a 400 ``unsupported`` naming the field, never ignored.

:func:`handoff.protocol.generate_sequences.normalize` turns a body into the
sequences the engine runs.
"""

from __future__ import annotations

from typing import Annotated, Any, Optional, Union

from pydantic import AfterValidator, BaseModel, ConfigDict, field_validator

from handoff.protocol import errors as E
from handoff.protocol.ignored_fields import IgnoresUnknown

STRICT = ConfigDict(extra="forbid", strict=True)
MAX_SEQUENCES = 256         # prompts x n in one request
# top_logprobs_num: SGLang takes any count up to the vocabulary (an engine refuses one past it); verl's top-k
# distillation asks 128 by default (DistillationLossConfig.topk), so the bound sits well above what trainers ask
MAX_TOP_LOGPROBS = 1024
MAX_TOKEN_IDS_LOGPROB = 256  # token_ids_logprob per prompt
MAX_IMAGES_PER_PROMPT = 64
MAX_IMAGES_PER_REQUEST = 128  # all prompts together (each is decoded before anything runs)

IMPLEMENTED, ACCEPTED, DEFAULT_ONLY = "implemented", "accepted", "default only"


def _sglang_media_list(value: Any) -> Any:
    """SGLang's ``MediaInput`` rule: a list whose first item is not a list holds items, never lists."""
    if isinstance(value, list) and value and not isinstance(value[0], list) and any(
            isinstance(item, list) for item in value):
        raise ValueError("a list of media items must not hold lists (a list of lists starts with one)")
    return value


# SGLang's contract types (api_types.py: OptionalStringOrList, OptionalInt64OrList, BoolOrList, MediaInput)
OptionalStrOrList = Union[str, list[Optional[str]], None]
OptionalIntOrList = Union[int, list[Optional[int]], None]
BoolOrList = Union[bool, list[bool], None]
_MediaItem = Union[str, dict[str, Any]]
MediaInput = Annotated[Union[_MediaItem, list[Optional[_MediaItem]], list[Optional[list[Optional[_MediaItem]]]],
                             None], AfterValidator(_sglang_media_list)]


class GenerateFieldError(ValueError):
    """A request the engine must refuse: ``kind`` is ``invalid_request`` or ``unsupported`` (both 400)."""

    def __init__(self, message: str, *, kind: E.ErrorType = E.INVALID_REQUEST) -> None:
        super().__init__(message)
        self.kind = kind


class SamplingParamsBody(BaseModel):
    """``sampling_params``; ``null`` for a field means its default, as in SGLang, but for ``max_new_tokens``:
    left out it is 128, ``null`` is no limit but the context's (``model_fields_set`` tells them apart)."""

    model_config = STRICT
    max_new_tokens: int | None = None
    stop: Union[str, list[str], None] = None
    stop_token_ids: list[int] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None
    min_new_tokens: int | None = None
    n: int | None = None
    ignore_eos: bool | None = None
    skip_special_tokens: bool | None = None
    spaces_between_special_tokens: bool | None = None
    no_stop_trim: bool | None = None
    stream_interval: int | None = None
    logit_bias: dict[str, float] | None = None
    sampling_seed: int | None = None
    seed: int | None = None  # handoff's earlier name of sampling_seed
    custom_params: Any = None  # any JSON, as SGLang's contract takes it
    # default only
    stop_regex: Union[str, list[str], None] = None
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    structural_tag: str | None = None
    beam_width: int | None = None
    watermark: dict[str, Any] | None = None
    choice: list[str] | None = None


SAMPLING_FIELDS: dict[str, str] = {
    **{name: IMPLEMENTED for name in (
        "max_new_tokens", "stop", "stop_token_ids", "temperature", "top_p", "top_k", "min_p", "frequency_penalty",
        "presence_penalty", "repetition_penalty", "min_new_tokens", "n", "ignore_eos", "skip_special_tokens",
        "spaces_between_special_tokens", "no_stop_trim", "stream_interval", "logit_bias", "sampling_seed", "seed")},
    "custom_params": ACCEPTED,
    **{name: DEFAULT_ONLY for name in (
        "stop_regex", "json_schema", "regex", "ebnf", "structural_tag", "beam_width", "watermark", "choice")},
}
_SAMPLING_WHY = {"stop_regex": "stop regexes", "json_schema": "constrained decoding (json_schema)",
                 "regex": "constrained decoding (regex)", "ebnf": "constrained decoding (ebnf)",
                 "structural_tag": "constrained decoding (structural_tag)", "beam_width": "beam search",
                 "watermark": "watermarking", "choice": "constrained choice"}


class GenerateBody(IgnoresUnknown):
    """``POST /generate``: exactly one of ``text`` / ``input_ids``; a list of either is a batch."""

    # unknown top-level keys: SGLang's contract ignores them (IgnoresUnknown: dropped, each name logged once)
    ignored_where = "/generate body"
    text: Union[str, list[str], None] = None
    input_ids: Union[list[int], list[list[int]], None] = None
    sampling_params: Union[SamplingParamsBody, list[SamplingParamsBody], None] = None
    rid: Union[str, list[str], None] = None
    stream: bool = False
    return_logprob: Union[bool, list[bool], None] = None
    logprob_start_len: Union[int, list[int], None] = None
    top_logprobs_num: Union[int, list[int], None] = None
    token_ids_logprob: Union[list[int], list[list[int]], None] = None
    return_text_in_logprobs: bool = False
    return_prompt_token_ids: bool = False
    extra_key: Union[str, list[str], None] = None
    cache_salt: Union[str, list[str], None] = None
    model: str | None = None
    image_data: Any = None  # an image, a list (one prompt's, or one per prompt of a batch), a list per prompt
    # accepted: metadata, routing, PD bootstrap (a mixed engine needs none of it)
    session_id: str | None = None
    log_metrics: bool = True
    no_logs: bool = False
    priority: int | None = None
    custom_labels: dict[str, str] | None = None
    routing_key: str | None = None
    conversation_id: str | None = None
    http_worker_ipc: str | None = None
    external_trace_header: dict[str, Any] | None = None
    received_time: float | None = None
    routed_dp_rank: int | None = None
    data_parallel_rank: int | None = None
    disagg_prefill_dp_rank: int | None = None
    bootstrap_host: OptionalStrOrList = None
    bootstrap_port: OptionalIntOrList = None
    bootstrap_room: OptionalIntOrList = None
    bootstrap_pair_key: OptionalStrOrList = None
    decode_tp_size: OptionalIntOrList = None
    # default only: each names what it would ask for (typed as SGLang's contract types those it knows)
    video_data: MediaInput = None
    audio_data: MediaInput = None
    input_embeds: Any = None
    mm_hashes: Union[list[str], list[list[str]], None] = None
    mm_content_hashes: Any = None
    use_audio_in_video: Any = None
    video_config: Any = None
    modalities: list[Optional[str]] | None = None
    images_config: dict[str, Any] | None = None
    mm_processor_kwargs: Any = None
    max_dynamic_patch: Any = None
    min_dynamic_patch: Any = None
    image_max_dynamic_patch: Any = None
    video_max_dynamic_patch: Any = None
    need_wait_for_mm_inputs: Any = None
    num_items_assigned: Any = None
    encoder_urls: Any = None
    lora_path: OptionalStrOrList = None
    lora_id: Any = None
    custom_logit_processor: OptionalStrOrList = None
    positional_embed_overrides: Any = None
    watermark: Any = None
    return_hidden_states: BoolOrList = None
    return_routed_experts: Any = None
    routed_experts_start_len: int = 0  # SGLang's contract: an integer, never null
    return_indexer_topk: Any = None
    return_sampling_mask: BoolOrList = None
    sampling_logprobs_mode: Any = None
    return_flat_raw_top_logprobs: Any = None
    return_flat_raw_output_top_logprobs: Any = None
    return_flat_raw_top_logprobs_b64: Any = None
    return_entropy: Any = None
    return_bytes: Any = None
    session_params: Any = None
    background: Any = None
    require_reasoning: bool | None = None
    max_thinking_tokens: int | None = None
    multi_item_delimiter_indices: Any = None
    token_indices_to_pool: Any = None
    kv_hints: Union[dict[str, Any], list[Optional[dict[str, Any]]], None] = None

    @field_validator("stream", "return_text_in_logprobs", mode="before")
    @classmethod
    def _null_is_false(cls, value: Any) -> Any:
        return False if value is None else value  # SGLang's contract: null is the default


_GENERATE_WHY = {
    **{name: "multimodal input (images, video, audio)" for name in (
        "video_data", "audio_data", "mm_hashes", "mm_content_hashes", "use_audio_in_video",
        "video_config", "modalities", "images_config", "mm_processor_kwargs", "max_dynamic_patch",
        "min_dynamic_patch", "image_max_dynamic_patch", "video_max_dynamic_patch", "need_wait_for_mm_inputs",
        "num_items_assigned", "encoder_urls")},
    "input_embeds": "input embeddings", "lora_path": "LoRA adapters", "lora_id": "LoRA adapters",
    "custom_logit_processor": "custom logit processors", "positional_embed_overrides": "embedding overrides",
    "watermark": "watermarking", "return_hidden_states": "hidden states",
    "return_routed_experts": "routed experts (MoE models only)", "routed_experts_start_len": "routed experts",
    "return_indexer_topk": "indexer top-k", "return_sampling_mask": "sampling masks",
    "sampling_logprobs_mode": "sampling masks", "return_flat_raw_top_logprobs": "flat top-logprob arrays",
    "return_flat_raw_output_top_logprobs": "flat top-logprob arrays",
    "return_flat_raw_top_logprobs_b64": "flat top-logprob arrays", "return_entropy": "entropy",
    "return_bytes": "image generation", "session_params": "sessions (continual prompting)",
    "background": "background responses", "require_reasoning": "reasoning models",
    "max_thinking_tokens": "reasoning models", "multi_item_delimiter_indices": "multi-item scoring",
    "token_indices_to_pool": "pooled scoring", "kv_hints": "KV storage hints",
}
GENERATE_FIELDS: dict[str, str] = {
    **{name: IMPLEMENTED for name in (
        "text", "input_ids", "sampling_params", "rid", "stream", "return_logprob", "logprob_start_len",
        "top_logprobs_num", "token_ids_logprob", "return_text_in_logprobs", "return_prompt_token_ids",
        "extra_key", "cache_salt", "model", "image_data")},
    **{name: ACCEPTED for name in (
        "session_id", "log_metrics", "no_logs", "priority", "custom_labels", "routing_key", "conversation_id",
        "http_worker_ipc", "external_trace_header", "received_time", "routed_dp_rank", "data_parallel_rank",
        "disagg_prefill_dp_rank", "bootstrap_host", "bootstrap_port", "bootstrap_room", "bootstrap_pair_key",
        "decode_tp_size")},
    **{name: DEFAULT_ONLY for name in _GENERATE_WHY},
}


def is_empty(value: Any) -> bool:
    """A field's default or empty value: null, false, 0, "", [], {} (or a list of those, one per prompt)."""
    if value is None or value is False or value == 0 and not isinstance(value, bool) or value in ("", [], {}):
        return True
    return isinstance(value, list) and all(is_empty(v) for v in value)


def refuse_unsupported(body: GenerateBody) -> None:
    """400 ``unsupported`` for the first ``default only`` field set to something else."""
    for name, why in _GENERATE_WHY.items():
        if not is_empty(getattr(body, name)):
            raise GenerateFieldError(f"{name}: {why} are not supported by this engine", kind=E.UNSUPPORTED)
    for rank_field in ("routed_dp_rank", "data_parallel_rank", "disagg_prefill_dp_rank"):
        if getattr(body, rank_field) not in (None, 0):
            raise GenerateFieldError(f"{rank_field}: this engine has one data-parallel rank (0)",
                                     kind=E.UNSUPPORTED)
    params = body.sampling_params
    for sp in params if isinstance(params, list) else [params] if params is not None else []:
        for name, why in _SAMPLING_WHY.items():
            value = getattr(sp, name)
            if not is_empty(value) and not (name == "beam_width" and value == 1):
                raise GenerateFieldError(f"sampling_params.{name}: {why} is not supported by this engine",
                                         kind=E.UNSUPPORTED)
