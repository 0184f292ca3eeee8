"""slime against the LB: its rollout request bodies and answer parsing, replayed.

slime is not on the package index (and imports Megatron and Ray); replayed
from THUDM/slime, ``slime/rollout/sglang_rollout.py`` at commit 0044b40d
(``GenerateState.sampling_params``: ``no_stop_trim`` true,
``spaces_between_special_tokens`` false, ``custom_params`` when ``top_p`` < 1,
``sampling_seed`` per sample under deterministic inference; ``generate``: the
payload ``{"sampling_params", "return_logprob": true, "input_ids"}``, partial
rollouts continuing with ``max_new_tokens`` minus what came; tokens and
logprobs from ``output_token_logprobs``) and ``slime/utils/types.py`` at commit
0d234f3e (``Sample.update_from_meta_info``: ``finish_reason["type"]`` to the
sample status, ``cached_tokens`` / ``prompt_tokens``, ``weight_version``).
"""

from __future__ import annotations

from typing import Any

PROMPT_IDS = [256] + [ord(c) for c in "slime asks"]


def sampling_params(*, top_p: float = 1.0, seed: int | None = None, max_response_len: int = 12) -> dict[str, Any]:
    params: dict[str, Any] = dict(temperature=1.0, top_p=top_p, top_k=-1, max_new_tokens=max_response_len,
                                  stop=None, stop_token_ids=None, skip_special_tokens=False, no_stop_trim=True,
                                  spaces_between_special_tokens=False)
    if top_p != 1.0:
        params["custom_params"] = {"return_top_p_token_ids": True}
    if seed is not None:
        params["sampling_seed"] = seed
    return params


class Sample:
    """The parts of slime's ``Sample`` that generation fills."""

    def __init__(self) -> None:
        self.tokens = list(PROMPT_IDS)
        self.response = ""
        self.response_length = 0
        self.rollout_log_probs: list[float] = []
        self.status = "pending"
        self.weight_versions: list[str] = []
        self.cached_tokens = self.total_prompt_tokens = 0

    def append(self, output: dict[str, Any]) -> None:
        meta_info = output["meta_info"]
        if "output_token_logprobs" in meta_info:
            tokens = [item[1] for item in meta_info["output_token_logprobs"]]
            log_probs = [item[0] for item in meta_info["output_token_logprobs"]]
        else:
            tokens, log_probs = [], []
        self.tokens += tokens
        self.response += output["text"]
        self.response_length += len(tokens)
        self.rollout_log_probs += log_probs
        self.cached_tokens += meta_info.get("cached_tokens", 0)
        self.total_prompt_tokens += meta_info.get("prompt_tokens", 0)
        if "weight_version" in meta_info:
            self.weight_versions.append(meta_info["weight_version"])
        self.status = {"length": "truncated", "abort": "aborted", "stop": "completed"}[
            meta_info["finish_reason"]["type"]]


def generate(http, sample: Sample, params: dict[str, Any]) -> Sample:
    params = dict(params)
    params["max_new_tokens"] -= sample.response_length
    payload = {"sampling_params": params, "return_logprob": True, "input_ids": sample.tokens}
    response = http.post("/generate", json=payload)
    response.raise_for_status()
    sample.append(response.json())
    return sample


def test_a_group_of_seeded_samples(http) -> None:
    group = [generate(http, Sample(), sampling_params(top_p=0.9, seed=1000 + i)) for i in range(4)]
    for sample in group:
        assert sample.response_length == len(sample.rollout_log_probs) > 0
        assert sample.status in ("truncated", "completed") and sample.weight_versions == ["default"]
    again = generate(http, Sample(), sampling_params(top_p=0.9, seed=1000))
    assert again.tokens == group[0].tokens  # the same seed samples the same tokens


def test_a_partial_rollout_continues_where_it_stopped(http) -> None:
    params = sampling_params(max_response_len=12) | {"temperature": 0, "max_new_tokens": 12}
    whole = generate(http, Sample(), params)
    partial = Sample()
    generate(http, partial, params | {"max_new_tokens": 5})  # cut short, as an abort would leave it
    generate(http, partial, params)                          # the rest of the budget: 12 - 5
    assert partial.response_length == whole.response_length
    assert partial.tokens == whole.tokens and partial.status == "truncated"
    assert partial.total_prompt_tokens == 2 * len(PROMPT_IDS) + 5
