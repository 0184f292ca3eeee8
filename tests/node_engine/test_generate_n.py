"""``n`` samples per prompt: SGLang's order, one prefill of the shared prompt, seeds per sample."""

from __future__ import annotations

import httpx
import pytest

from tests.support.sse import read_stream

PROMPT = [256] + list(range(100, 160))


@pytest.fixture(scope="module")
def client(tiny_engine):
    with httpx.Client(base_url=tiny_engine.url, timeout=60) as c:
        yield c


def gen(client: httpx.Client, body: dict) -> list | dict:
    r = client.post("/generate", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def test_n_greedy_samples_are_identical_and_share_the_prefill(client) -> None:
    flush = client.post("/flush_cache")
    assert flush.status_code == 200
    answers = gen(client, {"input_ids": PROMPT, "rid": "g", "sampling_params": {
        "n": 8, "temperature": 0, "max_new_tokens": 12, "ignore_eos": True}})
    assert isinstance(answers, list) and len(answers) == 8
    assert len({tuple(a["output_ids"]) for a in answers}) == 1
    assert [a["meta_info"]["id"] for a in answers] == [f"g_{j}" for j in range(8)]
    # the prompt was prefilled once, by itself: every sample found all of it but its last token in the cache
    assert [a["meta_info"]["cached_tokens"] for a in answers] == [len(PROMPT) - 1] * 8


def test_n_sampled_with_a_seed_is_reproducible_and_sample_j_draws_with_seed_plus_j(client) -> None:
    body = {"input_ids": PROMPT, "sampling_params": {"n": 8, "temperature": 1.0, "max_new_tokens": 16,
                                                     "ignore_eos": True, "sampling_seed": 100}}
    first, again = gen(client, body), gen(client, body)
    assert [a["output_ids"] for a in first] == [a["output_ids"] for a in again]
    assert len({tuple(a["output_ids"]) for a in first}) > 1
    third = gen(client, {"input_ids": PROMPT, "sampling_params": {"temperature": 1.0, "max_new_tokens": 16,
                                                                  "ignore_eos": True, "sampling_seed": 102}})
    assert third["output_ids"] == first[2]["output_ids"]


def test_batch_and_n_follow_sglang_order(client) -> None:
    answers = gen(client, {"text": ["first prompt", "second prompt"], "sampling_params": {
        "n": 2, "temperature": 0, "max_new_tokens": 8, "ignore_eos": True}})
    ids = [a["output_ids"] for a in answers]
    assert len(ids) == 4 and ids[0] == ids[1] and ids[2] == ids[3] and ids[0] != ids[2]  # prompt by prompt
    alone = gen(client, {"text": "second prompt", "sampling_params": {"temperature": 0, "max_new_tokens": 8,
                                                                      "ignore_eos": True}})
    assert alone["output_ids"] == ids[2]


def test_n_streams_carry_indices_and_logprob_lists_must_not_be_per_prompt(client) -> None:
    events, saw_done = read_stream(client, "/generate", {"input_ids": PROMPT, "stream": True, "sampling_params": {
        "n": 3, "temperature": 0.8, "max_new_tokens": 5, "ignore_eos": True}, "return_logprob": True})
    assert saw_done and {e["index"] for e in events} == {0, 1, 2}
    for index in range(3):
        last = [e for e in events if e["index"] == index][-1]
        assert len(last["output_ids"]) == 5 == len(last["meta_info"]["output_token_logprobs"])
    r = client.post("/generate", json={"text": ["a", "b"], "return_logprob": [True, False],
                                       "sampling_params": {"n": 2}})
    assert r.status_code == 400 and "n > 1" in r.json()["error"]["message"]


def test_extra_key_and_cache_salt_lists_go_with_n_per_prompt(client) -> None:
    """SGLang 0.5.23 ``io_struct.py:850-886``: a per-prompt ``extra_key`` / ``cache_salt`` list is repeated for the
    ``n`` samples (a list per prompt is refused with ``n`` > 1 only for the logprob fields, ``:776-821``)."""
    other = [256] + list(range(200, 240))
    for name in ("extra_key", "cache_salt"):
        assert client.post("/flush_cache").status_code == 200
        answers = gen(client, {"input_ids": [PROMPT, other], name: ["", "tenant"], "rid": [f"{name}-a", f"{name}-b"],
                               "sampling_params": {"n": 2, "temperature": 0, "max_new_tokens": 3,
                                                   "ignore_eos": True}})
        assert [a["meta_info"]["id"] for a in answers] == [f"{name}-a_0", f"{name}-a_1", f"{name}-b_0", f"{name}-b_1"]
        # "" is no key (SGLang makes it None): that prompt's samples share its prefill; the salted ones share nothing
        assert [a["meta_info"]["cached_tokens"] for a in answers] == [len(PROMPT) - 1] * 2 + [0, 0]
        single = gen(client, {"input_ids": PROMPT, name: ["tenant"], "sampling_params": {"n": 2, "max_new_tokens": 2}})
        assert len(single) == 2
        r = client.post("/generate", json={"text": ["a", "b"], name: ["x"], "sampling_params": {"n": 2}})
        assert r.status_code == 400 and name in r.json()["error"]["message"]
