"""A real engine whose KV pool is smaller than its context and than what its requests need together: requests
that fit the context but not the pool, concurrent greedy requests and ``n`` samples that must be preempted and
recomputed (the same tokens as alone), and no slot left held afterwards.

Admission reserves what requests will need as SGLang does (``node_engine/token_budget.py``): requests under
``ignore_eos`` are reserved all their tokens and never preempted; the others are reserved ``new_token_ratio`` of
their tokens left, 0 under ``--schedule-conservativeness 0`` (this engine's), so those the pool cannot hold together
are admitted and preempted."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.node_engine.test_server import slots_held_by_requests
from tests.support.procs import ServerProcess

pytestmark = pytest.mark.timeout(180)

POOL = 200  # tokens; the built-in model's context is 4096
CONTEXT = 4096


@pytest.fixture(scope="module")
def client(proc_log_dir: Path):
    engine = ServerProcess("node_engine", ["--model-path", "builtin:tiny", "--max-total-tokens", str(POOL),
                                           "--max-running-requests", "16", "--max-batch-tokens", "64",
                                           "--schedule-conservativeness", "0"],
                           log_dir=proc_log_dir, name="small-pool").start()
    with httpx.Client(base_url=engine.url, timeout=120) as c:
        yield c
    engine.stop()


def generate(client: httpx.Client, body: dict[str, Any]) -> Any:
    answer = client.post("/generate", json=body)
    assert answer.status_code == 200, answer.text
    return answer.json()


def test_a_request_within_the_context_but_beyond_the_pool_ends_on_its_length(client: httpx.Client) -> None:
    """SGLang refuses prompt + ``max_new_tokens`` beyond the context (``TokenizerManager._validate_one_request``),
    but cuts ``max_new_tokens`` to what the KV pool holds (``Scheduler.init_req_max_new_tokens``: ``max_req_len -
    prompt - 1``, ``max_req_len`` the pool less one; ``max_new_tokens_for_memory``: pool - prompt - 2): the
    request runs and ends on its length. Before the fix such a request (an RL rollout's ``max_new_tokens`` =
    context - prompt on an engine whose pool is smaller) was a 400; then it ran to the pool, two more tokens."""
    greedy = {"temperature": 0, "ignore_eos": True}
    prompt = [97] * 100
    room = POOL - len(prompt) - 2
    answer = generate(client, {"input_ids": prompt, "sampling_params": dict(greedy, max_new_tokens=CONTEXT - 101)})
    assert len(answer["output_ids"]) == room
    assert answer["meta_info"]["finish_reason"] == {"type": "length", "length": room}
    for max_new in (room + 1, None):  # one past what the pool leaves; no limit
        cut = generate(client, {"input_ids": prompt, "sampling_params": dict(greedy, max_new_tokens=max_new)})
        assert cut["meta_info"]["finish_reason"] == {"type": "length", "length": room}
    alone = generate(client, {"input_ids": prompt, "sampling_params": dict(greedy, max_new_tokens=room)})
    assert answer["output_ids"] == alone["output_ids"]
    samples = generate(client, {"input_ids": prompt, "sampling_params": dict(greedy, max_new_tokens=1000, n=3,
                                                                             min_new_tokens=500)})
    assert [s["output_ids"] for s in samples] == [alone["output_ids"]] * 3
    completion = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1000, "temperature": 0})
    assert completion.status_code == 200, completion.text
    assert completion.json()["choices"][0]["finish_reason"] == "length"
    assert completion.json()["usage"]["completion_tokens"] == room
    # max_req_input_len (the pool less six) is SGLang's longest prompt, less one
    longest = generate(client, {"input_ids": [97] * (POOL - 7), "sampling_params": dict(greedy, max_new_tokens=9)})
    assert longest["meta_info"]["finish_reason"] == {"type": "length", "length": 5}
    # still refused: beyond the context (SGLang's rule), a prompt the pool cannot hold
    for ids, max_new in ((prompt, CONTEXT - 99), ([97] * (POOL + 1), 0), ([97] * POOL, 1), ([97] * (POOL - 6), 1)):
        refused = client.post("/generate", json={"input_ids": ids, "sampling_params": {"max_new_tokens": max_new}})
        assert refused.status_code == 400 and refused.json()["error"]["type"] == "invalid_request", refused.text
    assert slots_held_by_requests(client) == 0


def test_requests_that_overflow_the_pool_together_answer_as_alone(client: httpx.Client) -> None:
    """24 greedy requests of ~100 tokens each and ``n`` = 6 samples of a 140-token sequence share a 200-token pool:
    they are preempted and recomputed, and each answers the tokens it answers alone; no slot stays held."""
    greedy = {"temperature": 0, "max_new_tokens": 60}
    prompts = [f"{i:02d}" + "abcdefgh"[i % 8] * (20 + 2 * i) for i in range(24)]
    alone = [generate(client, {"text": p, "sampling_params": greedy})["output_ids"] for p in prompts]
    shared = "a prompt of about forty tokens, shared..."
    shared_alone = generate(client, {"text": shared, "sampling_params": dict(greedy, max_new_tokens=100)})

    def together(body: dict[str, Any]) -> Any:
        return generate(client, body)

    bodies = [{"text": p, "sampling_params": greedy} for p in prompts]
    bodies.append({"text": shared, "sampling_params": dict(greedy, max_new_tokens=100, n=6)})
    with ThreadPoolExecutor(len(bodies)) as pool:
        answers = list(pool.map(together, bodies))
    assert [a["output_ids"] for a in answers[:-1]] == alone
    assert [s["output_ids"] for s in answers[-1]] == [shared_alone["output_ids"]] * 6
    num_retractions = sum(a["meta_info"]["num_retractions"] for a in answers[:-1])
    num_retractions += sum(s["meta_info"]["num_retractions"] for s in answers[-1])
    assert num_retractions > 0  # the pool did run out
    assert slots_held_by_requests(client) == 0


def test_preempted_requests_answer_the_logprobs_they_answer_alone(client: httpx.Client) -> None:
    """Requests asking for prompt and output logprobs (top and token ids too) share the small pool: each preemption
    recomputes a prompt whose logprobs were taken already and tokens that were sampled already; each answer still
    has one entry per prompt token from ``logprob_start_len`` and one per output token, the values of its run
    alone (within float noise: batches differ)."""
    greedy = {"temperature": 0, "max_new_tokens": 70}  # two need more than the pool: one is preempted
    bodies = [{"text": f"{i:02d}" + "xyzw"[i % 4] * (40 + 3 * i), "sampling_params": greedy, "return_logprob": True,
               "logprob_start_len": i % 3, "top_logprobs_num": 2, "token_ids_logprob": [65, 97]} for i in range(12)]
    alone = [generate(client, body) for body in bodies]
    with ThreadPoolExecutor(len(bodies)) as pool:
        answers = list(pool.map(lambda body: generate(client, body), bodies))
    assert sum(a["meta_info"]["num_retractions"] for a in answers) > 0  # the pool did run out
    keys = ("input_token_logprobs", "output_token_logprobs", "input_top_logprobs", "output_top_logprobs",
            "input_token_ids_logprobs", "output_token_ids_logprobs")
    for got, want in zip(answers, alone, strict=True):
        assert got["output_ids"] == want["output_ids"]
        assert len(got["meta_info"]["output_token_logprobs"]) == len(got["output_ids"]) == 70
        for key in keys:
            flat_got, flat_want = _flatten(got["meta_info"][key]), _flatten(want["meta_info"][key])
            assert [e[1] for e in flat_got] == [e[1] for e in flat_want], key
            assert [e[0] for e in flat_got] == pytest.approx([e[0] for e in flat_want], abs=1e-4), key
    assert slots_held_by_requests(client) == 0


def test_requests_reserved_their_whole_length_are_never_retracted(client: httpx.Client) -> None:
    """16 greedy ``ignore_eos`` requests (prompts of 20 to 80 tokens, 60 new tokens each) sent together to the
    200-token pool: admission reserves each its whole prompt and its 60 tokens (SGLang's ratio 1 under
    ``ignore_eos``), so they wait their turn instead of being admitted, retracted and recomputed; the same tokens as
    alone. Before the fix admission checked only the first chunk and one decode step: retracted many times."""
    greedy = {"temperature": 0, "ignore_eos": True, "max_new_tokens": 60}
    prompts = [f"{i:02d}" + "pqrstuvw"[i % 8] * (18 + 4 * i) for i in range(16)]
    alone = [generate(client, {"text": p, "sampling_params": greedy})["output_ids"] for p in prompts]
    with ThreadPoolExecutor(len(prompts)) as pool:
        answers = list(pool.map(lambda p: generate(client, {"text": p, "sampling_params": greedy}), prompts))
    assert [a["output_ids"] for a in answers] == alone
    assert [a["meta_info"]["num_retractions"] for a in answers] == [0] * len(prompts)
    assert slots_held_by_requests(client) == 0


def _flatten(rows: list) -> list:
    """``[logprob, id, text]`` entries of a list of entries or of rows of them (``None`` rows as ``[None, None]``)."""
    out: list = []
    for row in rows:
        if row is None:
            out.append([None, None])
        elif row and isinstance(row[0], list):
            out.extend(row)
        else:
            out.append(row)
    return out
