"""Prompts and events of the generation endpoints: length guard, tokenizing, SSE framing, engine errors.

Prompts too long to ever fit are refused before they are tokenized, and the
others are tokenized off the event loop (:func:`tokenize`): a megabyte prompt
costs the tokenizer seconds, and the loop must keep answering ``/health``
meanwhile, or the sidecar takes the engine for dead. Running the sequences of
a request is :mod:`node_engine.server.generation_run`.
"""

from __future__ import annotations

import asyncio
import json
import weakref
from typing import Any

from handoff.service.errors import InvalidRequest, ServiceError, error_envelope
from node_engine.engine import Engine
from node_engine.errors import EngineStopped, MemoryReleased, StepFailed, WeightsNotLoaded
from node_engine.request import RequestOutput
from node_engine.tokenizer import Tokenizer

DONE_EVENT = b"data: [DONE]\n\n"
_LONGEST_TOKEN_CHARS: "weakref.WeakKeyDictionary[Tokenizer, int]" = weakref.WeakKeyDictionary()


def longest_token_chars(tokenizer: Tokenizer) -> int:
    """The most characters one token of ``tokenizer`` decodes to (computed once per tokenizer: call it at
    start, a large vocabulary takes a fraction of a second)."""
    longest = _LONGEST_TOKEN_CHARS.get(tokenizer)
    if longest is None:
        longest = max((len(tokenizer.decode([i], skip_special_tokens=False)) for i in range(tokenizer.vocab_size)),
                      default=1)
        _LONGEST_TOKEN_CHARS[tokenizer] = longest
    return longest


def max_prompt_chars(engine: Engine) -> int:
    """More characters than any prompt that fits the context can have: every token stands for at most the
    longest token's characters (one more for a leading space a decoder drops, doubled for normalizers that
    shrink text)."""
    return engine.runner.kv_plan.context_len * (longest_token_chars(engine.tokenizer) + 1) * 2


def check_prompt_length(engine: Engine, texts: list[str]) -> None:
    """400 for a text that cannot fit the context whatever it tokenizes to, before any tokenizing: a
    megabyte prompt costs the tokenizer seconds, and it holds the event loop meanwhile."""
    for text in texts:
        check_prompt_chars(engine, len(text))


def check_prompt_chars(engine: Engine, num_chars: int) -> None:
    """400 for a prompt of ``num_chars`` characters (all a chat template renders, for a chat) that cannot fit."""
    limit = max_prompt_chars(engine)
    if num_chars > limit:
        raise InvalidRequest(f"a prompt of {num_chars} characters can never fit the context of "
                             f"{engine.runner.kv_plan.context_len} tokens (at most {limit} characters)")


def check_prompt_ids(engine: Engine, prompt: list[int] | list[list[int]]) -> None:
    """400 for a token-id prompt as long as the context or longer, before its ids are copied and checked again."""
    is_one = bool(prompt) and isinstance(prompt[0], int)
    lengths = [len(prompt)] if is_one else [len(ids) for ids in prompt]  # type: ignore[arg-type]
    engine.gate.check_within_context(max(lengths, default=0))


async def tokenize(engine: Engine, texts: list[str]) -> list[list[int]]:
    """The token ids of ``texts`` (each checked with :func:`check_prompt_length` first), computed in a worker
    thread so that the event loop is free whenever the tokenizer releases the GIL."""
    check_prompt_length(engine, texts)
    return await asyncio.to_thread(lambda: [engine.tokenizer.encode(text) for text in texts])


def sse_event(payload: Any) -> bytes:
    return b"data: " + json.dumps(payload, ensure_ascii=False).encode() + b"\n\n"


def generate_error_event(exc: ServiceError) -> bytes:
    """``/generate``'s stream error event: the envelope with SGLang 0.5.23's ``code`` (the status) beside
    ``type`` and ``message``, and its ``retryable: false`` on a refusal (``http_server.py`` ``stream_results``)."""
    fields: dict[str, Any] = {"code": exc.status}
    if exc.status < 500:
        fields["retryable"] = False
    return sse_event(error_envelope(exc.type, exc.message, **{**exc.extra, **fields}))


def openai_error(exc: ServiceError) -> ServiceError:
    """``exc`` with SGLang 0.5.23's ``ErrorResponse`` fields (``object``, ``param``, ``code``: the status) in its
    ``error`` object beside ``type`` and ``message``: what the ``openai`` client reads as ``code`` and ``param``."""
    exc.extra = {**exc.extra, "object": "error", "param": None, "code": exc.status}
    return exc


def output_error(output: RequestOutput) -> ServiceError:
    """The HTTP error for a request the engine refused or failed: a failed step is a 500 ``engine_failed``,
    a refusal a 503 naming why (nothing ran, so the request may go elsewhere)."""
    message = output.error or "request failed"
    if output.error_type == StepFailed.type:
        return StepFailed(message)
    if output.error_type == MemoryReleased.type:
        return MemoryReleased(message, retry_after=1)
    if output.error_type == WeightsNotLoaded.type:
        return WeightsNotLoaded(message)
    return EngineStopped(message)
