"""Every field of SGLang 0.5.23's ``/generate`` body: implemented, accepted, or refused as unsupported."""

from __future__ import annotations

import httpx
import pytest

from handoff.protocol.generate_request import (ACCEPTED, DEFAULT_ONLY, GENERATE_FIELDS, SAMPLING_FIELDS,
                                               GenerateBody, SamplingParamsBody)
from tests.support.sse import read_stream

GREEDY = {"temperature": 0, "ignore_eos": True, "max_new_tokens": 4}
EOS = 257


@pytest.fixture(scope="module")
def client(tiny_engine):
    with httpx.Client(base_url=tiny_engine.url, timeout=30) as c:
        yield c


def gen(client: httpx.Client, body: dict) -> dict | list:
    r = client.post("/generate", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def refused(client: httpx.Client, body: dict) -> dict:
    r = client.post("/generate", json=body)
    assert r.status_code == 400, r.text
    return r.json()["error"]


def test_the_field_lists_match_the_bodies() -> None:
    assert set(GENERATE_FIELDS) == set(GenerateBody.model_fields)
    assert set(SAMPLING_FIELDS) == set(SamplingParamsBody.model_fields)


def test_every_field_at_its_default_is_accepted_together(client) -> None:
    """What sglang-router sends: every field, most at their default (sgl-model-gateway's GenerateRequest)."""
    defaults = {name: GenerateBody.model_fields[name].default for name, kind in GENERATE_FIELDS.items()
                if kind in (ACCEPTED, DEFAULT_ONLY)}
    sampling = {name: SamplingParamsBody.model_fields[name].default for name in SAMPLING_FIELDS}
    sampling.update(GREEDY)
    body = {**defaults, "text": "every field", "sampling_params": sampling, "model": None, "rid": None,
            "return_logprob": False, "logprob_start_len": -1, "top_logprobs_num": 0, "token_ids_logprob": None,
            "return_text_in_logprobs": False, "stream": False, "image_data": [], "lora_path": [None],
            "return_hidden_states": False, "log_metrics": True, "routed_experts_start_len": 0}
    answer = gen(client, body)
    assert len(answer["output_ids"]) == 4


# a set value of the JSON type SGLang's contract gives the field (one of another type is a 400 invalid_request)
SET_VALUES = {"images_config": {"prefix": "p"}, "return_hidden_states": True, "routed_experts_start_len": 3,
              "return_sampling_mask": True, "require_reasoning": True, "max_thinking_tokens": 8,
              "kv_hints": {"protocol_version": "1", "message_id": "m"}}


@pytest.mark.parametrize("name", [n for n, kind in GENERATE_FIELDS.items() if kind == DEFAULT_ONLY])
def test_a_value_this_engine_cannot_honour_is_unsupported(client, name: str) -> None:
    error = refused(client, {"text": "x", name: SET_VALUES.get(name, ["something"])})
    assert error["type"] == "unsupported" and error["message"].startswith(name)


@pytest.mark.parametrize("name,value", [("json_schema", '{"type": "object"}'), ("regex", "a+"), ("ebnf", "x"),
                                        ("structural_tag", "{}"), ("stop_regex", "a"), ("beam_width", 2),
                                        ("choice", ["a"]), ("watermark", {"enabled": True})])
def test_sampling_features_this_engine_lacks_are_unsupported(client, name: str, value) -> None:
    error = refused(client, {"text": "x", "sampling_params": {name: value}})
    assert error["type"] == "unsupported" and error["message"].startswith(f"sampling_params.{name}")


@pytest.mark.parametrize("body,fragment", [
    ({"text": "x", "sampling_params": {"temprature": 1}}, "unknown field"),
    ({"text": "x", "surprise": 1, "sampling_params": [{"temprature": 1}]}, "unknown field"),
    ({"text": "x", "bootstrap_room": "not a number"}, "bootstrap_room"),
    ({"text": "x", "return_hidden_states": 0}, "return_hidden_states"),
    ({"text": "x", "model": "another-model"}, "another-model"),
    ({"text": ["a", "b"], "rid": ["same", "same"]}, "unique"),
    ({"text": ["a", "b"], "rid": ["one"]}, "rid"),
    ({"text": "x", "sampling_params": {"sampling_seed": 1, "seed": 2}}, "seed"),
    ({"text": "x", "sampling_params": {"logit_bias": {"999999": 1.0}}}, "logit_bias"),
    ({"text": "x", "sampling_params": {"min_new_tokens": 9, "max_new_tokens": 4}}, "min_new_tokens"),
    ({"text": "x", "sampling_params": {"repetition_penalty": 0}}, "repetition_penalty"),
    ({"text": "x", "sampling_params": {"min_p": 1.5}}, "min_p"),
    ({"text": "x", "return_logprob": True, "logprob_start_len": 99}, "logprob_start_len"),
    ({"text": "x", "return_logprob": True, "token_ids_logprob": [10**7]}, "token_ids_logprob"),
    ({"text": "x", "routed_dp_rank": 1}, "routed_dp_rank"),
])
def test_bad_values_are_400(client, body: dict, fragment: str) -> None:
    assert fragment in refused(client, body)["message"]


def test_unknown_top_level_keys_are_ignored_as_sglang_ignores_them(client) -> None:
    """SGLang 0.5.23's contract ignores a top-level key it does not know (a field of another SGLang version, sent
    by a framework written for it): the request is served as without it, stream or not; ``null`` for ``stream`` and
    ``return_text_in_logprobs`` is their default there. Before: a 400 ``unknown field``."""
    plain = gen(client, {"text": "x", "sampling_params": GREEDY})
    body = {"text": "x", "sampling_params": GREEDY, "surprise": 1, "another_versions_field": {"a": [1]},
            "stream": None, "return_text_in_logprobs": None}
    assert gen(client, body)["output_ids"] == plain["output_ids"]
    events, done = read_stream(client, "/generate", {**body, "stream": True})
    assert done and events[-1]["output_ids"] == plain["output_ids"]


def test_model_may_name_the_served_model(client) -> None:
    assert gen(client, {"text": "x", "model": "builtin:tiny", "sampling_params": GREEDY})["output_ids"]


def test_logit_bias_skip_special_tokens_and_no_stop_trim(client) -> None:
    forced = gen(client, {"text": "x", "sampling_params": dict(GREEDY, logit_bias={"65": 100.0})})
    assert forced["output_ids"] == [65] * 4 and forced["text"] == "AAAA"
    to_eos = {"temperature": 0, "max_new_tokens": 4, "logit_bias": {str(EOS): 100.0}}
    plain = gen(client, {"text": "x", "sampling_params": to_eos})
    assert plain["output_ids"] == [EOS] and plain["text"] == ""
    assert plain["meta_info"]["finish_reason"] == {"type": "stop", "matched": EOS}
    shown = gen(client, {"text": "x", "sampling_params": dict(to_eos, skip_special_tokens=False, no_stop_trim=True)})
    assert shown["text"] == "<eos>"
    trimmed = gen(client, {"text": "x", "sampling_params": dict(to_eos, skip_special_tokens=False)})
    assert trimmed["text"] == ""


def test_min_p_one_keeps_only_the_most_likely_token(client) -> None:
    greedy = gen(client, {"text": "min p", "sampling_params": dict(GREEDY, max_new_tokens=12)})
    sampled = gen(client, {"text": "min p", "sampling_params": {"temperature": 1.5, "min_p": 1.0, "ignore_eos": True,
                                                                 "max_new_tokens": 12, "sampling_seed": 3}})
    wide = [gen(client, {"text": "min p", "sampling_params": {"temperature": 1.5, "ignore_eos": True,
                                                               "max_new_tokens": 12, "sampling_seed": seed}})
            for seed in (3, 4)]
    assert sampled["output_ids"] == greedy["output_ids"]
    assert any(w["output_ids"] != greedy["output_ids"] for w in wide)  # without min_p, sampling wanders


def test_sampling_seed_and_its_older_name(client) -> None:
    def sampled(params: dict) -> list[int]:
        body = {"text": "seeded", "sampling_params": {"temperature": 1.0, "max_new_tokens": 16, "ignore_eos": True,
                                                      **params}}
        return gen(client, body)["output_ids"]
    assert sampled({"sampling_seed": 5}) == sampled({"seed": 5}) == sampled({"sampling_seed": 5, "seed": 5})
    assert sampled({"sampling_seed": 5}) != sampled({"sampling_seed": 6})
    assert sampled({"sampling_seed": -5}) == sampled({"sampling_seed": 2**64 - 5})


def test_stream_interval_spaces_the_events(client) -> None:
    events, saw_done = read_stream(client, "/generate", {"text": "x", "stream": True, "sampling_params": dict(
        GREEDY, max_new_tokens=10, stream_interval=4)})
    assert saw_done and [e["meta_info"]["completion_tokens"] for e in events] == [1, 5, 9, 10]


def test_rids_cache_salt_and_prompt_token_ids(client) -> None:
    batch = gen(client, {"text": ["a", "b"], "rid": "batch", "sampling_params": GREEDY})
    assert [a["meta_info"]["id"] for a in batch] == ["batch_0", "batch_1"]
    salted = [gen(client, {"input_ids": [256, 1, 2, 3, 4, 5], "cache_salt": "tenant", "sampling_params": GREEDY,
                           "return_prompt_token_ids": True}) for _ in range(2)]
    assert [a["meta_info"]["cached_tokens"] for a in salted] == [0, 0]  # a salted request shares no KV
    assert salted[0]["prompt_token_ids"] == [256, 1, 2, 3, 4, 5]


def test_min_new_tokens_holds_back_eos(client) -> None:
    to_eos = {"temperature": 0, "max_new_tokens": 8, "logit_bias": {str(EOS): 100.0}}
    assert gen(client, {"text": "x", "sampling_params": to_eos})["output_ids"] == [EOS]
    held = gen(client, {"text": "x", "sampling_params": dict(to_eos, min_new_tokens=3)})
    assert len(held["output_ids"]) == 4 and EOS not in held["output_ids"][:3] and held["output_ids"][3] == EOS
    assert held["meta_info"]["finish_reason"] == {"type": "stop", "matched": EOS}


def test_penalties_change_a_greedy_continuation(client) -> None:
    base = {"temperature": 0, "ignore_eos": True, "max_new_tokens": 24}
    plain = gen(client, {"text": "repeat", "sampling_params": base})["output_ids"]
    assert len(set(plain)) < len(plain), "the greedy continuation should repeat itself for this check to mean much"
    repetition = gen(client, {"text": "repeat", "sampling_params": dict(base, repetition_penalty=2.0)})["output_ids"]
    assert repetition != plain and len(set(repetition)) > len(set(plain))
    # a strong bias keeps "A" the choice; the runner-up's logprob then moves by what the penalties take off "A":
    # frequency_penalty x the count of "A" so far, presence_penalty once "A" was seen
    biased = dict(base, max_new_tokens=6, logit_bias={"65": 30.0})

    def runner_up(params: dict) -> list[float]:
        answer = gen(client, {"text": "x", "sampling_params": params, "return_logprob": True, "top_logprobs_num": 2})
        assert answer["output_ids"] == [65] * 6
        return [top[1][0] for top in answer["meta_info"]["output_top_logprobs"]]

    plain = runner_up(biased)
    frequency = runner_up(dict(biased, frequency_penalty=0.5))
    presence = runner_up(dict(biased, presence_penalty=2.0))
    assert all(abs((f - p) - 0.5 * i) < 1e-3 for i, (f, p) in enumerate(zip(frequency, plain)))
    assert abs(presence[0] - plain[0]) < 1e-3 and all(abs((q - p) - 2.0) < 1e-3
                                                      for q, p in zip(presence[1:], plain[1:]))


def test_an_explicit_null_max_new_tokens_is_no_limit_but_the_context(client) -> None:
    """SGLang tells ``max_new_tokens`` left out (128) from ``null``: ``SamplingParams.__post_init__`` keeps the
    null (``sampling_params.py:149,191-251``), ``verify`` then skips ``min_new_tokens <= max_new_tokens``
    (``:285``) and ``Scheduler.init_req_max_new_tokens`` lets the sequence run to the end of the context
    (``scheduler.py:2693-2713``)."""
    prompt = [256] + [65] * 3949  # 4096-token context: room for 145 more, past /generate's default of 128
    unbounded = gen(client, {"input_ids": prompt, "sampling_params": {"temperature": 0, "ignore_eos": True,
                                                                       "max_new_tokens": None}})
    assert 128 < len(unbounded["output_ids"]) <= 4096 - len(prompt)
    assert unbounded["meta_info"]["finish_reason"]["type"] == "length"
    held = gen(client, {"input_ids": prompt, "sampling_params": {
        "temperature": 0, "max_new_tokens": None, "min_new_tokens": 140, "logit_bias": {str(EOS): 100.0}}})
    assert len(held["output_ids"]) == 141 and held["output_ids"][-1] == EOS
    left_out = gen(client, {"input_ids": prompt, "sampling_params": {"temperature": 0, "ignore_eos": True}})
    assert len(left_out["output_ids"]) == 128  # left out: SGLang's default


def test_min_new_tokens_past_the_context_runs_to_its_end_without_a_limit(client) -> None:
    """With ``max_new_tokens`` null, SGLang bounds ``min_new_tokens`` by nothing (``sampling_params.py:280-293``
    checks only >= 0): EOS stays held back to the end of the context, where the sequence stops on its length.
    With a limit given, ``min_new_tokens`` above it is a 400, as there."""
    prompt = [256] + [65] * 3949  # room for 145 more tokens
    to_eos = {"temperature": 0, "max_new_tokens": None, "min_new_tokens": 1000, "logit_bias": {str(EOS): 100.0}}
    held = gen(client, {"input_ids": prompt, "sampling_params": to_eos})
    room = len(gen(client, {"input_ids": prompt, "sampling_params": {"temperature": 0, "ignore_eos": True,
                                                                      "max_new_tokens": None}})["output_ids"])
    assert len(held["output_ids"]) == room and EOS not in held["output_ids"]
    assert held["meta_info"]["finish_reason"]["type"] == "length"
    refused_body = {"input_ids": prompt, "sampling_params": dict(to_eos, max_new_tokens=100)}
    assert "min_new_tokens" in refused(client, refused_body)["message"]
    for negative in (None, 100):
        body = {"input_ids": prompt, "sampling_params": dict(to_eos, max_new_tokens=negative, min_new_tokens=-1)}
        assert "min_new_tokens" in refused(client, body)["message"]


def test_chat_without_max_tokens_takes_min_tokens_past_the_context(client) -> None:
    """SGLang's chat leaves ``max_new_tokens`` null when ``max_tokens`` is left out (``protocol.py:1214``), so
    ``min_tokens`` is bounded by nothing there either."""
    r = client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "A" * 3900}], "temperature": 0, "min_tokens": 1000,
        "logit_bias": {str(EOS): 100.0}})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "length" and r.json()["usage"]["completion_tokens"] < 1000


def test_an_empty_text_batch_answers_an_empty_list(client) -> None:
    """SGLang answers ``text: []`` with ``[]`` (a stream: only ``[DONE]``); ``input_ids: []`` is its 400
    "input_ids cannot be empty" (``io_struct.py:481-498``, ``tokenizer_manager.py:2074-2187``)."""
    assert gen(client, {"text": [], "sampling_params": GREEDY}) == []
    assert gen(client, {"text": [], "sampling_params": {"n": 2}, "return_logprob": True}) == []
    events, saw_done = read_stream(client, "/generate", {"text": [], "stream": True})
    assert events == [] and saw_done
    assert "empty" in refused(client, {"input_ids": []})["message"]
    assert "exactly one" in refused(client, {"text": [], "input_ids": []})["message"]


@pytest.mark.parametrize("interval", [0, -1])
def test_a_stream_interval_below_one_streams_every_token(client, interval: int) -> None:
    """SGLang takes 0 for its server default (1) and streams a negative one every step
    (``output_streamer.py:455-468``: ``stream_interval or default``, then ``num_unsent >= stream_interval``)."""
    events, saw_done = read_stream(client, "/generate", {"text": "x", "stream": True, "sampling_params": dict(
        GREEDY, stream_interval=interval)})
    assert saw_done and [e["meta_info"]["completion_tokens"] for e in events] == [1, 2, 3, 4]


def test_top_logprobs_are_bounded_by_the_vocabulary_and_1024_on_every_route(client) -> None:
    """SGLang takes any count up to the vocabulary (one past it fails in its scheduler; a negative one is 0).
    verl's top-k distillation asks 128 by default (``DistillationLossConfig.topk``, sent as ``top_logprobs_num``
    with ``logprob_start_len`` 0): before the fix anything past 64 was a 400."""
    answer = gen(client, {"input_ids": [256, 65, 66], "return_logprob": True, "logprob_start_len": 0,
                          "top_logprobs_num": 128, "sampling_params": dict(GREEDY, max_new_tokens=1)})
    meta = answer["meta_info"]
    assert [len(row) for row in meta["input_top_logprobs"][1:] + meta["output_top_logprobs"]] == [128] * 3
    assert all([e[0] for e in row] == sorted((e[0] for e in row), reverse=True) for row in meta["output_top_logprobs"])
    everything = gen(client, {"text": "x", "return_logprob": True, "top_logprobs_num": 320,  # builtin:tiny's vocab
                              "sampling_params": dict(GREEDY, max_new_tokens=1)})
    assert len(everything["meta_info"]["output_top_logprobs"][0]) == 320
    for top in (321, 1025, -1):
        error = refused(client, {"text": "x", "return_logprob": True, "top_logprobs_num": top})
        assert error["type"] == "invalid_request" and "top_logprobs_num" in error["message"]
    for path, body in (("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "logprobs": True,
                                                 "top_logprobs": 1025}),
                       ("/v1/completions", {"prompt": "x", "logprobs": 1025})):
        r = client.post(path, json=body)
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request", r.text
