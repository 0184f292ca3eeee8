"""The ``openai`` package against the LB: models, completions and chat with ``n``, logprobs, echo, penalties,
``logit_bias``, ``seed``, ``stop``, ``user``, streams; features the engine lacks are a 400, never ignored."""

from __future__ import annotations

import openai
import pytest

MODEL = "builtin:tiny"


@pytest.fixture(scope="module")
def sdk(lb_url: str):
    with openai.OpenAI(base_url=lb_url + "/v1", api_key="none", timeout=60, max_retries=0) as client:
        yield client


def test_models(sdk) -> None:
    assert [m.id for m in sdk.models.list()] == [MODEL]
    assert sdk.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError) as info:
        sdk.models.retrieve("another-model")
    assert (info.value.code, info.value.param) == ("model_not_found", "model")  # SGLang's (retrieve_model)


def test_completions_with_n_logprobs_echo_and_sampling_fields(sdk) -> None:
    result = sdk.completions.create(model=MODEL, prompt="Hello there", max_tokens=6, n=2, logprobs=3, echo=True,
                                    presence_penalty=0.5, frequency_penalty=0.5, logit_bias={"65": 1.0}, seed=7,
                                    stop=["\n\n"], user="tester", temperature=0.8)
    assert len(result.choices) == 2 and [c.index for c in result.choices] == [0, 1]
    for choice in result.choices:
        assert choice.text.startswith("Hello there")
        lp = choice.logprobs
        # echo with logprobs: the prompt's tokens first (its first without a logprob), then the output's
        assert lp.token_logprobs[0] is None and len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs)
        assert all(len(top) <= 3 for top in lp.top_logprobs[1:])
    assert result.usage.completion_tokens <= 12 and result.usage.prompt_tokens == 12  # BOS + 11, counted once
    again = sdk.completions.create(model=MODEL, prompt="Hello there", max_tokens=6, n=2, seed=7, temperature=0.8,
                                   presence_penalty=0.5, frequency_penalty=0.5, logit_bias={"65": 1.0},
                                   stop=["\n\n"])
    assert [c.text for c in again.choices] == [c.text[len("Hello there"):] for c in result.choices]


def test_chat_with_n_logprobs_and_a_stream(sdk) -> None:
    messages = [{"role": "user", "content": "hi"}]
    result = sdk.chat.completions.create(model=MODEL, messages=messages, max_tokens=5, n=3, logprobs=True,
                                         top_logprobs=2, seed=3, temperature=0.9)
    assert len(result.choices) == 3
    for choice in result.choices:
        content = choice.logprobs.content
        assert len(content) == result.usage.completion_tokens // 3 or len(content) <= 5
        assert all(len(token.top_logprobs) == 2 and token.logprob <= 0 for token in content)
        assert all(bytes(token.bytes) for token in content)
    chunks = list(sdk.chat.completions.create(model=MODEL, messages=messages, max_tokens=5, n=2, stream=True,
                                              stream_options={"include_usage": True}, temperature=0))
    texts = {0: "", 1: ""}
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
    assert texts[0] == texts[1] and chunks[-1].usage.completion_tokens == 10
    whole = sdk.chat.completions.create(model=MODEL, messages=messages, max_tokens=5, temperature=0)
    assert whole.choices[0].message.content == texts[0]


def test_completion_stream_with_logprobs(sdk) -> None:
    stream = sdk.completions.create(model=MODEL, prompt="stream me", max_tokens=6, logprobs=1, stream=True,
                                    temperature=0)
    chunks = list(stream)
    tokens = [t for c in chunks for t in (c.choices[0].logprobs.tokens if c.choices[0].logprobs else [])]
    text = "".join(c.choices[0].text for c in chunks)
    whole = sdk.completions.create(model=MODEL, prompt="stream me", max_tokens=6, logprobs=1, temperature=0)
    assert text == whole.choices[0].text and tokens == whole.choices[0].logprobs.tokens


@pytest.mark.parametrize("extra", [{"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}],
                                    "tool_choice": "required"},
                                   {"response_format": {"type": "json_object"}}])
def test_what_the_engine_cannot_do_is_a_400(sdk, extra: dict) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        sdk.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=2, **extra)
    assert info.value.body["type"] == "unsupported"
