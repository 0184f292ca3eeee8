"""The client's bounds against what the LB may legitimately send: a 502 as long as the 200 it stands for, and a
stream that starts late in its call (found by review)."""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import time
from typing import Callable

import pytest

from handoff.client import AsyncHandoffClient, FanoutFailed, HandoffClient, RetryPolicy, ServiceUnavailable
from tests.handoff.scripted import UNAVAILABLE, received, script

pytestmark = pytest.mark.timeout(60)


def test_a_502_as_long_as_the_lbs_200_still_names_the_failed_node(server) -> None:
    """The LB reads each succeeded node's body to 64 KiB and lists it in its 502 beside the failures: a 502 of 200
    nodes of 48 KiB is 9.6 MiB. The client read error answers to 8 MiB only, so a release that failed on one node
    raised ``invalid_response`` ("longer than the client's cap") and the failed node's name was lost."""
    body = {"success": True, "released": ["kv_cache"], "log": "x" * 48 * 1024}
    succeeded = [{"node": f"http://ok{i}:8080", "role": "mixed", "status": 200, "body": body} for i in range(200)]
    failures = [{"node": "http://bad:8080", "role": "mixed", "reason": "timeout", "error": "no answer within 120 s"}]
    answer = {"status": 502, "body": {"success": False, "message": "/release_memory_occupation failed on 1/201 nodes",
                                      "total": 201, "failed": 1, "failures": failures, "succeeded": succeeded}}
    assert len(json.dumps(answer["body"])) > 9 * 1024 * 1024
    script(server, answer)
    with HandoffClient(server.url) as client:
        with pytest.raises(FanoutFailed) as info:
            client.release()
    assert info.value.failed_nodes == ["http://bad:8080"] and len(info.value.succeeded) == 200

    async def run_async() -> FanoutFailed:
        async with AsyncHandoffClient(server.url) as client:
            with pytest.raises(FanoutFailed) as info:
                await client.resume()
        return info.value

    script(server, answer)
    assert asyncio.run(run_async()).failed_nodes == ["http://bad:8080"]


_REFUSAL = json.dumps({"error": {"type": "no_available_node", "message": "all released"}}).encode()


def _refused_then_slow_stream() -> Callable[[socket.socket], None]:
    """A raw server's behaviour: the first request a 503 with ``Retry-After: 2``, the next a stream whose second
    event comes 1.8 s after its first (a long prefill of the next sequence, a slow decode step)."""
    calls: list[int] = []

    def behave(conn: socket.socket) -> None:
        calls.append(1)
        if len(calls) == 1:
            conn.sendall(b"HTTP/1.1 503 Service Unavailable\r\nRetry-After: 2\r\nContent-Type: application/json\r\n"
                         b"Connection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(_REFUSAL), _REFUSAL))
            return
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
        for index, event in enumerate((b'data: {"text": "a"}\n\n', b'data: {"text": "ab"}\n\ndata: [DONE]\n\n')):
            if index:
                time.sleep(1.8)
            conn.sendall(b"%x\r\n%s\r\n" % (len(event), event))
        conn.sendall(b"0\r\n\r\n")
    return behave


def test_a_stream_started_late_in_its_call_is_not_cut_by_what_was_left(raw_server) -> None:
    """timeout=3: a 503, a 2 s wait, and the stream starts with 1 s of the call left. Each read of the stream was
    bounded by that second, so a 1.8 s gap between events raised ``timeout`` mid-stream, though a stream's events
    are not bounded by the call's timeout once it started (and a gap of the client's whole timeout is allowed to a
    stream that started at once)."""
    retry = RetryPolicy(max_attempts=2)
    with HandoffClient(raw_server(_refused_then_slow_stream()), timeout=3.0, retry=retry) as client:
        assert [event["text"] for event in client.stream_generate("x")] == ["a", "ab"]

    async def run_async() -> list[str]:
        async with AsyncHandoffClient(raw_server(_refused_then_slow_stream()), timeout=3.0, retry=retry) as client:
            return [event["text"] async for event in client.stream_generate("x")]

    assert asyncio.run(run_async()) == ["a", "ab"]


def test_a_retry_after_past_a_day_is_kept_and_not_cut_to_the_default(server) -> None:
    """A ``Retry-After`` of a day or more was read as no hint: ``retry_after`` None (though it is a number of
    seconds) and the policy's default of 1 s taken instead, so the client came back a second later to a server
    that said a day. It is the hint now: past the policy's ``max_wait_s`` the 503 is raised at once, carrying it."""
    sent = len(received(server))
    script(server, {**UNAVAILABLE, "headers": {"Retry-After": "90000"}}, {"body": {"text": "late"}})
    with HandoffClient(server.url, retry=RetryPolicy(max_attempts=2, max_wait_s=60)) as client:
        with pytest.raises(ServiceUnavailable) as info:
            client.generate("x")
    assert info.value.retry_after == 90000 and len(received(server)) == sent + 1


def _late_stream(conn: socket.socket) -> None:
    time.sleep(0.5)
    events = b'data: {"text": "a"}\n\ndata: [DONE]\n\n'
    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nContent-Length: %d\r\n\r\n%s"
                 % (len(events), events))
    time.sleep(2)  # the connection stays open: only the client's close frees its place in the pool


class _Interrupted(Exception):
    """Stands for a Ctrl-C (KeyboardInterrupt) reaching the caller while it waits."""


def test_a_stream_whose_caller_is_interrupted_while_it_opens_is_closed(raw_server) -> None:
    """A Ctrl-C (here an exception from a signal handler) while the sync client waited for a stream's head left
    the worker thread to open it anyway and keep the response, never closed: its connection stayed taken, and with
    the pool full every later call waited for one until its timeout."""
    url = raw_server(_late_stream)

    def interrupt(signum: int, frame: object) -> None:
        raise _Interrupted

    previous = signal.signal(signal.SIGALRM, interrupt)
    try:
        with HandoffClient(url, timeout=5, max_connections=1) as client:
            signal.setitimer(signal.ITIMER_REAL, 0.2)
            with pytest.raises(_Interrupted):
                next(iter(client.stream_generate("x")))
            assert [event["text"] for event in client.stream_generate("x")] == ["a"]
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def test_a_node_that_said_success_false_is_named_with_what_it_said(server) -> None:
    """A node answering 200 ``{"success": false, "message": ...}`` (SGLang's flush while requests are pending) is
    a failure the LB lists with its 200, ``reason`` ``success_false`` and the body as ``detail``: the message read
    "http://a:1 (200)", a failure described by a success's status, its reason and the node's words dropped."""
    said = json.dumps({"success": False, "message": "Cache not flushed: there are pending requests"})
    failures = [{"node": "http://a:1", "role": "mixed", "reason": "success_false", "status": 200, "detail": said},
                {"node": "http://b:1", "role": "mixed", "reason": "oversized_answer", "status": 200,
                 "error": "answer longer than 65536 bytes: cannot tell whether it succeeded", "detail": "{"}]
    script(server, {"status": 502, "body": {"message": "/flush_cache failed on 2/2 nodes", "total": 2, "failed": 2,
                                            "failures": failures, "succeeded": []}})
    with HandoffClient(server.url) as client:
        with pytest.raises(FanoutFailed) as info:
            client.flush_cache()
    text = str(info.value)
    assert "http://a:1 (200 success_false: Cache not flushed: there are pending requests)" in text, text
    assert "http://b:1 (200 oversized_answer: answer longer than 65536 bytes" in text, text
