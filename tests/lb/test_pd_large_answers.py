"""A prefill/decode answer with large logprob lists is merged without stopping the LB's other requests, whole or
streamed."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from tests.lb.behaviours import reply, sse
from tests.lb.fakes import FakeCluster
from tests.lb.lbproc import LB, set_members

pytestmark = pytest.mark.timeout(120)


def _answer(prompt_tokens: int, top: int) -> bytes:
    """A node's ``/generate`` answer with input logprobs of ``prompt_tokens`` tokens, ``top`` alternatives each."""
    entries = [[-0.5 - (i % 97) / 100, i, None] for i in range(prompt_tokens)]
    tops = [[[-1.25 - k / 8, i + k, None] for k in range(top)] for i in range(prompt_tokens)]
    return json.dumps({"text": "out", "meta_info": {"input_token_logprobs": entries, "input_top_logprobs": tops,
                                                    "completion_tokens": 1}}).encode()


def _health_waits_during(shared_lb: LB, body: dict[str, object], result: dict[str, object]) -> list[float]:
    """How long each ``/health`` asked of the LB, one after the other, took while it answered ``body`` on another
    thread (its answer, read whole, and the seconds it took in ``result``)."""
    def generate() -> None:
        with httpx.Client(base_url=shared_lb.url, timeout=90) as client:
            started = time.monotonic()
            result["answer"] = client.post("/generate", json=body)
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
    return waits


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
    waits = _health_waits_during(shared_lb, {"text": "hi", "return_logprob": True}, result)
    answer = result["answer"]
    assert isinstance(answer, httpx.Response) and answer.status_code == 200, answer
    meta = answer.json()["meta_info"]
    assert len(meta["input_token_logprobs"]) == len(meta["input_top_logprobs"]) == prefill_tokens + 3
    assert meta["input_token_logprobs"][1] == [-0.51, 1, None] and meta["input_top_logprobs"][-1][0] == [-1.25, 2, None]
    took = result["took"]
    assert isinstance(took, float)
    assert max(waits) < took / 3, (max(waits), took, len(waits))


def test_a_long_prompts_logprobs_streamed_leave_the_lb_answering(module_fakes: FakeCluster, shared_lb: LB) -> None:
    """Found by review: a streamed PD answer with ``return_logprob`` had the prefill's input logprobs parsed on
    the LB's event loop, then merged into each decode event, parsed and written again with it, all on the loop:
    SGLang repeats a prompt's input logprobs in every event of its stream, so a long prompt cost its size times
    the tokens streamed (80 ms an event for 30k tokens with 5 top logprobs), and a read of many events held every
    other request for all of them. Now the prefill answer is parsed on a thread and its logprobs encoded once,
    spliced into each event, sent one by one. The longest ``/health`` wait during the stream must be a small part
    of the stream's time (it was most of it), and every event carries the prompt's logprobs and its own."""
    prefill, decode = module_fakes.start(2)
    prompt_tokens, num_events = 20_000, 100
    prefill_answer = json.loads(_answer(prompt_tokens, 5))
    prefill.handlers["/generate"] = sse([b"data: " + json.dumps(prefill_answer).encode() + b"\n\n",
                                         b"data: [DONE]\n\n"])
    events = [{"text": "x" * n, "meta_info": {"input_token_logprobs": [[-0.25, 7, None]], "input_top_logprobs": [],
                                              "output_token_logprobs": [[-0.1, t, None] for t in range(n)]}}
              for n in range(1, num_events + 1)]
    # all at once: one read of the LB holds many events, as when its client reads slower than the node writes
    decode.handlers["/generate"] = sse([b"".join(b"data: " + json.dumps(event).encode() + b"\n\n" for event in events)
                                        + b"data: [DONE]\n\n"])
    set_members(shared_lb, (prefill.url, "prefill"), (decode.url, "decode"))
    result: dict[str, object] = {}
    waits = _health_waits_during(shared_lb, {"text": "hi", "stream": True, "return_logprob": True}, result)
    answer = result["answer"]
    assert isinstance(answer, httpx.Response) and answer.status_code == 200, answer
    data = [event.removeprefix(b"data: ") for event in answer.content.split(b"\n\n") if event]
    assert len(data) == num_events + 1 and data[-1] == b"[DONE]"
    prompt_meta = prefill_answer["meta_info"]
    for n in (*range(1, num_events, 9), num_events):  # parsing all of them would take the test seconds
        meta = json.loads(data[n - 1])["meta_info"]
        assert len(meta["input_token_logprobs"]) == prompt_tokens + 1 and len(meta["output_token_logprobs"]) == n
        assert meta["input_token_logprobs"][-2:] == [prompt_meta["input_token_logprobs"][-1], [-0.25, 7, None]]
        assert meta["input_top_logprobs"][::9999] == prompt_meta["input_top_logprobs"][::9999]
    took = result["took"]
    assert isinstance(took, float)
    assert max(waits) < took / 3, (max(waits), took, len(waits))
