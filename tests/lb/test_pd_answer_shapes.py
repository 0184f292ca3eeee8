"""A PD pair's answers that do not fit together: the prefill's input logprobs for a prompt the decode node answered
are missing (another count of prompts, one answer for a batch, an empty or non-event stream). Each is one clear
error naming the prefill node, never an answer that looks whole without a prompt's logprobs."""

from __future__ import annotations

import asyncio
import json
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from handoff.protocol.sse import EventSplitter, event_data
from tests.lb.behaviours import Gate, reply, sse
from tests.lb.fakes import FakeCluster
from tests.lb.lbproc import LB, set_members
from tests.support.procs import wait_until

pytestmark = pytest.mark.timeout(30)

PREFILL = {"text": "", "meta_info": {"input_token_logprobs": [[None, 1, None]]}}
DECODE = {"text": "o", "meta_info": {"input_token_logprobs": [], "completion_tokens": 1}}


def _event(payload: Any) -> bytes:
    return b"data: " + json.dumps(payload).encode() + b"\n\n"


def _both_calls_over(lb: LB, *urls: str) -> None:
    wait_until(lambda: all(lb.node(url)["in_flight"] == 0 for url in urls), timeout=5, what="both calls over")


@pytest.mark.parametrize("prefill_answer,decode_answer", [
    ([PREFILL], [DECODE, DECODE]),  # a batch of two: the prefill answered one prompt
    ([PREFILL, PREFILL, PREFILL], [DECODE, DECODE]),
    (PREFILL, [DECODE, DECODE]),  # one answer for a batch
    ([PREFILL, PREFILL], DECODE),
    ({"text": "", "meta_info": {}}, DECODE),  # no input logprobs at all
    ({"text": ""}, DECODE),
], ids=["fewer", "more", "one-for-a-batch", "a-batch-for-one", "no-logprobs", "no-meta-info"])
def test_a_prefill_answer_missing_a_prompts_logprobs_is_an_error(module_fakes: FakeCluster, shared_lb: LB,
                                                                 prefill_answer: Any, decode_answer: Any) -> None:
    """Found by review: the prefill's items were merged into the decode's by position as far as both went, so a
    prefill answer of another count (or one answer for a batch, or none of the input logprobs asked for) left
    prompts of the decode answer without their input logprobs: a 200 that looks whole."""
    prefill, decode = module_fakes.start(2)
    prefill.handlers["/generate"] = reply(200, prefill_answer)
    decode.handlers["/generate"] = reply(200, decode_answer)
    set_members(shared_lb, (prefill.url, "prefill"), (decode.url, "decode"))
    text: Any = ["a", "b"] if isinstance(decode_answer, list) else "a"
    answer = shared_lb.http.post("/generate", json={"text": text, "return_logprob": True})
    assert answer.status_code == 502, answer.text
    error = answer.json()["error"]
    assert error["type"] == "upstream_error" and prefill.url in error["message"], error
    _both_calls_over(shared_lb, prefill.url, decode.url)


@pytest.mark.parametrize("prefill_handler", [
    sse([b"data: [DONE]\n\n"]),  # a stream of no prompt
    sse([]),
    sse([_event({"text": "", "meta_info": {}}), b"data: [DONE]\n\n"]),
    reply(200, PREFILL),  # an answer, not a stream
], ids=["done-only", "empty", "no-logprobs", "json"])
def test_a_prefill_stream_of_no_prompts_logprobs_is_an_error(module_fakes: FakeCluster, shared_lb: LB,
                                                             prefill_handler: Any) -> None:
    """Found by review: a prefill answer with no event carrying input logprobs (only ``[DONE]``, an empty stream,
    a JSON answer) was merged as nothing: the decode stream went out without the prompt's input logprobs."""
    prefill, decode = module_fakes.start(2)
    prefill.handlers["/generate"] = prefill_handler
    decode.handlers["/generate"] = sse([_event(DECODE), b"data: [DONE]\n\n"])
    set_members(shared_lb, (prefill.url, "prefill"), (decode.url, "decode"))
    answer = shared_lb.http.post("/generate", json={"text": "a", "stream": True, "return_logprob": True})
    assert answer.status_code == 502, answer.text
    error = answer.json()["error"]
    assert error["type"] == "upstream_error" and prefill.url in error["message"], error
    _both_calls_over(shared_lb, prefill.url, decode.url)


def test_a_streamed_prompt_the_prefill_sent_nothing_for_ends_the_stream_with_an_error(module_fakes: FakeCluster,
                                                                                     shared_lb: LB) -> None:
    """Found by review: in a streamed batch, the decode events of a prompt the prefill stream had no event for
    went out without that prompt's input logprobs. The stream ends with an ``upstream_error`` event naming the
    prefill node at the first such event (the events before it go out merged), and the decode call is closed."""
    prefill, decode = module_fakes.start(2)
    prefill.handlers["/generate"] = sse([_event({**PREFILL, "index": 0}), b"data: [DONE]\n\n"])

    async def streams(node: Any, exchange: Any) -> None:
        exchange.start_chunked()
        exchange.chunk(_event({**DECODE, "index": 0}) + _event({**DECODE, "index": 1}))
        await exchange.wait_closed()  # a decode node still generating: closed by the LB

    decode.handlers["/generate"] = streams
    set_members(shared_lb, (prefill.url, "prefill"), (decode.url, "decode"))
    answer = shared_lb.http.post("/generate", json={"text": ["a", "b"], "stream": True, "return_logprob": True},
                                 timeout=10)
    assert answer.status_code == 200, answer.text
    events = [json.loads(event_data(e) or b"") for e in EventSplitter().feed(answer.content)]
    assert len(events) == 2, events
    assert events[0]["meta_info"]["input_token_logprobs"] == PREFILL["meta_info"]["input_token_logprobs"]
    error = events[1]["error"]
    assert error["type"] == "upstream_error" and prefill.url in error["message"] and "1" in error["message"], error
    assert decode.disconnected.wait(5), "the decode stream went on after it could no longer be merged"
    _both_calls_over(shared_lb, prefill.url, decode.url)
    assert shared_lb.node(decode.url)["last_error"] is None  # the decode node did not fail


def test_a_decode_stream_of_comments_is_not_gathered_while_the_prefill_answers(module_fakes: FakeCluster,
                                                                              shared_lb: LB) -> None:
    """Found by review: with ``return_logprob`` the decode stream is read up to its first event that carries data
    (a refusal or not) while the prefill answer is; what came before it was kept, without a bound. A decode node
    sending comments (or empty events) and no data held the LB's memory growing at the link's speed until the
    prefill answered, or the request's deadline (3600 s by default). The read stops past
    :data:`lb.pd_refusals.MAX_PEEK_BYTES` (such a stream is no refusal) and the node waits, as for a slow client."""
    prefill, decode = module_fakes.start(2)
    gate, is_open = Gate(module_fakes), threading.Event()
    pushed = [0]

    async def answers_once_let(node: Any, exchange: Any) -> None:
        exchange.start_chunked()  # the stream's head at once, as SGLang's; its answer once the test lets it
        await gate.wait()
        exchange.chunk(_event(PREFILL) + b"data: [DONE]\n\n")
        exchange.end_chunked()

    async def comments(node: Any, exchange: Any) -> None:
        exchange.start_chunked()
        piece = b": " + b"p" * 65530 + b"\n\n"
        while not is_open.is_set() and not exchange.is_closed:
            exchange.chunk(piece)
            pushed[0] += len(piece)
            while exchange.conn.transport.get_write_buffer_size() > (1 << 20) and not exchange.is_closed:
                await asyncio.sleep(0.005)  # the node's own pacing: it waits for its reader
            await asyncio.sleep(0)
        exchange.chunk(_event(DECODE) + b"data: [DONE]\n\n")
        exchange.end_chunked()

    prefill.handlers["/generate"] = answers_once_let
    decode.handlers["/generate"] = comments
    set_members(shared_lb, (prefill.url, "prefill"), (decode.url, "decode"))
    with ThreadPoolExecutor(1) as pool:
        answer = pool.submit(shared_lb.http.post, "/generate",
                             json={"text": "a", "stream": True, "return_logprob": True}, timeout=20)
        with pytest.raises(TimeoutError):  # unbounded, it took 2 s on a loaded machine
            wait_until(lambda: pushed[0] > 64 << 20, timeout=5, what="the decode node pushing 64 MiB")
        assert pushed[0] < 32 << 20, pushed[0]
        is_open.set()
        gate.open()
        response = answer.result(timeout=20)
    assert response.status_code == 200, response.text
    events = [json.loads(data) for e in EventSplitter().feed(response.content)
              if (data := event_data(e)) is not None and data != b"[DONE]"]
    assert events[0]["meta_info"]["input_token_logprobs"] == PREFILL["meta_info"]["input_token_logprobs"], events
    _both_calls_over(shared_lb, prefill.url, decode.url)
