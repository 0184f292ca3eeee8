"""The non-stream answers a real LB process holds at once are bounded (``--max-buffered-answer-bytes``).

Each answer was bounded (``--max-answer-bytes``) but not their sum: N large answers at once took N times the
cap, and the LB, the cluster's only URL, could be OOM-killed with every stream it carried (found by review).
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest

from tests.lb.behaviours import Gate, reply
from tests.lb.fakes import Exchange, FakeCluster, FakeNode
from tests.support.procs import wait_until
from tests.support.stalled_client import client_that_never_reads, wait_stalled

pytestmark = pytest.mark.timeout(60)

BIG_HEAD = 900_000  # what the held answer sends before it waits
BIG_SIZE = 1_000_000
MEDIUM = b'{"text": "' + b"m" * 700_000 + b'"}'
HUGE = b'{"text": "' + b"h" * 5_000_000 + b'"}'  # more than the kernel's queues to a client that does not read


def _by_size(gate: Gate):  # type: ignore[no-untyped-def]
    """``/generate`` answers by the request's ``size``: ``big`` sends 900 kB of 1 MB and waits for ``gate``,
    ``medium`` is 700 kB at once, ``small`` a few bytes; a ``stream`` request gets a stream."""
    async def handler(node: FakeNode, ex: Exchange) -> None:
        payload = ex.request.json()
        if payload.get("stream"):
            ex.start_chunked()
            ex.chunk(b'data: {"text": "s"}\n\n')
            ex.chunk(b"data: [DONE]\n\n")
            ex.end_chunked()
        elif payload["size"] == "big":
            ex.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % BIG_SIZE)
            ex.write(b"b" * BIG_HEAD)
            await gate.wait()
            ex.write(b"b" * (BIG_SIZE - BIG_HEAD))
        elif payload["size"] == "medium":
            ex.respond(200, MEDIUM)
        elif payload["size"] == "huge":
            ex.respond(200, HUGE)
        else:
            ex.respond(200, {"text": "small"})
    return handler


def test_answers_held_at_once_share_a_budget(fakes: FakeCluster, start_lb) -> None:
    """With 900 kB of one answer held, a 700 kB answer would pass the 1.5 MB budget: 503 ``overloaded`` with
    ``Retry-After`` naming the flag, while streams and small answers still pass; once the held answer went out
    its bytes are given back and the same request passes."""
    gate = Gate(fakes)
    node = fakes.start_one()
    node.handlers["/generate"] = _by_size(gate)
    lb = start_lb("--node", node.url, "--max-answer-bytes", str(BIG_SIZE), "--max-buffered-answer-bytes", "1500000")
    big: list[httpx.Response] = []
    holder = threading.Thread(target=lambda: big.append(lb.http.post("/generate", json={"size": "big"})))
    holder.start()
    try:
        refused: list[httpx.Response] = []

        def medium_refused() -> bool:
            answer = lb.http.post("/generate", json={"size": "medium"})
            refused[:] = [answer] if answer.status_code == 503 else []
            return bool(refused)
        wait_until(medium_refused, timeout=20, what="a medium answer refused while the big one is held")
        [answer] = refused
        error = answer.json()["error"]
        assert error["type"] == "overloaded" and "--max-buffered-answer-bytes" in error["message"], answer.text
        assert answer.headers["retry-after"] == "1"
        small = lb.http.post("/generate", json={"size": "small"})
        assert small.status_code == 200 and small.json() == {"text": "small"}
        stream = lb.http.post("/generate", json={"size": "medium", "stream": True})
        assert stream.status_code == 200 and b"[DONE]" in stream.content
    finally:
        gate.open()
        holder.join(timeout=20)
    assert big and big[0].status_code == 200 and len(big[0].content) == BIG_SIZE
    passed = lb.http.post("/generate", json={"size": "medium"})  # the held answer's bytes were given back
    assert passed.status_code == 200 and passed.content == MEDIUM
    for _ in range(3):  # nothing leaks: answers one after another each fit alone
        assert lb.http.post("/generate", json={"size": "medium"}).status_code == 200


def test_a_budget_below_one_answer_is_refused_at_start() -> None:
    """An answer of --max-answer-bytes would never pass a smaller budget: the LB exits 2 naming both flags."""
    done = subprocess.run([sys.executable, "-m", "lb", "--max-answer-bytes", "1000", "--max-buffered-answer-bytes",
                           "999"], capture_output=True, text=True, timeout=30)
    assert done.returncode == 2 and "--max-buffered-answer-bytes (999)" in done.stderr, done.stderr


def _never_read(lb_url: str, body: dict[str, object]) -> socket.socket:
    """``body`` sent to the LB's ``/generate`` on a connection whose client never reads, once the LB's kernel queue
    to it is full (what it holds unsent no longer grows)."""
    conn = client_that_never_reads(lb_url, body)
    try:
        wait_stalled(lb_url, conn, timeout=30)
    except BaseException:
        conn.close()
        raise
    return conn


@pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="reads the kernel's send queue from /proc/net/tcp")
def test_an_answer_its_client_does_not_read_stays_in_the_budget(fakes: FakeCluster, start_lb) -> None:
    """A 5 MB answer whose client never reads: its bytes stay counted until the last went to the connection (they
    were given back once handed to it in one write, and stayed in the LB's memory uncounted until the client read
    or left), so a second one is 503 ``overloaded``; once the first client leaves, it passes (review, stop 46)."""
    node = fakes.start_one()
    node.handlers["/generate"] = _by_size(Gate(fakes))
    lb = start_lb("--node", node.url, "--max-answer-bytes", str(6_000_000), "--max-buffered-answer-bytes",
                  str(8_000_000))
    conn = _never_read(lb.url, {"size": "huge"})
    try:
        second = lb.http.post("/generate", json={"size": "huge"})
        assert second.status_code == 503 and second.json()["error"]["type"] == "overloaded", second.status_code
    finally:
        conn.close()

    def passes() -> bool:
        return lb.http.post("/generate", json={"size": "huge"}).status_code == 200
    wait_until(passes, timeout=20, what="the budget given back once the client left")


def _logprob_answer(prompt_tokens: int) -> bytes:
    """A node's ``/generate`` answer with input logprobs of ``prompt_tokens`` tokens (about 90 bytes each)."""
    entries = [[-0.5 - (i % 97) / 100, i, None] for i in range(prompt_tokens)]
    tops = [[[-1.25 - k / 8, i + k, None] for k in range(3)] for i in range(prompt_tokens)]
    return json.dumps({"text": "out", "meta_info": {"input_token_logprobs": entries, "input_top_logprobs": tops,
                                                    "completion_tokens": 1}}).encode()


@pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="reads the kernel's send queue from /proc/net/tcp")
def test_a_merged_pd_answer_its_client_does_not_read_stays_in_the_budget(fakes: FakeCluster, start_lb) -> None:
    """Found by review (stop 46): a PD pair's non-stream answer with ``return_logprob`` (the prefill's input
    logprobs merged into the decode's answer, 5.5 MB here) was sent as one write, not in pieces as every other
    buffered answer: its request's share of ``--max-buffered-answer-bytes`` was given back at once while the bytes
    its client did not read stayed in the LB's memory, uncounted and never cut. A second such answer must be 503
    ``overloaded`` while the first is unread, and pass once its client left."""
    prefill, decode = fakes.start(2)
    prefill.handlers["/generate"] = reply(200, _logprob_answer(30_000))
    decode.handlers["/generate"] = reply(200, _logprob_answer(30_000))
    lb = start_lb("--prefill", prefill.url, "--decode", decode.url, "--max-answer-bytes", str(3_000_000),
                  "--max-buffered-answer-bytes", str(8_000_000))
    body = {"text": "hi", "return_logprob": True}
    conn = _never_read(lb.url, body)
    try:
        second = lb.http.post("/generate", json=body)
        assert second.status_code == 503 and second.json()["error"]["type"] == "overloaded", second.status_code
    finally:
        conn.close()

    def passes() -> bool:
        answer = lb.http.post("/generate", json=body)
        return answer.status_code == 200 and len(answer.json()["meta_info"]["input_token_logprobs"]) == 60_000
    wait_until(passes, timeout=20, what="the budget given back once the client left")
