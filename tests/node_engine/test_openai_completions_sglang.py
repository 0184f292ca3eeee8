"""``POST /v1/completions`` against SGLang 0.5.23's ``entrypoints/openai/serving_completions.py``, on a real engine
process (the package's ``builtin:tiny``) read with the ``openai`` client, and raw where the wire shape matters.

Expectations are derived from SGLang's code (cited per test). The tiny tokenizer is byte-level: a byte's id is its
value, ``<bos>`` 256 (added before a text prompt), ``<eos>`` 257, so ``"hi"`` is ``[256, 104, 105]``.
``logit_bias`` forces a token where a test needs one (SGLang biases the logits before sampling and logprobs).
"""

from __future__ import annotations

import json
from typing import Any, Iterator

import httpx
import openai
import pytest

from tests.support.procs import ServerProcess
from tests.support.sse import DONE, iter_events

pytestmark = pytest.mark.timeout(120)

GREEDY: dict[str, Any] = {"model": "m", "temperature": 0, "extra_body": {"ignore_eos": True}}
FORCE_H = {"logit_bias": {"104": 100}, "temperature": 0}  # every token "h"
BOS, EOS, H = 256, 257, 104


@pytest.fixture(scope="module")
def sdk(tiny_engine: ServerProcess) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=tiny_engine.url + "/v1", api_key="unused", timeout=60, max_retries=0) as client:
        yield client


@pytest.fixture(scope="module")
def raw(tiny_engine: ServerProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=tiny_engine.url, timeout=60) as client:
        yield client


def raw_stream(client: httpx.Client, body: dict[str, Any]) -> list[str]:
    """The ``data:`` payloads of a completions stream as sent, ``[DONE]`` included."""
    with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
        assert response.status_code == 200, response.read()
        return list(iter_events(response))


def test_prompt_forms_and_the_order_of_n_choices(sdk: openai.OpenAI) -> None:
    """Strings go to SGLang as ``text``, ids as ``input_ids`` (``serving_completions.py:98-103``); a prompt's ``n``
    choices are next to each other and ``echo`` repeats prompt ``idx // n`` (``:574-580``), an id prompt decoded
    with ``skip_special_tokens=True`` (``:673-696``); usage counts each prompt once (``usage_processor.py:25-31``)."""
    texts = sdk.completions.create(prompt=["hi", "yo"], n=2, max_tokens=2, echo=True, **GREEDY)
    ids = sdk.completions.create(prompt=[[BOS, H, 105], [BOS, 121, 111]], n=2, max_tokens=2, echo=True, **GREEDY)
    for answer in (texts, ids):
        assert [c.index for c in answer.choices] == [0, 1, 2, 3]
        assert [c.text[:2] for c in answer.choices] == ["hi", "hi", "yo", "yo"]
        assert answer.usage.prompt_tokens == 6 and answer.usage.completion_tokens == 8
        assert answer.usage.total_tokens == 14
    assert [c.text for c in ids.choices] == [c.text for c in texts.choices]  # the same prompt ids
    one_text = sdk.completions.create(prompt="hi", max_tokens=2, echo=True, **GREEDY)
    one_ids = sdk.completions.create(prompt=[BOS, H, 105], max_tokens=2, echo=True, **GREEDY)
    assert one_text.choices[0].text == one_ids.choices[0].text == texts.choices[0].text


@pytest.mark.parametrize("prompt", ["", [], [[]], [""], [0], [0, 0]])
def test_an_empty_prompt_is_a_400_by_sglangs_rule(sdk: openai.OpenAI, prompt: Any) -> None:
    """SGLang's ``_validate_request`` (``serving_completions.py:63-69``): ``not prompt`` or every item falsy, so the
    id prompt ``[0]`` is "empty" too (``[[0]]`` is not: the item is a non-empty list)."""
    with pytest.raises(openai.BadRequestError):
        sdk.completions.create(model="m", prompt=prompt, max_tokens=1)
    # ignore_eos: the tiny model samples <eos> now and then, which is a "stop"
    accepted = sdk.completions.create(prompt=[[0]], max_tokens=1, **GREEDY)
    assert accepted.choices[0].finish_reason == "length"


def test_logprobs_integer_semantics_with_and_without_echo(sdk: openai.OpenAI) -> None:
    """``logprobs`` k: SGLang asks for ``top_logprobs_num`` k (``serving_completions.py:119-120``) and the prompt's
    logprobs only with ``echo and logprobs`` (k >= 1, ``:89-92``, ``:585-592``); ``to_openai_style_logprobs``
    (``utils.py:126-174``) puts the prompt's entries first, ``text_offset`` -1 each; with k 0 there is no top row at
    all (``output_top_logprobs`` is left out of ``meta_info``, read as ``[]``); the first prompt token's logprob
    and top row are null (``logprob_result_processor.py:38``, ``tokenizer_manager.py:3127-3135``)."""
    assert sdk.completions.create(prompt="hi", max_tokens=2, **GREEDY).choices[0].logprobs is None
    zero = sdk.completions.create(prompt="hi", max_tokens=3, logprobs=0, **GREEDY).choices[0].logprobs
    assert len(zero.tokens) == len(zero.token_logprobs) == 3 and zero.top_logprobs == []
    assert zero.text_offset == [-1, -1, -1]
    zero_echo = sdk.completions.create(prompt="hi", max_tokens=3, logprobs=0, echo=True, **GREEDY).choices[0]
    assert zero_echo.text.startswith("hi") and zero_echo.logprobs.tokens == zero.tokens
    two = sdk.completions.create(prompt="hi", max_tokens=3, logprobs=2, **GREEDY).choices[0].logprobs
    assert len(two.top_logprobs) == 3
    for token, row in zip(two.tokens, two.top_logprobs, strict=True):
        assert len(row) == 2 and token in row  # greedy: the token is its row's best
    echo = sdk.completions.create(prompt="hi", max_tokens=3, logprobs=2, echo=True, **GREEDY).choices[0].logprobs
    assert echo.tokens == ["<bos>", "h", "i", *two.tokens] and echo.text_offset == [-1] * 6
    assert echo.token_logprobs[0] is None and echo.top_logprobs[0] is None
    assert all(isinstance(value, float) for value in echo.token_logprobs[1:])
    assert [len(row) for row in echo.top_logprobs[1:]] == [2] * 5
    assert echo.token_logprobs[3:] == pytest.approx(two.token_logprobs, abs=1e-4)


def test_a_stream_with_echo_and_logprobs_adds_up_to_the_answer(sdk: openai.OpenAI) -> None:
    """SGLang's stream (``serving_completions.py:283-333``): a choice's first chunk has the echo before its text and,
    with ``echo`` and ``logprobs`` >= 1, the prompt's logprobs before its tokens'; later chunks carry only their
    own tokens. Two prompts, ``n`` 2: the chunks of each index add up to the whole answer's choice."""
    body = {"prompt": ["hi", "yo"], "n": 2, "max_tokens": 3, "echo": True, "logprobs": 1, **GREEDY}
    whole = sdk.completions.create(**body)
    texts: dict[int, str] = {}
    tokens: dict[int, list[str]] = {}
    for chunk in sdk.completions.create(stream=True, **body):
        (choice,) = chunk.choices
        if choice.index not in texts:
            assert choice.text.startswith(["hi", "yo"][choice.index // 2])
            assert choice.logprobs.tokens[:3] == ["<bos>", *["hi", "yo"][choice.index // 2]]
            assert choice.logprobs.token_logprobs[0] is None and choice.logprobs.top_logprobs[0] is None
        texts[choice.index] = texts.get(choice.index, "") + choice.text
        tokens.setdefault(choice.index, []).extend(choice.logprobs.tokens)
    assert texts == {c.index: c.text for c in whole.choices}
    assert tokens == {c.index: c.logprobs.tokens for c in whole.choices}


@pytest.mark.parametrize("stream", [False, True])
def test_stops_finish_reasons_and_matched_stop(sdk: openai.OpenAI, stream: bool) -> None:
    """``finish_reason`` is SGLang's type and ``matched_stop`` its ``matched`` (``serving_completions.py:609-620``,
    ``:374-383``): a stop string (``schedule_batch.py:1923``), a ``stop_token_ids`` id or EOS (``:1873``, an int);
    the detokenizer trims the match unless ``no_stop_trim`` (``detokenizer_manager.py:194-219``);
    ``include_stop_str_in_output`` is vLLM's, not a field of SGLang's ``CompletionRequest`` (``protocol.py:365-441``),
    so it changes nothing."""
    def ask(**fields: Any) -> tuple[str, str | None, Any]:
        body = {"model": "m", "prompt": "hi", "max_tokens": 4, **fields}
        if not stream:
            choice = sdk.completions.create(**body).choices[0]
            return choice.text, choice.finish_reason, choice.model_extra["matched_stop"]
        chunks = [chunk.choices[0] for chunk in sdk.completions.create(stream=True, **body)]
        assert all(c.finish_reason is None for c in chunks[:-1])
        return "".join(c.text for c in chunks), chunks[-1].finish_reason, chunks[-1].model_extra["matched_stop"]

    assert ask(stop="hh", **FORCE_H) == ("", "stop", "hh")
    assert ask(stop=["x", "hh"], **FORCE_H, extra_body={"no_stop_trim": True}) == ("hh", "stop", "hh")
    assert ask(**FORCE_H, extra_body={"stop_token_ids": [H]}) == ("", "stop", H)
    assert ask(**FORCE_H, extra_body={"stop_token_ids": [H], "no_stop_trim": True}) == ("h", "stop", H)
    assert ask(stop="hh", **FORCE_H, extra_body={"include_stop_str_in_output": True}) == ("", "stop", "hh")
    to_eos = {"logit_bias": {str(EOS): 100}, "temperature": 0}
    assert ask(**to_eos) == ("", "stop", EOS)
    assert ask(**to_eos, extra_body={"ignore_eos": True, "skip_special_tokens": False}) == \
        ("<eos>" * 4, "length", None)
    assert ask(**FORCE_H) == ("hhhh", "length", None)


@pytest.mark.parametrize("fields", [{"max_tokens": 0}, {"max_tokens": None}, {"max_tokens": -1},
                                    {"max_tokens": 5000}, {"min_tokens": 3, "max_tokens": 2},
                                    {"logit_bias": {"320": 1}}, {"logit_bias": {"-1": 1}},
                                    {"logprobs": True}, {"echo": "yes"}, {"prompt": 5}, {"prompt": [1.5]},
                                    {"prompt": ["a", [1]]}, {"stream": None}, {"n": None}])
def test_bad_values_are_400_with_an_openai_error(raw: httpx.Client, fields: dict[str, Any]) -> None:
    """400 where SGLang refuses: ``max_tokens`` not a positive int (``protocol.py:378``, ``:448-453``), past the
    context (``tokenizer_manager.py:1353-1378``), ``min_tokens`` over it and ``logit_bias`` keys outside the
    vocabulary (``sampling_params.py:285-301``), a field of the wrong type (pydantic; ``http_server.py:635``
    answers 400). The body is SGLang's ``ErrorResponse`` in OpenAI's ``error`` envelope."""
    r = raw.post("/v1/completions", json={"prompt": "hi", **fields})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["object"] == "error" and error["code"] == 400 and error["message"] and error["type"]


def test_seed_user_and_an_empty_suffix_are_taken(sdk: openai.OpenAI) -> None:
    """``seed`` is SGLang's ``sampling_seed`` (``serving_completions.py:173``): the same seed, the same sample;
    ``user`` and ``suffix`` are declared (``protocol.py:385-388``): an empty ``suffix`` changes nothing (a
    non-empty one is refused by this engine, which has no completion template to place it, ``docs/api.md``)."""
    body = {"model": "m", "prompt": "hi", "max_tokens": 8, "temperature": 1.0, "user": "u", "suffix": ""}
    first, second = (sdk.completions.create(seed=7, **body).choices[0].text for _ in range(2))
    assert first == second
    with pytest.raises(openai.BadRequestError):
        sdk.completions.create(model="m", prompt="hi", max_tokens=1, suffix="x")


def test_a_stream_is_shaped_as_sglangs_completion_chunks(raw: httpx.Client) -> None:
    """SGLang dumps each chunk whole (``serving_completions.py:387-403``: ``model_dump_json()``), so ``usage`` is
    on every chunk, null unless ``continuous_usage_stats``; the usage chunk comes after every choice's last chunk,
    with ``choices: []`` and its nulls left out (``:478-496``: ``exclude_none=True``), then ``[DONE]`` (``:504``)."""
    body = {"prompt": ["hi", "yo"], "n": 2, "max_tokens": 2, "temperature": 0, "ignore_eos": True,
            "stream_options": {"include_usage": True}}
    *chunks, usage_chunk, done = raw_stream(raw, body)
    assert done == DONE
    for chunk in map(json.loads, chunks):
        assert "usage" in chunk and chunk["usage"] is None, chunk
        assert chunk["object"] == "text_completion" and len(chunk["choices"]) == 1
    last = json.loads(usage_chunk)
    assert last["choices"] == [] and last["object"] == "text_completion"
    assert last["usage"] == {"prompt_tokens": 6, "completion_tokens": 8, "total_tokens": 14, "reasoning_tokens": 0}

    continuous = raw_stream(raw, {**body, "stream_options": {"continuous_usage_stats": True}})
    assert continuous[-1] == DONE
    for chunk in map(json.loads, continuous[:-1]):  # no usage chunk: include_usage is not set
        assert len(chunk["choices"]) == 1
        assert set(chunk["usage"]) == {"prompt_tokens", "completion_tokens", "total_tokens", "reasoning_tokens",
                                       "prompt_tokens_details", "completion_tokens_details"}
