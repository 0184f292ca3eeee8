"""What strangers can do to a real LB's log: forge lines of their own, or write one line per request for ever."""

from __future__ import annotations

import socket

import pytest

from tests.lb.behaviours import reply
from tests.lb.fakes import FakeCluster
from tests.lb.lbproc import LB, node_args
from tests.support.procs import wait_until

pytestmark = pytest.mark.timeout(30)

FORGED = "07:07:55 INFO    lb lb.membership: node http://10.9.9.9:80 (mixed) added by POST /nodes"
BURST = 10  # handoff.service.logs.RateLimit's default


def own_lines(lb: LB) -> list[str]:
    """The LB's log without the harness's command line."""
    return [line for line in lb.log().splitlines() if line and not line.startswith("=== start")]


def send_garbage(url: str) -> None:
    """One request the HTTP parser refuses; returns once the LB answered it (its warning is written by then)."""
    host, port = url[len("http://"):].rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5) as conn:
        conn.sendall(b"GARBAGE\x00\r\n\r\n")
        assert conn.recv(4096).startswith(b"HTTP/1.1 400")


def test_malformed_requests_cannot_flood_the_log(start_lb) -> None:
    """Anyone who reaches the port wrote one WARNING line per malformed request, without limit (a loop of them
    wrote about 5000 lines a second to disk); a burst is logged, then one line a minute says how many more."""
    lb = start_lb()
    for _ in range(5 * BURST):
        send_garbage(lb.url)
    warnings = [line for line in own_lines(lb) if "Invalid HTTP request received" in line]
    assert 1 <= len(warnings) <= BURST, len(warnings)


def test_a_node_error_cannot_forge_log_lines(fakes: FakeCluster, start_lb) -> None:
    """A prefill node's error text went into a WARNING line as it was: its CR/LF started lines of the node's
    choosing (and its ANSI escapes reached the operator's terminal). It is escaped, and rate limited."""
    prefill, decode = fakes.start(2)
    prefill.handlers["/generate"] = reply(500, f"x\r\n{FORGED}\x1b[2J".encode(), content_type="text/plain")
    decode.handlers["/generate"] = reply(200, {"text": "ok", "meta_info": {}})
    lb = start_lb(*node_args(prefill.url, flag="--prefill"), *node_args(decode.url, flag="--decode"))
    wait_until(lambda: all(node["routable"] for node in lb.nodes()), timeout=10, what="both nodes routable")
    for _ in range(2 * BURST):
        assert lb.http.post("/generate", json={"text": "hi"}).status_code == 500  # the prefill node's answer
    wait_until(lambda: any("its decode call was given up" in line for line in own_lines(lb)), timeout=10,
               what="the warning")
    lines = own_lines(lb)
    assert not any(line.startswith(FORGED) for line in lines), lines
    assert not any("\x1b" in line for line in lines), lines
    lost = [line for line in lines if "its decode call was given up" in line]
    assert all(f"x\\r\\n{FORGED}\\x1b[2J" in line for line in lost), lost
    assert len(lost) <= BURST, len(lost)


def test_a_node_failing_every_stream_cannot_flood_the_log(fakes: FakeCluster, start_lb) -> None:
    """lb/relay.py wrote one WARNING line per stream a node cut mid-way, without limit: a node failing every
    stream (or a client that makes it fail) wrote a line per request. A burst is logged, then it is counted;
    every cut stream is counted in ``handoff_lb_streams_cut_total``."""
    node = fakes.start_one()

    async def first_event_then_reset(fake, ex) -> None:
        ex.start_chunked()
        ex.chunk(b'data: {"text": "a"}\n\n')
        ex.abort()

    node.handlers["/generate"] = first_event_then_reset
    lb = start_lb(*node_args(node.url))
    lb.wait_routable([node.url])
    for _ in range(3 * BURST):
        with lb.http.stream("POST", "/generate", json={"text": "hi", "stream": True}) as answer:
            assert b"upstream_error" in answer.read()  # each stream still ends with its error event
    wait_until(lambda: any("failed mid-stream" in line for line in own_lines(lb)), timeout=10, what="the warning")
    failed = [line for line in own_lines(lb) if "failed mid-stream" in line]
    assert 1 <= len(failed) <= BURST, len(failed)
    # each counts 200 in handoff_lb_requests_total (the client got a 200): the cut ones are counted apart
    assert lb.metric("handoff_lb_streams_cut_total") == 3 * BURST


def test_a_node_failing_a_whole_answer_is_logged_and_rate_limited(fakes: FakeCluster, start_lb) -> None:
    """A node that dropped a non-stream answer half-way was a 502 to the client and nothing in the LB's log (a
    stream cut the same way was a warning): the line names the node, and a node failing every request writes a
    burst, then a count."""
    node = fakes.start_one()

    async def head_then_reset(fake, ex) -> None:
        ex.start_chunked(content_type="application/json")
        ex.chunk(b'{"text": "a')
        ex.abort()

    node.handlers["/generate"] = head_then_reset
    lb = start_lb(*node_args(node.url))
    lb.wait_routable([node.url])
    for _ in range(3 * BURST):
        answer = lb.http.post("/generate", json={"text": "hi"})
        assert answer.status_code == 502 and answer.json()["error"]["type"] == "upstream_error"
    wait_until(lambda: any("a generation request failed" in line for line in own_lines(lb)), timeout=10,
               what="the warning")
    failed = [line for line in own_lines(lb) if "a generation request failed" in line]
    assert 1 <= len(failed) <= BURST, len(failed)
    assert all(f"(502 upstream_error): {node.url} failed on /generate" in line for line in failed), failed
