"""Resource exhaustion of a real engine process: what one request may cost it is bounded by what it can use."""

from __future__ import annotations

import httpx
import pytest

pytestmark = pytest.mark.timeout(120)


def test_a_chat_of_more_messages_than_can_fit_is_refused_before_they_are_validated(tiny_engine) -> None:
    """400 000 one-letter messages (11 MiB) are refused from their count: before the fix each was validated,
    dumped and copied on the event loop first (16 us each: a 57 MiB body held the loop 24 s, long enough for the
    sidecar to count the engine down); now the body's JSON is all it costs (a third of the time)."""
    num = 400_000
    body = (b'{"model": "m", "max_tokens": 4, "messages": ['
            + b",".join([b'{"role":"user","content":"a"}'] * num) + b"]}")
    answer = httpx.post(tiny_engine.url + "/v1/chat/completions", content=body,
                        headers={"content-type": "application/json"}, timeout=60)
    assert answer.status_code == 400
    error = answer.json()["error"]
    assert error["type"] == "invalid_request" and f"{num} messages can never fit" in error["message"]
    # the refusal names the count: it came before the messages were validated (the check after validation
    # names the characters the template would render)
    ok = httpx.post(tiny_engine.url + "/v1/chat/completions", timeout=60,
                    json={"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}] * 50})
    assert ok.status_code == 200  # as many messages as fit are still taken


def test_logit_bias_keys_spelling_one_token_are_one_entry(tiny_engine) -> None:
    """"5" and "05" name one token: the last one given counts, as SGLang assigns each key in turn. Before the fix
    every spelling was an entry of its own, applied (summed) at every decode step: 300 tokens spelled 200 ways each
    (a 6.7 MB body, n = 16) made every step of the engine 100 times slower, other clients' requests included (a
    4-token request took 3.2 s instead of 0.03 s; with n = 64 one timed out after 120 s)."""
    greedy = {"temperature": 0, "max_new_tokens": 4, "ignore_eos": True}

    def output_ids(logit_bias: dict[str, float]) -> list[int]:
        answer = httpx.post(tiny_engine.url + "/generate", timeout=60,
                            json={"text": "x", "sampling_params": dict(greedy, logit_bias=logit_bias)})
        assert answer.status_code == 200, answer.text
        return answer.json()["output_ids"]

    assert output_ids({"5": -100.0, "05": 100.0}) == [5] * 4  # summed, the two biases cancelled out
    assert 5 not in output_ids({"05": 100.0, "5": -100.0})
    spellings = {"0" * k + "7": 0.0 for k in range(1, 2000)} | {"7": 100.0}  # 2000 keys, one entry
    assert output_ids(spellings) == [7] * 4
