"""``/generate`` logprobs over HTTP: SGLang's lists of ``[logprob, token_id, text]``, whole answers and streams."""

from __future__ import annotations

import httpx
import pytest

from tests.support.sse import read_stream

PROMPT = [256, 72, 101, 108, 108, 111]
GREEDY = {"temperature": 0, "ignore_eos": True, "max_new_tokens": 6}


@pytest.fixture(scope="module")
def client(tiny_engine):
    with httpx.Client(base_url=tiny_engine.url, timeout=30) as c:
        yield c


def gen(client: httpx.Client, body: dict) -> dict:
    r = client.post("/generate", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def test_output_logprobs_follow_the_output_ids(client) -> None:
    answer = gen(client, {"input_ids": PROMPT, "sampling_params": GREEDY, "return_logprob": True})
    meta = answer["meta_info"]
    assert [entry[1] for entry in meta["output_token_logprobs"]] == answer["output_ids"]
    assert all(isinstance(lp, float) and lp <= 0 and text is None for lp, _, text in meta["output_token_logprobs"])
    assert meta["input_token_logprobs"] == [] and meta["output_token_logprobs_length"] == 6
    assert "output_top_logprobs" not in meta and "output_token_ids_logprobs" not in meta


def test_prompt_top_and_token_id_logprobs_with_texts(client) -> None:
    answer = gen(client, {"input_ids": PROMPT, "sampling_params": GREEDY, "return_logprob": True,
                          "logprob_start_len": 2, "top_logprobs_num": 3, "token_ids_logprob": [65, 66],
                          "return_text_in_logprobs": True})
    meta = answer["meta_info"]
    assert [e[1] for e in meta["input_token_logprobs"]] == PROMPT[2:]
    assert meta["input_token_logprobs"][0][0] is None and meta["input_token_logprobs"][1][2] == "l"
    assert meta["input_top_logprobs"][0] is None and len(meta["input_top_logprobs"][1]) == 3
    assert [[e[1] for e in row] for row in meta["input_token_ids_logprobs"][1:]] == [[65, 66]] * 3
    assert all(len(row) == 3 for row in meta["output_top_logprobs"])
    greedy_ids = [row[0][1] for row in meta["output_top_logprobs"]]
    assert greedy_ids == answer["output_ids"]  # greedy: the sampled token is the best one
    assert [e[2] for e in meta["output_token_logprobs"]] == [chr(i) if i < 128 else e[2]
                                                            for i, e in zip(answer["output_ids"],
                                                                            meta["output_token_logprobs"])]


def test_a_prompt_only_request_scores_the_prompt(client) -> None:
    """AReaL's score request: max_new_tokens 0 still prefills, and answers the prompt's logprobs."""
    answer = gen(client, {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 0}, "return_logprob": True,
                          "logprob_start_len": 0})
    assert answer["output_ids"] == [] and answer["meta_info"]["finish_reason"] == {"type": "length", "length": 0}
    assert len(answer["meta_info"]["input_token_logprobs"]) == len(PROMPT)
    scored = gen(client, {"input_ids": PROMPT, "sampling_params": GREEDY, "return_logprob": True,
                          "logprob_start_len": 0})
    assert answer["meta_info"]["input_token_logprobs"] == scored["meta_info"]["input_token_logprobs"]


def test_streamed_logprobs_end_as_the_whole_answer(client) -> None:
    body = {"input_ids": PROMPT, "sampling_params": GREEDY, "return_logprob": True, "top_logprobs_num": 2,
            "logprob_start_len": 0}
    whole = gen(client, body)
    events, saw_done = read_stream(client, "/generate", {**body, "stream": True})
    assert saw_done and len(events) > 1
    lengths = [len(e["meta_info"]["output_token_logprobs"]) for e in events]
    assert lengths == sorted(lengths) and lengths[-1] == 6
    assert all(len(e["meta_info"]["output_token_logprobs"]) == len(e["output_ids"]) for e in events)
    last = events[-1]["meta_info"]
    for key in ("output_token_logprobs", "output_top_logprobs", "input_token_logprobs", "input_top_logprobs"):
        assert last[key] == whole["meta_info"][key], key


@pytest.mark.parametrize("start", [-1, 0])
def test_a_prompt_only_request_answers_the_next_token_rows(client, start: int) -> None:
    """SGLang's scoring request (its /v1/score sends it): max_new_tokens 0 with ``token_ids_logprob`` or
    ``top_logprobs_num`` answers one output row, the distribution after the prompt (untempered), and no token."""
    body = {"input_ids": PROMPT, "return_logprob": True, "logprob_start_len": start, "top_logprobs_num": 2,
            "token_ids_logprob": [65, 66]}
    scored = gen(client, {**body, "sampling_params": {"max_new_tokens": 0, "temperature": 0.5}})
    meta = scored["meta_info"]
    assert scored["output_ids"] == [] and meta["output_token_logprobs"] == []
    assert meta["output_token_logprobs_length"] == 0
    assert len(meta["input_token_logprobs"]) == (len(PROMPT) if start == 0 else 0)
    one = gen(client, {**body, "sampling_params": {"max_new_tokens": 1, "temperature": 1.0}})["meta_info"]
    for key in ("output_top_logprobs", "output_token_ids_logprobs"):
        assert len(meta[key]) == 1, key
        assert [e[1] for e in meta[key][0]] == [e[1] for e in one[key][0]], key
        assert [e[0] for e in meta[key][0]] == pytest.approx([e[0] for e in one[key][0]], abs=1e-4), key


def test_a_huge_bias_over_a_small_temperature_answers_finite_logprobs(client) -> None:
    """A valid ``logit_bias`` near float32's largest value over ``temperature`` 0.5 overflowed to ``inf`` in the
    tempered logits the logprobs come from (the sampler already guarded its own copy): log_softmax made NaN, which
    JSON cannot carry, and the answer was a 500. Like the sampler, the largest float stands for the overflow."""
    for bias in ({"65": 3e38}, {"65": 2e38, "66": 2e38}):
        answer = gen(client, {"input_ids": PROMPT, "return_logprob": True, "top_logprobs_num": 2,
                              "token_ids_logprob": [65, 66],
                              "sampling_params": {"max_new_tokens": 2, "temperature": 0.5, "logit_bias": bias,
                                                  "ignore_eos": True}})
        meta = answer["meta_info"]
        assert set(answer["output_ids"]) <= {65, 66}
        expected = 0.0 if len(bias) == 1 else -0.6931
        assert [e[0] for e in meta["output_token_logprobs"]] == pytest.approx([expected] * 2, abs=1e-3)
        assert all(e[0] <= 0 for row in meta["output_top_logprobs"] for e in row)
