"""The generation bodies as the API documents them, for the schemas of processes that relay them.

The LB and the sidecar pass generation bodies on untouched (the engine validates
them, strictly: see ``node_engine/server/openai_bodies.py``); these models describe
the common shapes in their ``GET /openapi.json``. Extra fields are allowed here
because the relays do not judge them.
"""

from __future__ import annotations

from typing import Any, Union

from pydantic import BaseModel, ConfigDict, Field

_FORWARDED = ConfigDict(extra="allow")


class SamplingParams(BaseModel):
    model_config = _FORWARDED
    max_new_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stop: Union[str, list[str], None] = None
    ignore_eos: bool | None = None
    seed: int | None = None


class GenerateRequest(BaseModel):
    """``POST /generate`` (SGLang shape): ``text`` or ``input_ids``, a list of either for a batch."""

    model_config = _FORWARDED
    text: Union[str, list[str], None] = None
    input_ids: Union[list[int], list[list[int]], None] = None
    sampling_params: SamplingParams | None = None
    stream: bool = False


class CompletionRequest(BaseModel):
    """``POST /v1/completions`` (OpenAI shape)."""

    model_config = _FORWARDED
    model: str | None = None
    prompt: Union[str, list[str], list[int], list[list[int]]]
    max_tokens: int | None = None
    stream: bool = False


class ChatMessage(BaseModel):
    model_config = _FORWARDED
    role: str
    content: Union[str, list[dict[str, Any]], None] = None


class ChatCompletionRequest(BaseModel):
    """``POST /v1/chat/completions`` (OpenAI shape)."""

    model_config = _FORWARDED
    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    stream: bool = False


# a generation answers JSON, or an SSE stream when the body asks for ``"stream": true`` (the schema of the
# stream is that of one event: its ``data`` is a JSON chunk, an error object, or ``[DONE]``)
_SSE_EVENT = {"type": "object", "properties": {"data": {"type": "string"}, "event": {"type": "string"}}}
GENERATION_RESPONSES: dict[str, Any] = {"responses": {"200": {"description": "the answer, or its stream", "content": {
    "application/json": {"schema": {}}, "text/event-stream": {"schema": _SSE_EVENT}}}}}

GENERATION_BODIES: dict[str, type[BaseModel]] = {
    "/generate": GenerateRequest,
    "/v1/completions": CompletionRequest,
    "/v1/chat/completions": ChatCompletionRequest,
}
