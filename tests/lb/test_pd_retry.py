"""Retrying a PD pair after a node already got the request (its call given up while it ran): the retry must not
meet that node's request under the client's ``rid`` still in flight."""

from __future__ import annotations

import asyncio
import json
import itertools
import threading
import time
from pathlib import Path
from typing import Callable, Iterator

import httpx
import pytest

from lb.pd_retry import ABORT_WAIT_S
from tests.lb.behaviours import hang
from tests.lb.fakes import Exchange, FakeCluster, FakeNode, Handler
from tests.lb.lbproc import LB, node_args
from tests.support.procs import ServerProcess, wait_until

pytestmark = pytest.mark.timeout(120)

DECODE_ANSWER = {"text": "out", "meta_info": {"completion_tokens": 2}}
PREFILL_ANSWER = {"text": "", "meta_info": {}}
NOT_SERVING = {"error": {"type": "node_released", "message": "released"}}
LONG = {"max_new_tokens": 1500, "temperature": 0, "ignore_eos": True}  # runs on after the decode refused


@pytest.fixture(scope="module")
def prefill_sidecar(proc_log_dir: Path) -> Iterator[ServerProcess]:
    engine = ServerProcess("node_engine", ["--model-path", "builtin:tiny"], log_dir=proc_log_dir,
                           name="pd_retry_engine").start()
    try:
        sidecar = ServerProcess("node_sidecar", ["--engine-url", engine.url, "--role", "prefill"],
                                log_dir=proc_log_dir, name="pd_retry_sidecar").start()
        try:
            wait_until(lambda: httpx.get(sidecar.url + "/ready").status_code == 200, timeout=30,
                       what="sidecar ready")
            yield sidecar
        finally:
            sidecar.stop()
    finally:
        engine.stop()


def refuse_first(answer: dict, *, after: asyncio.Event, rid: str = "client-rid") -> Handler:
    """A handler shared by the fake nodes of one role: the first request under ``rid`` (whichever node gets it)
    is refused with a not-serving 503 once ``after`` is set (the other side got it), later ones answered."""
    calls = itertools.count()

    async def handler(node: FakeNode, exchange: Exchange) -> None:
        if exchange.request.json().get("rid") == rid and next(calls) == 0:
            await after.wait()
            exchange.respond(503, NOT_SERVING)
        else:
            exchange.respond(200, answer)
    return handler


class SlowAbort:
    """Nodes' request ids as SGLang keeps them (``TokenizerManager``), faked: an id is in flight from its
    request until the node is done with it, and a second request under it is 400 "Duplicate request ID
    detected". A request answers after ``run_s``; one whose connection closes first lets its id go only
    ``abort_s`` later (its abort lands late). ``hang_rid``'s request runs until its connection closes."""

    def __init__(self, answer: dict, *, run_s: float = 0.5, abort_s: float = 1.0, hang_rid: str = "") -> None:
        self.answer = answer
        self.run_s = run_s
        self.abort_s = abort_s
        self.hang_rid = hang_rid
        self.live: set[tuple[str, str]] = set()  # (node url, id): each node keeps its own
        self.got: dict[str, list[str]] = {}  # node url -> the ids of the requests it took
        self.received = asyncio.Event()
        self.duplicates = 0

    async def handler(self, node: FakeNode, exchange: Exchange) -> None:
        rid = exchange.request.json()["rid"]
        key = (node.url, rid)
        if key in self.live:
            self.duplicates += 1
            exchange.respond(400, {"error": {"message": f"Duplicate request ID detected: {rid}"}})
            return
        self.live.add(key)
        self.got.setdefault(node.url, []).append(rid)
        self.received.set()
        closed = asyncio.ensure_future(exchange.wait_closed())
        done, _ = await asyncio.wait({closed}, timeout=None if rid == self.hang_rid else self.run_s)
        if closed in done:
            asyncio.get_running_loop().call_later(self.abort_s, self.live.discard, key)
            return
        closed.cancel()
        self.live.discard(key)
        exchange.respond(200, self.answer)


def pd_lb(start_lb: Callable[..., LB], prefills: list[FakeNode], decodes: list[FakeNode]) -> LB:
    lb = start_lb(*node_args(*(p.url for p in prefills), flag="--prefill"),
                  *node_args(*(d.url for d in decodes), flag="--decode"), "--health-interval", "60",
                  "--generate-timeout", "30", fast_health=False)
    lb.wait_routable([n.url for n in (*prefills, *decodes)])
    return lb


def in_background(lb: LB, rid: str) -> threading.Thread:
    """A request sent from a thread of its own (it may run until the LB closes)."""
    def send() -> None:
        try:
            lb.http.post("/generate", json={"text": "hi", "rid": rid}, timeout=20)
        except httpx.HTTPError:
            pass  # the LB closed at the end of the test
    thread = threading.Thread(target=send, daemon=True)
    thread.start()
    return thread


def test_a_decode_refusal_while_the_only_prefill_node_runs_the_request_waits_for_its_abort(
        fakes: FakeCluster, start_lb: Callable[..., LB]) -> None:
    """Found by review: a decode node refusing (503 not serving) gave the prefill call up while the prefill node
    ran it, and the new pair went at once to that node with the same body: the client's ``rid`` was still in
    flight there (its abort not landed), so the node refused the retry as a duplicate (SGLang's "Duplicate
    request ID detected", tokenizer_manager.py) and the client got that 400 instead of the rerouted answer.
    The LB now tries the pair again, after a pause, until the abort landed (at most ABORT_WAIT_S)."""
    [prefill], decodes = fakes.start(1), fakes.start(2)
    node = SlowAbort(PREFILL_ANSWER, run_s=0.5, abort_s=1.0)
    prefill.handlers["/generate"] = node.handler
    handler = refuse_first(DECODE_ANSWER, after=node.received)
    for decode in decodes:
        decode.handlers["/generate"] = handler
    lb = pd_lb(start_lb, [prefill], decodes)
    started = time.monotonic()
    answer = lb.http.post("/generate", json={"text": "hi", "rid": "client-rid"}, timeout=20)
    assert answer.status_code == 200 and answer.json() == DECODE_ANSWER, answer.text
    assert time.monotonic() - started < 5
    sent = [r.json()["rid"] for n in (prefill, *decodes) for r in n.requests_to("/generate")]
    assert set(sent) == {"client-rid"}  # the client's id is never changed
    assert node.got[prefill.url] == ["client-rid", "client-rid"]  # ran twice: the first aborted, then the retry


def test_a_retry_prefers_a_prefill_node_that_never_got_the_request(fakes: FakeCluster,
                                                                    start_lb: Callable[..., LB]) -> None:
    """The least busy prefill node got the request, then its decode node refused: the retry goes to the other
    prefill node (the LB picked the same one again, still the least busy, which refused the client's ``rid`` as
    in flight while its abort had not landed)."""
    prefills, decodes = fakes.start(2), fakes.start(2)
    node = SlowAbort(PREFILL_ANSWER, run_s=0.5, abort_s=30.0, hang_rid="busy")
    for prefill in prefills:
        prefill.handlers["/generate"] = node.handler
    handler = refuse_first(DECODE_ANSWER, after=node.received)
    for decode in decodes:
        decode.handlers["/generate"] = handler
    lb = pd_lb(start_lb, prefills, decodes)
    in_background(lb, "busy")  # holds one prefill node until the LB closes
    wait_until(lambda: sum(lb.node(p.url)["in_flight"] for p in prefills) == 1, timeout=5, what="one busy")
    fakes.call(_clear(node.received))
    answer = lb.http.post("/generate", json={"text": "hi", "rid": "client-rid"}, timeout=20)
    assert answer.status_code == 200 and answer.json() == DECODE_ANSWER, answer.text
    assert node.duplicates == 0
    assert sorted(node.got[p.url].count("client-rid") for p in prefills) == [1, 1]  # each prefill node once


async def _clear(event: asyncio.Event) -> None:
    event.clear()


def test_a_prefill_refusal_after_the_decode_node_got_the_request_waits_for_its_abort(
        fakes: FakeCluster, start_lb: Callable[..., LB]) -> None:
    """The same on the other side: a prefill node refused (503 not serving) after the only decode node got the
    request; the new pair's decode call met the client's ``rid`` still in flight there."""
    prefills, [decode] = fakes.start(2), fakes.start(1)
    node = SlowAbort(DECODE_ANSWER, run_s=0.2, abort_s=1.0)
    decode.handlers["/generate"] = node.handler
    handler = refuse_first(PREFILL_ANSWER, after=node.received)
    for prefill in prefills:
        prefill.handlers["/generate"] = handler
    lb = pd_lb(start_lb, prefills, [decode])
    answer = lb.http.post("/generate", json={"text": "hi", "rid": "client-rid"}, timeout=20)
    assert answer.status_code == 200 and answer.json() == DECODE_ANSWER, answer.text
    assert node.got[decode.url] == ["client-rid", "client-rid"]


def test_a_duplicate_the_lb_did_not_cause_is_the_clients_at_once(fakes: FakeCluster,
                                                                 start_lb: Callable[..., LB]) -> None:
    """A client's second request under an id its first still runs is the node's 400 at once: no retry."""
    [prefill], [decode] = fakes.start(1), fakes.start(1)
    node = SlowAbort(PREFILL_ANSWER, hang_rid="client-rid")
    prefill.handlers["/generate"] = node.handler
    decode.handlers["/generate"] = hang()
    lb = pd_lb(start_lb, [prefill], [decode])
    in_background(lb, "client-rid")
    wait_until(lambda: lb.node(prefill.url)["in_flight"] == 1, timeout=5, what="the first request running")
    started = time.monotonic()
    answer = lb.http.post("/generate", json={"text": "hi", "rid": "client-rid"}, timeout=20)
    assert answer.status_code == 400 and "Duplicate request ID" in answer.text, answer.text
    assert node.duplicates == 1  # not sent again: a retry would have been refused as a duplicate too
    assert time.monotonic() - started < ABORT_WAIT_S  # nor waited for an abort


def test_a_decode_refusal_while_a_real_prefill_node_runs_the_request_is_rerouted(
        prefill_sidecar: ServerProcess, fakes: FakeCluster, start_lb: Callable[..., LB]) -> None:
    """The first test against handoff's own prefill node (sidecar and builtin:tiny engine), whose engine refuses
    an id in flight as SGLang does: whether its abort lands before the retry is a race (it mostly did not
    before the fix); the answer is 200 either way."""
    decodes = fakes.start(2)
    calls = itertools.count()

    async def refuse_later(node: FakeNode, exchange: Exchange) -> None:
        if next(calls) == 0:
            await asyncio.sleep(0.4)  # the node's own latency: the prefill node's run is under way
            exchange.respond(503, NOT_SERVING)
        else:
            exchange.respond(200, DECODE_ANSWER)
    for decode in decodes:
        decode.handlers["/generate"] = refuse_later
    lb = start_lb("--prefill", prefill_sidecar.url, *node_args(*(d.url for d in decodes), flag="--decode"),
                  "--health-interval", "60", fast_health=False)
    lb.wait_routable([prefill_sidecar.url, *(d.url for d in decodes)], timeout=30)
    answer = lb.http.post("/generate", json={"text": "hello", "rid": "client-rid", "sampling_params": LONG},
                          timeout=60)
    assert answer.status_code == 200 and answer.json() == DECODE_ANSWER, answer.text


class StreamSlowAbort(SlowAbort):
    """:class:`SlowAbort` for streamed requests, as SGLang answers them (``http_server.py`` ``stream_results``):
    a duplicate id is a 200 whose first event is the error, then ``[DONE]``; a request streams its answer."""

    async def handler(self, node: FakeNode, exchange: Exchange) -> None:
        rid = exchange.request.json()["rid"]
        key = (node.url, rid)
        exchange.start_chunked()
        if key in self.live:
            self.duplicates += 1
            error = {"error": {"message": f"Duplicate request ID detected: {rid}", "type": "invalid_request_error",
                               "code": 400, "retryable": False}}
            exchange.chunk(b"data: " + json.dumps(error).encode() + b"\n\n")
            exchange.chunk(b"data: [DONE]\n\n")
            exchange.end_chunked()
            return
        self.live.add(key)
        self.got.setdefault(node.url, []).append(rid)
        self.received.set()
        closed = asyncio.ensure_future(exchange.wait_closed())
        done, _ = await asyncio.wait({closed}, timeout=self.run_s)
        if closed in done:
            asyncio.get_running_loop().call_later(self.abort_s, self.live.discard, key)
            return
        closed.cancel()
        self.live.discard(key)
        exchange.chunk(b"data: " + json.dumps(self.answer).encode() + b"\n\n")
        exchange.chunk(b"data: [DONE]\n\n")
        exchange.end_chunked()


def refuse_first_stream(answer: dict, *, after: asyncio.Event, rid: str = "client-rid") -> Handler:
    """:func:`refuse_first` for streamed requests: the later ones get ``answer`` as one event, then ``[DONE]``, a
    moment after their headers (a decode node waits for the KV cache)."""
    calls = itertools.count()

    async def handler(node: FakeNode, exchange: Exchange) -> None:
        if exchange.request.json().get("rid") == rid and next(calls) == 0:
            await after.wait()
            exchange.respond(503, NOT_SERVING)
            return
        exchange.start_chunked()
        await asyncio.sleep(0.3)  # the node's own latency, not synchronisation
        exchange.chunk(b"data: " + json.dumps(answer).encode() + b"\n\n")
        exchange.chunk(b"data: [DONE]\n\n")
        exchange.end_chunked()
    return handler


@pytest.mark.parametrize("logprobs", [False, True])
@pytest.mark.parametrize("refusing", ["decode", "prefill"])
def test_a_streamed_retry_waits_for_the_abort_too(fakes: FakeCluster, start_lb: Callable[..., LB], refusing: str,
                                                  logprobs: bool) -> None:
    """Found by review: the wait for a node's abort (above) looked only for SGLang's 400 "Duplicate request ID
    detected"; a streamed request is refused as a 200 whose first event is that error, so a streamed retry to
    the node that still held the client's ``rid`` ended the client's stream with that error instead of the
    rerouted answer."""
    meta = {"input_token_logprobs": [[-0.5, 1, None]]} if logprobs else {}
    prefill_answer, decode_answer = {"text": "", "meta_info": meta}, {"text": "out", "meta_info": dict(meta)}
    held_role, other_role = fakes.start(1), fakes.start(2)
    node = StreamSlowAbort(prefill_answer if refusing == "decode" else decode_answer, run_s=0.5, abort_s=1.0)
    held_role[0].handlers["/generate"] = node.handler
    handler = refuse_first_stream(decode_answer if refusing == "decode" else prefill_answer, after=node.received)
    for other in other_role:
        other.handlers["/generate"] = handler
    prefills, decodes = (held_role, other_role) if refusing == "decode" else (other_role, held_role)
    lb = pd_lb(start_lb, prefills, decodes)
    body = {"text": "hi", "rid": "client-rid", "stream": True, "return_logprob": logprobs}
    answer = lb.http.post("/generate", json=body, timeout=20)
    assert answer.status_code == 200, answer.text
    assert "Duplicate" not in answer.text and '"out"' in answer.text, answer.text
    assert node.got[held_role[0].url] == ["client-rid", "client-rid"]
