"""HTTP bodies of the engine, strict: wrong types and unknown fields are 400s that name them.

``/generate``'s body is SGLang's, the same for every process: :mod:`handoff.protocol.generate_request`.
"""

from __future__ import annotations

from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field

from handoff.protocol.generate_request import GenerateBody, SamplingParamsBody
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
        stop_token_ids=tuple(body.stop_token_ids or ()), ignore_eos=value("ignore_eos", False),
        seed=None if seed is None else generator_seed(seed, sample_index),
        frequency_penalty=value("frequency_penalty", 0.0), presence_penalty=value("presence_penalty", 0.0),
        repetition_penalty=value("repetition_penalty", 1.0), min_new_tokens=value("min_new_tokens", 0),
        logit_bias=tuple(bias), skip_special_tokens=value("skip_special_tokens", True),
        spaces_between_special_tokens=value("spaces_between_special_tokens", True),
        no_stop_trim=value("no_stop_trim", False), stream_interval=value("stream_interval", 1))


class _OpenAIRequest(BaseModel):
    """Fields shared by the two OpenAI bodies. ``top_k``, ``ignore_eos``, ``stop_token_ids`` are extensions;
    features the engine lacks (``n`` > 1, logprobs, penalties) are refused, never silently ignored."""

    model_config = _STRICT
    model: str | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    n: Literal[1] = 1
    stream: bool = False
    stream_options: dict[str, bool] | None = None
    stop: Union[str, list[str], None] = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    ignore_eos: bool = False
    user: str | None = None
    presence_penalty: Literal[0] = 0
    frequency_penalty: Literal[0] = 0


class CompletionBody(_OpenAIRequest):
    """``POST /v1/completions``."""

    prompt: Union[str, list[str], list[int], list[list[int]]]
    max_tokens: int | None = 16
    logprobs: None = None
    echo: Literal[False] = False


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    role: str
    content: Union[str, list[dict[str, Any]], None] = None


class ChatCompletionBody(_OpenAIRequest):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: Literal[False] | None = None
