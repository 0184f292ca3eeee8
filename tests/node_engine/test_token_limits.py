"""How many tokens a request may generate, to the token, as SGLang 0.5.23 answers, on a real engine process whose
context (64 tokens) is smaller than its KV pool (the pool-bound cases: ``test_pool_pressure.py``).

SGLang's arithmetic, page size 1, for a prompt of ``L`` tokens and ``max_new_tokens`` ``M``:

- ``TokenizerManager._validate_one_request`` (tokenizer_manager.py:1333-1378): ``L >= context`` is a 400, and so
  is ``L + M > context`` for an ``M`` given as a number (one left out or ``null`` is not checked);
- ``max_req_len = min(context - 1, pool - 1)``, ``max_req_input_len = max_req_len - 5`` (tp_worker.py:568-572);
- ``Scheduler.init_req_max_new_tokens`` (scheduler.py:2694-2737) cuts ``M`` (``null``: 2**30, left out: 128) to
  ``max_req_len - L - 1``, then ``max_new_tokens_for_memory`` (mem_cache/allocator/base.py:102-105) to
  ``pool - L - 2``: ``min(context, pool) - L - 2`` in all; the sequence ends on ``{"type": "length", "length":
  <the cut M>}``;
- ``validate_input_length`` (managers/utils.py:272-288, called at scheduler.py:3246) aborts ``L >=
  max_req_input_len`` with status 400, which a non-streamed ``/generate`` answers as a 400.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest

from tests.support.procs import ServerProcess

pytestmark = pytest.mark.timeout(120)

CONTEXT = 64
MAX_REQ_LEN = CONTEXT - 1
MAX_INPUT = MAX_REQ_LEN - 5
GREEDY = {"temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def client(proc_log_dir: Path) -> Iterator[httpx.Client]:
    engine = ServerProcess("node_engine", ["--model-path", "builtin:tiny", "--context-length", str(CONTEXT)],
                           log_dir=proc_log_dir, name="short-context").start()
    with httpx.Client(base_url=engine.url, timeout=60) as c:
        yield c
    engine.stop()


def generate(client: httpx.Client, prompt_len: int, **sampling: Any) -> dict[str, Any]:
    answer = client.post("/generate", json={"input_ids": [97] * prompt_len, "sampling_params": {**GREEDY, **sampling}})
    assert answer.status_code == 200, answer.text
    return answer.json()


def refusal(client: httpx.Client, prompt_len: int, **sampling: Any) -> str:
    answer = client.post("/generate", json={"input_ids": [97] * prompt_len, "sampling_params": sampling})
    assert answer.status_code == 400 and answer.json()["error"]["type"] == "invalid_request", answer.text
    return answer.json()["error"]["message"]


@pytest.mark.parametrize(("max_new_tokens", "expected"), [
    (20, 20),                                   # fits: as given
    (CONTEXT - 10 - 2, CONTEXT - 10 - 2),       # the most SGLang's scheduler leaves
    (CONTEXT - 10 - 1, CONTEXT - 10 - 2),       # within the context: cut by one
    (CONTEXT - 10, CONTEXT - 10 - 2),           # exactly the context: cut by two
    (None, CONTEXT - 10 - 2),                   # null: no limit but the context's
    ("left out", CONTEXT - 10 - 2),             # SGLang's default of 128, cut the same way
])
def test_what_a_request_generates_within_the_context(client: httpx.Client, max_new_tokens: Any,
                                                     expected: int) -> None:
    sampling = {} if max_new_tokens == "left out" else {"max_new_tokens": max_new_tokens}
    answer = generate(client, 10, **sampling)
    assert len(answer["output_ids"]) == expected
    assert answer["meta_info"]["finish_reason"] == {"type": "length", "length": expected}


def test_what_a_chat_without_a_limit_generates(client: httpx.Client) -> None:
    answer = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                         **GREEDY}).json()
    assert answer["choices"][0]["finish_reason"] == "length" and answer["choices"][0]["matched_stop"] is None
    assert answer["usage"]["completion_tokens"] == CONTEXT - answer["usage"]["prompt_tokens"] - 2
    completion = client.post("/v1/completions", json={"prompt": [97] * 10, "max_tokens": CONTEXT - 10, **GREEDY})
    assert completion.json()["usage"]["completion_tokens"] == CONTEXT - 10 - 2, completion.text


def test_long_prompts_are_refused_as_sglang_refuses_them(client: httpx.Client) -> None:
    """A prompt of ``max_req_input_len`` tokens or more is a 400 in SGLang's scheduler, whatever
    ``max_new_tokens`` says; the tokenizer's checks (the context, the total) come first."""
    longest = generate(client, MAX_INPUT - 1, max_new_tokens=None)  # the longest prompt SGLang takes
    assert len(longest["output_ids"]) == CONTEXT - (MAX_INPUT - 1) - 2
    for prompt_len in (MAX_INPUT, CONTEXT - 2, CONTEXT - 1):
        for sampling in ({"max_new_tokens": 1}, {"max_new_tokens": None}, {}):
            message = refusal(client, prompt_len, **sampling)
            assert message.startswith(f"Input length ({prompt_len} tokens) exceeds the maximum allowed length "
                                      f"({MAX_INPUT} tokens)."), message
    assert "longer than the model's context length" in refusal(client, CONTEXT, max_new_tokens=0)
    assert refusal(client, CONTEXT - 2, max_new_tokens=3).startswith("Requested token count exceeds")
    assert refusal(client, 10, max_new_tokens=CONTEXT - 9).startswith("Requested token count exceeds")


def test_min_new_tokens_is_bounded_by_the_default_before_the_cut(client: httpx.Client) -> None:
    """``max_new_tokens`` left out: SGLang checks ``min_new_tokens`` against its default of 128
    (``SamplingParams.verify``), then its scheduler cuts both to what fits (scheduler.py:2735-2736)."""
    held = generate(client, 10, min_new_tokens=100)
    assert held["meta_info"]["finish_reason"] == {"type": "length", "length": CONTEXT - 10 - 2}
    assert "min_new_tokens" in refusal(client, 10, min_new_tokens=129)
