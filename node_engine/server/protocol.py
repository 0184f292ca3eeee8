"""HTTP bodies of the engine, strict: wrong types and unknown fields are 400s that name them.

``/generate``'s body is SGLang's, the same for every process: :mod:`handoff.protocol.generate_request`.
"""

from __future__ import annotations

from typing import Any, Union

from pydantic import BaseModel, ConfigDict, Field

from handoff.protocol.generate_request import MAX_TOP_LOGPROBS, GenerateBody, SamplingParamsBody, is_empty
from handoff.service.errors import Unsupported
from node_engine.sampling import SamplingParams, generator_seed

_STRICT = ConfigDict(extra="forbid", strict=True)
MAX_BATCH = 256
__all__ = ["GenerateBody", "SamplingParamsBody", "to_sampling_params", "CompletionBody", "ChatCompletionBody"]


def to_sampling_params(body: SamplingParamsBody, default_max_new_tokens: int, *, vocab_size: int,
                       sample_index: int = 0) -> SamplingParams:
    """The engine's parameters for sample ``sample_index`` of ``body`` (sample j draws with seed + j).

    Raises ``ValueError`` naming the field for out-of-range values.
    """
    def value(name: str, default: Any) -> Any:
        given = getattr(body, name)
        return default if given is None else given

    if body.seed is not None and body.sampling_seed is not None and body.seed != body.sampling_seed:
        raise ValueError("give sampling_seed or its older name seed, not both")
    seed = body.sampling_seed if body.sampling_seed is not None else body.seed
    stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
    bias = []
    for key, amount in (body.logit_bias or {}).items():
        token = int(key) if key.isdigit() else None
        if token is None or not token < vocab_size:
            raise ValueError(f"logit_bias keys must be token ids in [0, {vocab_size}), got {key!r}")
        bias.append((token, amount))
    return SamplingParams(
        max_new_tokens=value("max_new_tokens", default_max_new_tokens), temperature=value("temperature", 1.0),
        top_p=value("top_p", 1.0), top_k=value("top_k", -1), min_p=value("min_p", 0.0), stop=stop,
        stop_token_ids=tuple(sorted(set(body.stop_token_ids or ()))), ignore_eos=value("ignore_eos", False),
        seed=None if seed is None else generator_seed(seed, sample_index),
        frequency_penalty=value("frequency_penalty", 0.0), presence_penalty=value("presence_penalty", 0.0),
        repetition_penalty=value("repetition_penalty", 1.0), min_new_tokens=value("min_new_tokens", 0),
        logit_bias=tuple(bias), skip_special_tokens=value("skip_special_tokens", True),
        spaces_between_special_tokens=value("spaces_between_special_tokens", True),
        no_stop_trim=value("no_stop_trim", False), stream_interval=value("stream_interval", 1))


class _OpenAIRequest(BaseModel):
    """Fields shared by the two OpenAI bodies, as SGLang 0.5.23 takes them (``entrypoints/openai/protocol.py``):
    OpenAI's, and SGLang's sampling extensions (``top_k``, ``min_p``, ``min_tokens``, ``repetition_penalty``,
    ``stop_token_ids``, ``no_stop_trim``, ``ignore_eos``, ``skip_special_tokens``). Fields asking for what the
    engine lacks are 400 ``unsupported`` unless empty (:data:`OPENAI_DEFAULT_ONLY`), never silently ignored."""

    model_config = _STRICT
    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stream: bool = False
    stream_options: dict[str, bool] | None = None
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
    # default only
    response_format: Any = None
    regex: Any = None
    json_schema: Any = None
    ebnf: Any = None
    stop_regex: Any = None
    lora_path: Any = None
    custom_logit_processor: Any = None
    return_hidden_states: Any = None

    def sampling_params(self, max_new_tokens: int | None) -> dict[str, Any]:
        """``sampling_params`` of the equivalent ``/generate`` body (SGLang's ``_build_sampling_params``)."""
        return {key: value for key, value in {
            "max_new_tokens": max_new_tokens, "temperature": self.temperature, "top_p": self.top_p,
            "top_k": self.top_k, "min_p": self.min_p, "min_new_tokens": self.min_tokens, "stop": self.stop,
            "stop_token_ids": self.stop_token_ids, "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty, "repetition_penalty": self.repetition_penalty,
            "n": self.n, "no_stop_trim": self.no_stop_trim, "ignore_eos": self.ignore_eos,
            "skip_special_tokens": self.skip_special_tokens, "logit_bias": self.logit_bias,
            "sampling_seed": self.seed}.items() if value is not None}


OPENAI_DEFAULT_ONLY = {"response_format": "response_format (constrained decoding)",
                       "regex": "constrained decoding", "json_schema": "constrained decoding",
                       "ebnf": "constrained decoding", "stop_regex": "stop regexes", "lora_path": "LoRA adapters",
                       "custom_logit_processor": "custom logit processors", "return_hidden_states": "hidden states",
                       "tools": "tool calls", "tool_choice": "tool calls", "best_of": "best_of sampling",
                       "suffix": "suffixes"}


def refuse_unsupported_openai(body: BaseModel) -> None:
    """400 ``unsupported`` naming the first field set to what the engine cannot do."""
    for name, why in OPENAI_DEFAULT_ONLY.items():
        value = getattr(body, name, None)
        if name == "response_format" and isinstance(value, dict) and value.get("type") == "text":
            continue
        if name == "tool_choice" and value in ("none", "auto") and not getattr(body, "tools", None):
            continue
        if name == "best_of" and value == getattr(body, "n", 1):
            continue
        if not is_empty(value):
            raise Unsupported(f"{name}: {why} are not supported by this engine")


class CompletionBody(_OpenAIRequest):
    """``POST /v1/completions``."""

    prompt: Union[str, list[str], list[int], list[list[int]]]
    max_tokens: int | None = 16
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    role: str
    content: Union[str, list[dict[str, Any]], None] = None


class ChatCompletionBody(_OpenAIRequest):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: Any = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
