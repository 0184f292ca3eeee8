"""The OpenAI answers' shapes as the ``openai`` client reads them from SGLang 0.5.23, on the built-in tiny engine:
a chat stream's chunks (no empty-content chunk, logprobs all delivered, ``reasoning_content``), the chat's
``response_token_ids``, ``stream_options.continuous_usage_stats``, and the fields SGLang's bodies do not know,
dropped as SGLang drops them.

The tiny model's byte-level tokenizer makes many tokens that are part of a character: those outputs decode to
no text yet, which is what a chat stream must not send as a chunk of its own.
"""

from __future__ import annotations

import logging
from typing import Any, Iterator

import httpx
import openai
import pytest

from handoff.protocol import ignored_fields
from node_engine.server.openai_bodies import CompletionBody
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
    whole answer, the usage chunk and each continuous-usage chunk (a completions usage chunk leaves the nulls
    out, ``exclude_none``, which the client reads as null: ``test_openai_completions_sglang.py``). A client
    written against SGLang reads ``usage.reasoning_tokens`` (the ``openai`` client keeps it as an extra field:
    missing, an ``AttributeError``)."""
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


# fields SGLang 0.5.23's OpenAI bodies do not declare, which its models drop (pydantic's default, extra="ignore"):
# vLLM's extras, each of which would change the answer were it read
VLLM_EXTRAS = {"include_stop_str_in_output": True, "add_generation_prompt": False, "truncate_prompt_tokens": 1,
               "spaces_between_special_tokens": False, "add_special_tokens": True}


def test_fields_sglang_does_not_know_are_ignored_as_it_ignores_them(sdk: openai.OpenAI,
                                                                    tiny_engine: ServerProcess) -> None:
    """An RL loop sends OpenAI's own ``store``, ``metadata``, ``service_tier``, ``prompt_cache_key`` and vLLM's
    extras: SGLang's ``ChatCompletionRequest`` / ``CompletionRequest`` / ``StreamOptions`` / message models drop
    them, so they were 400 ``unknown field`` here only. Dropped, they change nothing (the answer is the one
    without them), and each name is logged once at WARNING, so a misspelt field shows."""
    chat = {"model": "m", "messages": MESSAGES, "max_tokens": 8, "temperature": 0}
    base = sdk.chat.completions.create(**chat, extra_body={"ignore_eos": True})
    answer = sdk.chat.completions.create(
        **chat, store=False, metadata={"run": "rl-step-7"}, service_tier="auto", prompt_cache_key="k",
        extra_body={"ignore_eos": True, "chat_extra_field_k": 1, **VLLM_EXTRAS})
    assert answer.choices[0].message.content == base.choices[0].message.content
    assert answer.usage.prompt_tokens == base.usage.prompt_tokens and answer.usage.completion_tokens == 8
    history = [{"role": "system", "content": "s", "refusal": None}, *MESSAGES]  # a message's unknown field too
    assert sdk.chat.completions.create(**{**chat, "messages": history}, metadata={"run": "rl-step-8"}).choices
    plain = sdk.completions.create(model="m", prompt="hi", max_tokens=8, temperature=0,
                                   extra_body={"ignore_eos": True})
    chunks = list(sdk.completions.create(
        model="m", prompt="hi", max_tokens=8, temperature=0, stream=True,
        stream_options={"include_usage": True, "include_obfuscation": False},  # OpenAI's newer stream option
        extra_body={"ignore_eos": True, "store": False, "metadata": {"run": "rl-step-7"}, **VLLM_EXTRAS}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == plain.choices[0].text
    assert chunks[-1].usage.prompt_tokens == plain.usage.prompt_tokens
    log = tiny_engine.log_path.read_text(errors="replace")
    for name in ("store", "metadata", "service_tier", "prompt_cache_key", "chat_extra_field_k", "refusal",
                 "include_obfuscation", *VLLM_EXTRAS):
        warned = [line for line in log.splitlines() if "WARNING" in line and f"ignored unknown field {name!r}" in line]
        assert warned, f"no warning names {name!r}"
    assert sum(f"ignored unknown field {'chat_extra_field_k'!r}" in line for line in log.splitlines()) == 1
    with pytest.raises(openai.BadRequestError):  # a known field keeps its strict type (SGLang takes 8.0)
        sdk.completions.create(model="m", prompt="hi", max_tokens=8, extra_body={"max_tokens": 8.0})


def test_the_names_of_ignored_fields_are_logged_once_each_and_bounded(monkeypatch: pytest.MonkeyPatch,
                                                                     caplog: pytest.LogCaptureFixture) -> None:
    """A client sending a new made-up field on every request (or a million in one body) fills no log: the first
    ``MAX_LOGGED_NAMES`` names each once, cut to ``MAX_NAME_CHARS``, then one line saying more were dropped."""
    monkeypatch.setattr(ignored_fields, "_logged", set())
    caplog.set_level(logging.WARNING, logger=ignored_fields.__name__)
    body = {"prompt": "hi", "x" * 10_000: 1, **{f"field_{i}": i for i in range(100_000)}}
    for _ in range(3):
        assert CompletionBody.model_validate(body).forwarded() == {}
    messages = [record.getMessage() for record in caplog.records]
    assert len(messages) == ignored_fields.MAX_LOGGED_NAMES + 1, messages[-3:]
    assert f"'{'x' * ignored_fields.MAX_NAME_CHARS}...'" in messages[0] and "field_0'" in messages[1]
    assert "their names are not logged" in messages[-1]
