"""``sampling_params`` refused by SGLang 0.5.23 are 400 here, and those it takes are served (a differential test).

:func:`sglang_refusal` is SGLang's own checks, copied (pure Python) from ``sglang/srt/sampling/sampling_params.py``
(``SamplingParams.__post_init__``, ``normalize``, ``verify``) and ``sglang/srt/managers/tokenizer_manager.py``
(``_validate_one_request``); the engine answers the same body over HTTP. Values of the JSON type SGLang's field
takes, edge values included; left out are the differences ``docs/api.md`` documents (``top_k`` 0,
``repetition_penalty`` below float32's smallest normal, huge ``logit_bias`` values, seeds in [2**63, 2**64),
``seed``, the ``default only`` fields) and those that are no framework's values (an empty stop string,
``stop_token_ids`` outside the vocabulary, ``n`` null or below 1, a
float or bool for an integer field: SGLang's typed IPC decoding, not ``verify``, would meet those).
"""

from __future__ import annotations

import math
from typing import Any

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

VOCAB_SIZE = 320          # builtin:tiny
CONTEXT_LEN = 4096
PROMPT = [256] + [65] * 4079  # 16 tokens of room: max_new_tokens at the context's bound, and one past it

# sampling_params.py:42-44
_SAMPLING_EPS = 1e-6
TOP_K_ALL = 1 << 30
MAX_STOP_COUNT = 32


def sglang_refusal(sp: dict[str, Any], *, prompt_len: int) -> str | None:
    """The field SGLang 0.5.23 refuses ``sp`` for (a ``ValueError``, 400), or None if it takes it."""
    def value(name: str, default: Any) -> Any:
        return default if sp.get(name) is None else sp[name]

    # __post_init__ (sampling_params.py:191-251): null is the default, but max_new_tokens (:149) keeps its null
    max_new_tokens = sp.get("max_new_tokens", 128)
    temperature = value("temperature", 1.0)
    top_k = value("top_k", -1)
    if 0 <= temperature < _SAMPLING_EPS:
        top_k = 1
    if top_k == -1:
        top_k = TOP_K_ALL
    # normalize (sampling_params.py:333-343)
    stop = sp.get("stop")
    if stop is not None and len([stop] if isinstance(stop, str) else stop) > MAX_STOP_COUNT:
        return "stop"
    # verify (sampling_params.py:255-312)
    if not math.isfinite(temperature) or temperature < 0.0:
        return "temperature"
    if not 0.0 < value("top_p", 1.0) <= 1.0:
        return "top_p"
    if not 0.0 <= value("min_p", 0.0) <= 1.0:
        return "min_p"
    if top_k < 1:
        return "top_k"
    for name in ("frequency_penalty", "presence_penalty"):
        if not -2.0 <= value(name, 0.0) <= 2.0:
            return name
    if not 0.0 < value("repetition_penalty", 1.0) <= 2.0:
        return "repetition_penalty"
    min_new_tokens = value("min_new_tokens", 0)
    if not 0 <= min_new_tokens:
        return "min_new_tokens"
    if max_new_tokens is not None:
        if max_new_tokens < 0:
            return "max_new_tokens"
        if not min_new_tokens <= max_new_tokens:
            return "min_new_tokens"
    for key in value("logit_bias", {}):
        if not 0 <= int(key) < VOCAB_SIZE:
            return "logit_bias"
    seed = sp.get("sampling_seed")
    if seed is not None and not -(2**63) <= seed <= 2**63 - 1:
        return "sampling_seed"
    # tokenizer_manager.py:1353-1378: a given max_new_tokens must fit the context with the prompt
    if sp.get("max_new_tokens") is not None and sp["max_new_tokens"] + prompt_len > CONTEXT_LEN:
        return "max_new_tokens"
    return None


FIELDS: dict[str, list[Any]] = {
    "max_new_tokens": [None, 0, 1, 4, 16, 17, -1],  # 16: the prompt and it fill the context; 17: one past
    "min_new_tokens": [None, 0, 1, 3, 9, -1],
    "temperature": [None, 0, 1e-7, 0.5, 1, 2.0, -1e-7, -0.5],
    "top_p": [None, 1e-9, 0.5, 1, 1.0000001, 0, -0.5],
    "top_k": [None, -1, 1, 5, TOP_K_ALL, -2],
    "min_p": [None, 0, 0.5, 1, 1.5, -0.1],
    "frequency_penalty": [None, -2, 0.3, 2, 2.5, -2.01],
    "presence_penalty": [None, -2, 0.3, 2, 2.5, -2.01],
    "repetition_penalty": [None, 0.5, 1, 2, 2.1, 0, -1],
    "n": [None, 1, 2],
    "stop": [None, "x", [], ["a", "b"], ["s"] * 33],
    "stop_token_ids": [None, [], [5], [2, 300]],
    "ignore_eos": [None, True, False],
    "skip_special_tokens": [None, True, False],
    "spaces_between_special_tokens": [None, True, False],
    "no_stop_trim": [None, True, False],
    "stream_interval": [None, 0, 1, 3, -1],
    "logit_bias": [None, {}, {"65": 1.5}, {"319": -100.0}, {"320": 1.0}, {"-1": 1.0}],
    "sampling_seed": [None, 0, -(2**63), 2**63 - 1, -(2**63) - 1],
    "json_schema": [None, ""],
    "regex": [None, ""],
    "ebnf": [None, ""],
    "custom_params": [None, {}, {"k": 1}],
}


@st.composite
def sampling_params(draw: st.DrawFn) -> dict[str, Any]:
    """A few fields (so that one bad value is seldom hidden by another), each at one of its values."""
    names = draw(st.lists(st.sampled_from(sorted(FIELDS)), max_size=5, unique=True))
    return {name: draw(st.sampled_from(FIELDS[name])) for name in names}


@pytest.fixture(scope="module")
def client(tiny_engine):
    with httpx.Client(base_url=tiny_engine.url, timeout=30) as c:
        yield c


@settings(max_examples=60, deadline=None, derandomize=True)
@given(sp=sampling_params())
def test_the_engine_refuses_what_sglang_refuses(client, sp: dict[str, Any]) -> None:
    refusal = sglang_refusal(sp, prompt_len=len(PROMPT))
    r = client.post("/generate", json={"input_ids": PROMPT, "sampling_params": sp})
    if refusal is None:
        assert r.status_code == 200, f"SGLang takes {sp}; the engine answered {r.status_code}: {r.text}"
    else:
        assert r.status_code == 400, f"SGLang refuses {sp} ({refusal}); the engine answered {r.status_code}"
        assert r.json()["error"]["type"] == "invalid_request"


@pytest.mark.parametrize("top_k", [-2, 0, 5])
def test_a_greedy_temperature_takes_any_top_k_as_sglang_does(client, top_k: int) -> None:
    """SGLang makes a temperature below its epsilon ``top_k = 1`` before checking ``top_k``."""
    greedy = client.post("/generate", json={"input_ids": PROMPT, "sampling_params": {"temperature": 0,
                                                                                     "max_new_tokens": 4}})
    r = client.post("/generate", json={"input_ids": PROMPT, "sampling_params": {"temperature": 0, "top_k": top_k,
                                                                                "max_new_tokens": 4}})
    assert r.status_code == 200, r.text
    assert r.json()["output_ids"] == greedy.json()["output_ids"]
