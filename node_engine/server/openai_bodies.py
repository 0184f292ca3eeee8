"""The OpenAI bodies of the engine, as SGLang 0.5.23 takes them (``entrypoints/openai/protocol.py``): a field
SGLang's models do not declare is dropped unread and its name logged once
(:mod:`handoff.protocol.ignored_fields`); a declared field is typed strictly (a wrong type is a 400 naming it), and
one asking for what the engine lacks is 400 ``unsupported`` unless empty, never silently ignored. A chat's
messages are :mod:`node_engine.server.chat_messages`'s, its tools :mod:`node_engine.server.openai_tools`'s."""

from __future__ import annotations

from typing import Any, Union

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, field_validator, model_validator

from handoff.protocol.generate_request import MAX_TOP_LOGPROBS, is_empty
from handoff.service.errors import Unsupported
from node_engine.server.chat_messages import ChatMessage
from handoff.protocol.ignored_fields import IgnoresUnknown
from node_engine.server.openai_tools import Tool, ToolChoiceValue, default_tool_choice

__all__ = ["ChatCompletionBody", "CompletionBody", "OPENAI_DEFAULT_ONLY", "refuse_adapter_model",
           "refuse_unsupported_openai"]

_STRICT_VALUES = ConfigDict(strict=True)


class StreamOptions(IgnoresUnknown):
    ignored_where = "stream_options"
    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None


# Fields of SGLang's OpenAI bodies that its server copies into the ``/generate`` request: they go there as
# given, so ``/generate``'s rules (implemented, accepted as metadata, default only) apply to them unchanged.
FORWARDED_TO_GENERATE = ("extra_key", "cache_salt", "priority", "session_id", "session_params",
                         "data_parallel_rank", "return_routed_experts", "routed_experts_start_len",
                         "images_config", "mm_processor_kwargs", "bootstrap_host", "bootstrap_port", "bootstrap_room",
                         "routed_dp_rank", "disagg_prefill_dp_rank")


class _OpenAIRequest(IgnoresUnknown):
    """Fields shared by the two OpenAI bodies, as SGLang 0.5.23 takes them (``entrypoints/openai/protocol.py``):
    OpenAI's, and SGLang's sampling extensions (``top_k``, ``min_p``, ``min_tokens``, ``repetition_penalty``,
    ``stop_token_ids``, ``no_stop_trim``, ``ignore_eos``, ``skip_special_tokens``). Fields asking for what the
    engine lacks are 400 ``unsupported`` unless empty (:data:`OPENAI_DEFAULT_ONLY`), never silently ignored.
    ``model`` is any name, as in SGLang (the answer repeats it). Any other field is dropped unread, as SGLang's
    models drop it (:class:`IgnoresUnknown`): it never reaches :meth:`sampling_params` nor :meth:`forwarded`."""

    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: Union[str, list[str], None] = None
    seed: int | None = None
    user: str | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    top_k: int | None = None
    min_p: float | None = None
    min_tokens: int | None = None
    repetition_penalty: float | None = None
    stop_token_ids: list[int] | None = None
    no_stop_trim: bool | None = None
    ignore_eos: bool | None = None
    skip_special_tokens: bool | None = None
    rid: Union[str, list[str], None] = None
    return_token_ids: bool = False
    custom_params: dict[str, Any] | None = None
    watermark: Any = None
    # checked by /generate's rules (FORWARDED_TO_GENERATE)
    extra_key: Any = None
    cache_salt: Any = None
    priority: Any = None
    session_id: Any = None
    session_params: Any = None
    data_parallel_rank: Any = None
    return_routed_experts: Any = None
    routed_experts_start_len: Any = None
    images_config: Any = None
    mm_processor_kwargs: Any = None
    bootstrap_host: Any = None  # SGLang's PDRoutingFields (protocol.py), a base of both bodies
    bootstrap_port: Any = None
    bootstrap_room: Any = None
    routed_dp_rank: Any = None
    disagg_prefill_dp_rank: Any = None
    # default only
    response_format: Any = None
    regex: Any = None
    json_schema: Any = None
    ebnf: Any = None
    stop_regex: Any = None
    lora_path: Any = None
    custom_logit_processor: Any = None
    return_hidden_states: Any = None
    return_cached_tokens_details: Any = None
    return_spec_tokens_details: Any = None

    def sampling_params(self, max_new_tokens: int | None) -> dict[str, Any]:
        """``sampling_params`` of the equivalent ``/generate`` body (SGLang's ``_build_sampling_params``)."""
        return {key: value for key, value in {
            "max_new_tokens": max_new_tokens, "temperature": self.temperature, "top_p": self.top_p,
            "top_k": self.top_k, "min_p": self.min_p, "min_new_tokens": self.min_tokens, "stop": self.stop,
            "stop_token_ids": self.stop_token_ids, "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty, "repetition_penalty": self.repetition_penalty,
            "n": self.n, "no_stop_trim": self.no_stop_trim, "ignore_eos": self.ignore_eos,
            "skip_special_tokens": self.skip_special_tokens, "logit_bias": self.logit_bias,
            "sampling_seed": self.seed, "custom_params": self.custom_params,
            "watermark": self.watermark}.items() if value is not None}

    def forwarded(self) -> dict[str, Any]:
        """The fields SGLang copies into the ``/generate`` request, as given."""
        names = FORWARDED_TO_GENERATE + (("custom_labels",) if "custom_labels" in type(self).model_fields else ())
        return {name: getattr(self, name) for name in names if getattr(self, name) is not None}


OPENAI_DEFAULT_ONLY = {"response_format": "response_format (constrained decoding)",
                       "regex": "constrained decoding", "json_schema": "constrained decoding",
                       "ebnf": "constrained decoding", "stop_regex": "stop regexes", "lora_path": "LoRA adapters",
                       "custom_logit_processor": "custom logit processors", "return_hidden_states": "hidden states",
                       "best_of": "best_of sampling",
                       "suffix": "suffixes", "return_cached_tokens_details": "cached-token details",
                       "return_spec_tokens_details": "speculative decoding details",
                       "return_meta_info": "meta_info in choices", "return_input_ids_in_sglext": "sglext fields",
                       "return_output_ids_in_sglext": "sglext fields", "return_sampling_mask": "sampling masks",
                       "sampling_logprobs_mode": "sampling masks",
                       "return_flat_raw_output_top_logprobs": "flat top-logprob arrays",
                       "reasoning_effort": "reasoning models", "thinking": "reasoning models",
                       "task": "tasks",
                       "input_ids": "token-id chat prompts", "max_dynamic_patch": "multimodal input",
                       "min_dynamic_patch": "multimodal input", "use_audio_in_video": "multimodal input",
                       "video_config": "multimodal input"}


def refuse_unsupported_openai(body: BaseModel) -> None:
    """400 ``unsupported`` naming the first field set to what the engine cannot do."""
    for name, why in OPENAI_DEFAULT_ONLY.items():
        value = getattr(body, name, None)
        if name == "response_format" and isinstance(value, dict) and value.get("type") == "text":
            continue
        if name == "best_of" and value == getattr(body, "n", 1):
            continue
        if not is_empty(value):
            raise Unsupported(f"{name}: {why} are not supported by this engine")


def refuse_adapter_model(model: str | None, served_name: str) -> None:
    """400 ``unsupported`` for a ``model`` naming a LoRA adapter, as SGLang 0.5.23 reads it
    (``serving_base.py`` ``_parse_model_parameter``): ``<served name>:<adapter>``, or any other name with a
    colon split at its first. The served name itself, and a name with nothing after the colon, name none."""
    if model is None or ":" not in model or model == served_name:
        return
    prefix = served_name + ":"
    adapter = model[len(prefix):] if model.startswith(prefix) else model.split(":", 1)[1]
    if adapter.strip():
        raise Unsupported(f"model: {model[:200]!r} names the LoRA adapter {adapter.strip()[:100]!r}; LoRA adapters "
                          "are not supported by this engine")


class CompletionBody(_OpenAIRequest):
    """``POST /v1/completions``."""

    ignored_where = "/v1/completions body"

    prompt: Union[str, list[str], list[int], list[list[int]]]
    max_tokens: int = Field(default=16, ge=1)
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None
    custom_labels: Any = None

    @field_validator("prompt", mode="plain")
    @classmethod
    def _prompt(cls, value: Any) -> Any:
        return _check_prompt(value)


_PROMPT_LISTS = {str: TypeAdapter(list[str], config=_STRICT_VALUES), int: TypeAdapter(list[int], config=_STRICT_VALUES),
                 list: TypeAdapter(list[list[int]], config=_STRICT_VALUES)}


def _check_prompt(value: Any) -> Any:
    """A completion's prompt, validated as the one list type its first item names: trying each type of the
    union in turn would build one error per item of a long prompt (seconds for a few million ids)."""
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise ValueError("prompt must be a string, a list of strings, token ids, or lists of token ids")
    if not value:
        return value
    first = type(value[0])
    adapter = _PROMPT_LISTS.get(first)
    if adapter is None:
        raise ValueError(f"prompt items must be strings, token ids or lists of token ids, not {first.__name__}")
    try:
        return adapter.validate_python(value)
    except ValidationError as exc:
        error = exc.errors()[0]
        where = ".".join(str(part) for part in error["loc"])
        raise ValueError(f"prompt.{where}: {error['msg']}") from None


_EFFORT_LEVELS = ("none", "minimal", "low", "medium", "high", "xhigh", "ultra", "max")
_TRUE_WORDS = ("1", "true", "yes", "y", "on")


def reasoning_inputs(values: Any) -> Any:
    """SGLang's ``normalize_reasoning_inputs``: a ``reasoning`` object (not a declared field: read, then
    dropped) sets ``reasoning_effort`` from its ``effort`` (or ``reasoning_effort``), and with ``enabled`` (or
    ``enable``) true, ``thinking`` and ``enable_thinking`` in ``chat_template_kwargs`` unless given there."""
    if not isinstance(values, dict) or "reasoning" not in values:
        return values
    values = dict(values)
    reasoning = values.pop("reasoning")
    if not isinstance(reasoning, dict):
        return values
    effort = reasoning.get("effort")
    effort = reasoning.get("reasoning_effort") if effort is None else effort
    if isinstance(effort, str) and effort in _EFFORT_LEVELS:
        values["reasoning_effort"] = effort
    elif isinstance(effort, (int, float, str)) and not isinstance(effort, bool):
        try:
            values["reasoning_effort"] = float(effort)
        except ValueError:
            raise ValueError(f"invalid reasoning effort: {str(effort)[:40]!r}") from None
    elif effort is not None:
        raise ValueError(f"invalid reasoning effort: {str(effort)[:40]!r}")
    enabled = reasoning.get("enabled") if reasoning.get("enabled") is not None else reasoning.get("enable", False)
    if isinstance(enabled, str):
        enabled = enabled.strip().lower() in _TRUE_WORDS
    effort = values.get("reasoning_effort")
    thinking = effort != "none" if effort is not None else (True if enabled else None)
    if thinking is not None:
        kwargs = values.get("chat_template_kwargs")
        kwargs = dict(kwargs) if isinstance(kwargs, dict) else {}
        kwargs.setdefault("thinking", thinking)
        kwargs.setdefault("enable_thinking", thinking)
        values["chat_template_kwargs"] = kwargs
    return values


class ChatCompletionBody(_OpenAIRequest):
    """``POST /v1/chat/completions``."""

    ignored_where = "/v1/chat/completions body"

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[Tool] | None = None
    tool_choice: ToolChoiceValue = "auto"
    parallel_tool_calls: bool = True  # shapes only the schema of 'required' calls (refused): changes nothing
    chat_template_kwargs: dict[str, Any] | None = None
    return_prompt_token_ids: bool = False
    continue_final_message: bool = False  # a last assistant text is the answer's start (routes_openai._messages)
    # accepted: they change nothing without a reasoning parser or flat top-logprob arrays
    separate_reasoning: bool = True
    stream_reasoning: bool = True
    return_flat_raw_top_logprobs_b64: bool = True
    # default only
    return_meta_info: Any = None
    return_input_ids_in_sglext: Any = None
    return_output_ids_in_sglext: Any = None
    return_sampling_mask: Any = None
    sampling_logprobs_mode: Any = None
    return_flat_raw_output_top_logprobs: Any = None
    reasoning_effort: Any = None
    thinking: Any = None
    task: Any = None
    input_ids: Any = None
    max_dynamic_patch: Any = None
    min_dynamic_patch: Any = None
    use_audio_in_video: Any = None
    video_config: Any = None

    @model_validator(mode="before")
    @classmethod
    def _tool_choice_default(cls, values: Any) -> Any:
        return default_tool_choice(reasoning_inputs(values))

    @property
    def max_new_tokens(self) -> int | None:
        """SGLang's ``max_completion_tokens or max_tokens``: None lets the answer fill the context."""
        return self.max_completion_tokens or self.max_tokens
