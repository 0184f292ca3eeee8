"""HTTP bodies of the engine, strict: wrong types and unknown fields are 400s that name them."""

from __future__ import annotations

from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field

from node_engine.sampling import SamplingParams

_STRICT = ConfigDict(extra="forbid", strict=True)
MAX_BATCH = 256


class SamplingParamsBody(BaseModel):
    model_config = _STRICT
    max_new_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop: Union[str, list[str], None] = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    seed: int | None = None

    def to_params(self, default_max_new_tokens: int) -> SamplingParams:
        """Raises ``ValueError`` naming the field for out-of-range values."""
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        return SamplingParams(
            max_new_tokens=default_max_new_tokens if self.max_new_tokens is None else self.max_new_tokens,
            temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, stop=stop,
            stop_token_ids=tuple(self.stop_token_ids or ()), ignore_eos=self.ignore_eos, seed=self.seed)


class GenerateBody(BaseModel):
    """``POST /generate``: exactly one of ``text`` / ``input_ids``; a list of either is a batch."""

    model_config = _STRICT
    text: Union[str, list[str], None] = Field(default=None)
    input_ids: Union[list[int], list[list[int]], None] = None
    sampling_params: SamplingParamsBody | None = None
    stream: bool = False
    rid: Union[str, list[str], None] = None
    return_logprob: bool = False
    # Fields the LB adds for prefill/decode routing; a mixed engine accepts and ignores them.
    bootstrap_host: Any = None
    bootstrap_port: Any = None
    bootstrap_room: Any = None


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
