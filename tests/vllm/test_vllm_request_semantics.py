"""What vLLM 0.32 makes of the completion the sidecar sends for an SGLang ``/generate``: the body goes through
vLLM's own ``CompletionRequest`` and ``to_sampling_params`` (with the max_tokens its server computes), no server
started, and the resulting ``SamplingParams`` must sample as SGLang 0.5.23 would (``sampling/sampling_params.py``).
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from node_sidecar.engines.vllm_generate import to_completion

MAX_MODEL_LEN = 2048
# a model's generation_config.json as vLLM serves it by default (--generation-config auto): Qwen2.5-Instruct's
QWEN_DEFAULTS = {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05}


def vllm_params(body: dict[str, Any], defaults: dict[str, Any] | None = None) -> list[Any]:
    """The SamplingParams vLLM's completion server builds for each prompt of the sidecar's completion."""
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest
    from vllm.entrypoints.serve.utils.api_utils import get_max_tokens

    raw, _ = to_completion(json.dumps(body).encode(), max_model_len=MAX_MODEL_LEN)
    request = CompletionRequest(**json.loads(raw))
    prompts = request.prompt if isinstance(request.prompt, list) and isinstance(request.prompt[0], list) \
        else [request.prompt]
    out = []
    for prompt in prompts:
        max_tokens = get_max_tokens(MAX_MODEL_LEN, request.max_tokens, len(prompt), defaults or {})
        out.append(request.to_sampling_params(max_tokens, defaults or {}))
    return out


@pytest.mark.parametrize("sampling_params", [{"max_new_tokens": 4}, {
    "max_new_tokens": 4, "temperature": None, "top_p": None, "top_k": None, "min_p": None,
    "repetition_penalty": None, "presence_penalty": None, "frequency_penalty": None}])
def test_sglangs_defaults_not_the_models_generation_config(sampling_params: dict[str, Any]) -> None:
    """SGLang's /generate samples with SamplingParams' defaults (temperature 1, top_p 1, all of top_k, no
    penalties) whatever the model's generation_config.json says; vLLM fills what the request leaves out from it."""
    (params,) = vllm_params({"input_ids": [1, 2, 3], "sampling_params": sampling_params}, QWEN_DEFAULTS)
    assert params.temperature == 1.0 and params.top_p == 1.0 and params.top_k in (0, -1)
    assert params.repetition_penalty == 1.0 and params.min_p == 0.0
    assert params.presence_penalty == 0.0 and params.frequency_penalty == 0.0


def test_max_new_tokens_null_is_the_context_not_128() -> None:
    """SGLang: an explicit null max_new_tokens is no limit but the context (scheduler.py init_req_max_new_tokens)."""
    (params,) = vllm_params({"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": None}})
    assert params.max_tokens == MAX_MODEL_LEN - 3
    (params,) = vllm_params({"input_ids": [1, 2, 3]})
    assert params.max_tokens == 128  # left out: SGLang's default


@pytest.mark.parametrize("temperature", [0, 0.0, 5e-7])
def test_below_sglangs_greedy_threshold_is_greedy(temperature: float) -> None:
    """SGLang samples greedily for 0 <= temperature < 1e-6; vLLM raises a temperature under 0.01 to 0.01 and
    samples. n > 1 greedy is n equal answers in SGLang (vLLM refuses n > 1 when greedy)."""
    params = vllm_params({"input_ids": [1, 2], "sampling_params": {"temperature": temperature, "n": 2}})
    assert len(params) == 2 and all(p.temperature == 0 and p.n == 1 for p in params)


def test_a_temperature_vllm_refuses_is_unsupported_naming_it() -> None:
    """SGLang takes any finite temperature >= 0; vLLM refuses one above 2: refused by the sidecar, named."""
    from handoff.service.errors import Unsupported

    with pytest.raises(Unsupported, match="sampling_params.temperature"):
        vllm_params({"input_ids": [1], "sampling_params": {"temperature": 2.5}})
    (params,) = vllm_params({"input_ids": [1], "sampling_params": {"temperature": 2.0}})
    assert params.temperature == 2.0


def test_max_new_tokens_0_reaches_vllm_as_a_request_it_serves() -> None:
    """SGLang serves max_new_tokens 0 (the prompt scored); vLLM refuses max_tokens 0 (its least is 1)."""
    (params,) = vllm_params({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 0}, "return_logprob": True,
                             "logprob_start_len": 0})
    assert params.max_tokens == 1 and params.prompt_logprobs == 0


@pytest.mark.parametrize("sampling_params, field", [
    ({"stop_token_ids": [2, None]}, "sampling_params.stop_token_ids.1"),
    ({"top_k": True}, "sampling_params.top_k"), ({"top_k": "5"}, "sampling_params.top_k"),
    ({"max_new_tokens": 4.0}, "sampling_params.max_new_tokens")])
def test_a_value_of_another_type_than_sglangs_is_refused_naming_it(sampling_params: dict[str, Any],
                                                                    field: str) -> None:
    """SGLang 0.5.23's HTTP contract (``api_types.py`` ``decode_Int64List``, ``_expect_int``) refuses a null inside
    stop_token_ids and a top_k or max_new_tokens that is not an integer (400); vLLM's completion either refused it
    in its own words or coerced it (true became top_k 1, "5" became 5)."""
    from handoff.service.errors import InvalidRequest

    with pytest.raises(InvalidRequest, match=field.replace(".", r"\.")):
        vllm_params({"input_ids": [1, 2], "sampling_params": sampling_params})


@pytest.mark.parametrize("top_k", [-5, 0, 1, 7])
def test_greedy_takes_any_top_k_as_sglang_does(top_k: int) -> None:
    """SGLang's greedy override (temperature below 1e-6) replaces top_k before checking it (sampling_params.py:
    245-248, then 263): any integer is served greedily. vLLM checks top_k < -1 first and refused it."""
    (params,) = vllm_params({"input_ids": [1, 2], "sampling_params": {"temperature": 0, "top_k": top_k}})
    assert params.temperature == 0 and params.top_k in (0, -1)


def test_top_k_0_sampling_is_the_whole_vocabulary_as_on_handoffs_engine() -> None:
    """SGLang refuses top_k 0 unless greedy (sampling_params.py:263); handoff's engine takes it for off, and so
    does a vLLM node (vLLM's own meaning), so one body gets one answer across a mixed cluster."""
    (params,) = vllm_params({"input_ids": [1, 2], "sampling_params": {"temperature": 1.0, "top_k": 0}})
    assert params.top_k in (0, -1) and params.temperature == 1.0
