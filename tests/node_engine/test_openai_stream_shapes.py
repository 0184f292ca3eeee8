"""The OpenAI answers' shapes as the ``openai`` client reads them from SGLang 0.5.23, on the built-in tiny engine:
a chat stream's chunks (no empty-content chunk, logprobs all delivered, ``reasoning_content``), the chat's
``response_token_ids``, and ``stream_options.continuous_usage_stats``.

The tiny model's byte-level tokenizer makes many tokens that are part of a character: those outputs decode to
no text yet, which is what a chat stream must not send as a chunk of its own.
"""

from __future__ import annotations

from typing import Any, Iterator

import httpx
import openai
import pytest

from tests.support.procs import ServerProcess
from tests.support.sse import read_stream

pytestmark = pytest.mark.timeout(120)

MESSAGES = [{"role": "user", "content": "hi"}]
GREEDY = {"max_tokens": 16, "temperature": 0, "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def sdk(tiny_engine: ServerProcess) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=tiny_engine.url + "/v1", api_key="unused", timeout=60, max_retries=0) as client:
        yield client


def test_a_chat_stream_sends_no_chunk_without_content_and_loses_no_logprob(sdk: openai.OpenAI) -> None:
    """SGLang's stream loop sends a content chunk only for a non-empty delta (``serving_chat.py:1031-1033``): an
    output whose tokens decode to no text yet (part of a character, a held-back stop) is no chunk. Their
    logprobs ride on the next chunk with content (or the finish chunk), so a client gets one per token."""
    whole = sdk.chat.completions.create(model="m", messages=MESSAGES, logprobs=True, top_logprobs=2, n=2, **GREEDY)
    chunks = list(sdk.chat.completions.create(model="m", messages=MESSAGES, logprobs=True, top_logprobs=2, n=2,
                                              stream=True, **GREEDY))
    seen: set[int] = set()
    texts = {0: "", 1: ""}
    logprobs: dict[int, list[Any]] = {0: [], 1: []}
    for chunk in chunks:
        (choice,) = chunk.choices
        if choice.index not in seen:  # the role chunk comes first
            seen.add(choice.index)
            assert choice.delta.role == "assistant" and choice.delta.content == "" and choice.logprobs is None
            continue
        assert choice.delta.content or choice.finish_reason is not None, chunk
        texts[choice.index] += choice.delta.content or ""
        logprobs[choice.index] += choice.logprobs.content if choice.logprobs else []
    for i in (0, 1):
        assert texts[i] == whole.choices[i].message.content
        assert [(t.token, t.logprob) for t in logprobs[i]] == \
            [(t.token, t.logprob) for t in whole.choices[i].logprobs.content]
        assert len(logprobs[i]) == 16


def test_reasoning_content_is_null_as_sglang_sends_it(sdk: openai.OpenAI, tiny_engine: ServerProcess) -> None:
    """SGLang's deltas and messages always carry ``reasoning_content`` (null without a reasoning parser;
    ``sse_utils.StreamDelta`` keeps it so ``delta.reasoning_content`` reads None), and every stream choice
    ``logprobs``, ``finish_reason`` and ``matched_stop``."""
    whole = sdk.chat.completions.create(model="m", messages=MESSAGES, **GREEDY)
    assert whole.choices[0].message.reasoning_content is None
    chunks = list(sdk.chat.completions.create(model="m", messages=MESSAGES, stream=True, **GREEDY))
    assert chunks
    for chunk in chunks:
        assert chunk.choices[0].delta.reasoning_content is None
    with httpx.Client(base_url=tiny_engine.url, timeout=60) as client:
        events, saw_done = read_stream(client, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 4,
                                                                         "stream": True})
    assert saw_done and events
    for event in events:
        (choice,) = event["choices"]
        assert {"index", "delta", "logprobs", "finish_reason", "matched_stop"} <= choice.keys(), event
        assert "reasoning_content" in choice["delta"], event


def test_chat_token_ids_are_sglangs_response_token_ids(sdk: openai.OpenAI) -> None:
    """SGLang's chat choice names its output ids ``response_token_ids`` (``protocol.py``
    ``ChatCompletionResponseChoice``; completions' choice: ``token_ids``)."""
    answer = sdk.chat.completions.create(model="m", messages=MESSAGES, max_tokens=3, temperature=0,
                                         extra_body={"return_token_ids": True, "ignore_eos": True})
    extra = answer.choices[0].model_extra
    assert len(extra["response_token_ids"]) == 3 and "token_ids" not in extra
    assert len(extra["prompt_token_ids"]) == answer.usage.prompt_tokens
    completion = sdk.completions.create(model="m", prompt="hi", max_tokens=3, temperature=0,
                                        extra_body={"return_token_ids": True, "ignore_eos": True})
    assert len(completion.choices[0].model_extra["token_ids"]) == 3


@pytest.mark.parametrize("kind", ["chat", "completions"])
def test_continuous_usage_stats_give_each_chunk_its_choices_usage(sdk: openai.OpenAI, kind: str) -> None:
    """SGLang 0.5.23 puts ``usage`` (the choice's prompt and its tokens so far) on each content chunk of a chat
    stream and each chunk of a completions stream with ``continuous_usage_stats``, and ends with the usage
    chunk if ``include_usage`` (``serving_chat.py:1033-1050``, ``serving_completions.py:396-401``)."""
    options = {"include_usage": True, "continuous_usage_stats": True}
    if kind == "chat":
        stream = sdk.chat.completions.create(model="m", messages=MESSAGES, stream=True, stream_options=options, n=2,
                                             **GREEDY)
    else:
        stream = sdk.completions.create(model="m", prompt="hi", stream=True, stream_options=options, n=2, **GREEDY)
    chunks = list(stream)
    *body, last = chunks
    assert last.choices == [] and last.usage.completion_tokens == 32
    counts: dict[int, list[int]] = {0: [], 1: []}
    for chunk in body:
        (choice,) = chunk.choices
        text = choice.delta.content if kind == "chat" else choice.text
        if kind == "chat" and not text:  # the role and finish chunks carry none
            assert chunk.usage is None
            continue
        assert chunk.usage.prompt_tokens == last.usage.prompt_tokens
        assert chunk.usage.total_tokens == chunk.usage.prompt_tokens + chunk.usage.completion_tokens
        counts[choice.index].append(chunk.usage.completion_tokens)
    for i in (0, 1):
        assert counts[i] == sorted(counts[i]) and counts[i][-1] <= 16 and counts[i][0] >= 1


@pytest.mark.parametrize("model", ["builtin:tiny:my-adapter", "another-base:my-adapter"])
def test_a_model_naming_a_lora_adapter_is_refused_as_sglang_refuses_it(sdk: openai.OpenAI, model: str) -> None:
    """SGLang reads ``<base>:<adapter>`` in ``model`` as a LoRA adapter (``serving_base.py``
    ``_parse_model_parameter``) and, without LoRA, answers 400 (``tokenizer_manager.py``
    ``_validate_and_resolve_lora``): serving the base model instead would be a silent success."""
    with pytest.raises(openai.BadRequestError) as info:
        sdk.chat.completions.create(model=model, messages=MESSAGES, max_tokens=1)
    assert info.value.body["type"] == "unsupported" and "my-adapter" in info.value.body["message"]
    with pytest.raises(openai.BadRequestError):
        sdk.completions.create(model=model, prompt="hi", max_tokens=1)
    for name in ("builtin:tiny", "any-name", "trailing-colon:"):  # the served name itself has a colon
        assert sdk.chat.completions.create(model=name, messages=MESSAGES, max_tokens=1).model == name


def test_usage_has_every_key_of_sglangs_usage_info(sdk: openai.OpenAI) -> None:
    """SGLang 0.5.23's ``usage`` is its ``UsageInfo`` dumped whole (``protocol.py``, ``usage_processor.py``):
    without a reasoning parser or ``--enable-cache-report``, ``reasoning_tokens`` 0 and both details null, in a
    whole answer, the usage chunk and each continuous-usage chunk. A client written against SGLang reads
    ``usage.reasoning_tokens`` (the ``openai`` client keeps it as an extra field: missing, an ``AttributeError``)."""
    expected = {"prompt_tokens_details": None, "reasoning_tokens": 0, "completion_tokens_details": None}
    options = {"include_usage": True, "continuous_usage_stats": True}
    answers = [sdk.chat.completions.create(model="m", messages=MESSAGES, **GREEDY),
               sdk.completions.create(model="m", prompt="hi", **GREEDY)]
    chunks = [*sdk.chat.completions.create(model="m", messages=MESSAGES, stream=True, stream_options=options,
                                           **GREEDY),
              *sdk.completions.create(model="m", prompt="hi", stream=True, stream_options=options, **GREEDY)]
    usages = [answer.usage for answer in answers] + [chunk.usage for chunk in chunks if chunk.usage is not None]
    assert len(usages) > 4
    for usage in usages:
        assert usage.reasoning_tokens == 0 and usage.prompt_tokens_details is None, usage
        assert {key: usage.model_dump()[key] for key in expected} == expected, usage
