"""Issue 13's wire findings through a real LB process: a fake node writes the raw bytes of a broken answer.

The upstream client's own tests (``tests/service/test_upstream_wire.py``) pin
each rule; these show what a caller of the LB sees: its own answer, never
another request's; a 502 naming the node for an answer that is not HTTP; one
result per node in a fan-out.
"""

from __future__ import annotations

import asyncio

import psutil
import pytest

from tests.lb.behaviours import reply
from tests.lb.fakes import Exchange, FakeCluster, FakeNode
from tests.lb.lbproc import LB, set_members

pytestmark = pytest.mark.timeout(60)


def answer(body: bytes, extra: bytes = b"") -> bytes:
    return (b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n%s\r\n%s"
            % (len(body), extra, body))


def answers_in_turn(*scripts: list[bytes | float]) -> object:
    """The n-th request gets ``scripts[n]``: bytes written as they are, a float a pause (the node's own
    latency) between writes; later requests get a plain answer naming their number."""
    count = 0

    async def handler(node: FakeNode, ex: Exchange) -> None:
        nonlocal count
        count += 1
        for step in scripts[count - 1] if count <= len(scripts) else [answer(b'{"n": %d}' % count)]:
            if isinstance(step, float):
                await asyncio.sleep(step)
            else:
                ex.write(step)

    return handler


def test_found_1_a_continue_before_the_answer_never_crosses_to_the_next_request(
        module_fakes: FakeCluster, shared_lb: LB) -> None:
    """The node sends 100 Continue and its answer 0.3 s later: a client taking the 100 for the answer
    pooled the connection, and the next request on it got the first one's answer."""
    node = module_fakes.start_one()
    node.handlers["/generate"] = answers_in_turn([b"HTTP/1.1 100 Continue\r\n\r\n", 0.3, answer(b'{"n": 1}')])
    set_members(shared_lb, node.url)
    first = shared_lb.http.post("/generate", json={"text": "a"})
    second = shared_lb.http.post("/generate", json={"text": "b"})
    assert (first.status_code, first.json()) == (200, {"n": 1})
    assert (second.status_code, second.json()) == (200, {"n": 2})


def test_found_1_two_answers_in_one_segment_are_one_answer(module_fakes: FakeCluster, shared_lb: LB) -> None:
    node = module_fakes.start_one()
    node.handlers["/generate"] = answers_in_turn([answer(b'{"n": 1}') + answer(b'{"n": "stray"}')])
    set_members(shared_lb, node.url)
    assert shared_lb.http.post("/generate", json={"text": "a"}).json() == {"n": 1}
    assert shared_lb.http.post("/generate", json={"text": "b"}).json() == {"n": 2}


def test_found_1_early_hints_do_not_lend_their_headers(module_fakes: FakeCluster, shared_lb: LB) -> None:
    node = module_fakes.start_one()
    node.handlers["/generate"] = answers_in_turn(
        [b"HTTP/1.1 103 Early Hints\r\nContent-Type: text/html\r\nCache-Control: no-store\r\n\r\n" + answer(b"{}")])
    set_members(shared_lb, node.url)
    relayed = shared_lb.http.post("/generate", json={"text": "a"})
    assert relayed.status_code == 200 and relayed.headers["content-type"] == "application/json"
    assert "cache-control" not in relayed.headers


def test_found_2_endless_header_lines_are_a_502_and_cost_the_lb_bounded_memory(
        module_fakes: FakeCluster, shared_lb: LB) -> None:
    """The node offers 64 MiB of header lines (the LB grew to 1.3 GiB on such a node)."""
    node = module_fakes.start_one()

    async def flood(fake: FakeNode, ex: Exchange) -> None:
        ex.write(b"HTTP/1.1 200 OK\r\n")
        block = b"X-Flood: aaaaaaaaaaaaaaaa\r\n" * 2048  # 56 KiB of header lines
        for _ in range(64 * 1024 * 1024 // len(block)):
            if ex.is_closed:
                return
            ex.write(block)
            await asyncio.sleep(0)

    node.handlers["/generate"] = flood
    set_members(shared_lb, node.url)
    lb_process = psutil.Process(shared_lb.proc.pid)
    rss_before = lb_process.memory_info().rss
    relayed = shared_lb.http.post("/generate", json={"text": "a"})
    assert relayed.status_code == 502 and relayed.json()["error"]["node"] == node.url
    assert "65536" in relayed.json()["error"]["message"]
    assert lb_process.memory_info().rss - rss_before < 64 * 1024 * 1024


@pytest.mark.parametrize("status", [b"999", b"000", b"101"])
def test_found_3_an_odd_status_is_a_502_naming_the_node(module_fakes: FakeCluster, shared_lb: LB,
                                                       status: bytes) -> None:
    node = module_fakes.start_one()
    node.handlers["/generate"] = answers_in_turn([b"HTTP/1.1 " + status + b" Odd\r\nContent-Length: 2\r\n\r\n{}"])
    set_members(shared_lb, node.url)
    relayed = shared_lb.http.post("/generate", json={"text": "a"})
    assert relayed.status_code == 502 and relayed.json()["error"]["node"] == node.url


def test_a_fan_out_gets_one_result_per_node_whatever_one_answers(module_fakes: FakeCluster,
                                                                 shared_lb: LB) -> None:
    odd, good = module_fakes.start_one(), module_fakes.start_one()
    odd.handlers["/flush_cache"] = answers_in_turn([b"HTTP/1.1 999 Odd\r\n\r\n"])
    good.handlers["/flush_cache"] = reply(200, {"success": True})
    set_members(shared_lb, odd.url, good.url)
    result = shared_lb.http.post("/flush_cache").json()
    assert result["total"] == 2 and [f["node"] for f in result["failures"]] == [odd.url]
    assert result["failures"][0]["reason"] == "protocol_error"
    assert [s["node"] for s in result["succeeded"]] == [good.url]
