"""A prefill/decode answer with large logprob lists is merged without stopping the LB's other requests."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from tests.lb.behaviours import reply
from tests.lb.fakes import FakeCluster
from tests.lb.lbproc import LB, set_members

pytestmark = pytest.mark.timeout(120)


def _answer(prompt_tokens: int, top: int) -> bytes:
    """A node's ``/generate`` answer with input logprobs of ``prompt_tokens`` tokens, ``top`` alternatives each."""
    entries = [[-0.5 - (i % 97) / 100, i, None] for i in range(prompt_tokens)]
    tops = [[[-1.25 - k / 8, i + k, None] for k in range(top)] for i in range(prompt_tokens)]
    return json.dumps({"text": "out", "meta_info": {"input_token_logprobs": entries, "input_top_logprobs": tops,
                                                    "completion_tokens": 1}}).encode()


def test_a_large_merge_leaves_the_lb_answering(module_fakes: FakeCluster, shared_lb: LB) -> None:
    """Found by review: the LB parsed both answers, merged them and wrote the result on its event loop: tens of
    megabytes of logprobs (a long prompt with top logprobs) held every other request it serves, health checks
    and ``/health`` included, for the seconds that took. The longest ``/health`` wait during the merge must be
    a small part of the merge's time (it was all of it)."""
    prefill, decode = module_fakes.start(2)
    prefill_tokens = 120_000
    prefill.handlers["/generate"] = reply(200, _answer(prefill_tokens, 5))
    decode.handlers["/generate"] = reply(200, _answer(3, 5))
    set_members(shared_lb, (prefill.url, "prefill"), (decode.url, "decode"))
    result: dict[str, object] = {}

    def generate() -> None:
        with httpx.Client(base_url=shared_lb.url, timeout=90) as client:
            started = time.monotonic()
            result["answer"] = client.post("/generate", json={"text": "hi", "return_logprob": True})
            result["took"] = time.monotonic() - started

    worker = threading.Thread(target=generate)
    worker.start()
    waits = []
    with httpx.Client(base_url=shared_lb.url, timeout=90) as client:
        while worker.is_alive():
            started = time.monotonic()
            assert client.get("/health").status_code == 200
            waits.append(time.monotonic() - started)
    worker.join()
    answer = result["answer"]
    assert isinstance(answer, httpx.Response) and answer.status_code == 200, answer
    meta = answer.json()["meta_info"]
    assert len(meta["input_token_logprobs"]) == len(meta["input_top_logprobs"]) == prefill_tokens + 3
    assert meta["input_token_logprobs"][1] == [-0.51, 1, None] and meta["input_top_logprobs"][-1][0] == [-1.25, 2, None]
    took = result["took"]
    assert isinstance(took, float)
    assert max(waits) < took / 3, (max(waits), took, len(waits))
