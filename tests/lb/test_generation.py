"""Generation routing through a real LB process: policies, streams, disconnects, retries, 503s."""

from __future__ import annotations

import gzip
import json
from collections import Counter

import httpx
import pytest

from tests.lb.behaviours import Gate, drop, hang, reply, sse, stall_after_headers
from tests.lb.fakes import FakeCluster
from tests.lb.lbproc import LB, node_args, set_members
from tests.support.procs import wait_until

pytestmark = pytest.mark.timeout(30)

# an SSE stream cut at awkward places: mid-event, mid-line, a comment, CRLF framing
SSE_PIECES = [b'data: {"text": "a"}\n\n', b'data: {"te', b'xt": "b"}\n', b"\n: keep-alive\n\n",
              b'data: {"text": "\xc3\xa9"}\r\n\r\n', b"data: [DONE]\n\n"]


def served_by(answer: httpx.Response) -> str:
    return answer.json()["node"]


@pytest.mark.parametrize("path", ["/generate", "/v1/completions", "/v1/chat/completions"])
def test_non_stream_answer_is_the_nodes_own(module_fakes: FakeCluster, shared_lb: LB, path: str) -> None:
    node = module_fakes.start_one()
    raw = b'{"text":  "exact bytes",\n "meta_info": {"finish_reason": "stop"}}'
    node.handlers[path] = reply(200, raw)
    set_members(shared_lb, node.url)
    request = b'{"text": "hi", "sampling_params": {"max_new_tokens": 4}}'
    answer = shared_lb.http.post(path, content=request, headers={"Content-Type": "application/json",
                                                                 "X-Request-Id": "r-1"})
    assert answer.status_code == 200 and answer.content == raw
    assert answer.headers["content-type"] == "application/json"
    [seen] = node.requests_to(path)
    assert seen.body == request and seen.headers["x-request-id"] == "r-1"


def test_node_errors_are_relayed_as_they_are(module_fakes: FakeCluster, shared_lb: LB) -> None:
    node = module_fakes.start_one()
    node.handlers["/generate"] = reply(400, {"error": {"type": "invalid_request", "message": "bad sampling"}})
    set_members(shared_lb, node.url)
    answer = shared_lb.http.post("/generate", json={"text": "x"})
    assert answer.status_code == 400 and answer.json()["error"]["message"] == "bad sampling"


def test_round_robin_spreads_evenly(fakes: FakeCluster, start_lb) -> None:
    nodes = fakes.start(3)
    lb = start_lb(*node_args(*(n.url for n in nodes)), "--policy", "round_robin")
    counts = Counter(served_by(lb.http.post("/generate", json={"text": "x"})) for _ in range(9))
    assert counts == {n.url: 3 for n in nodes}


@pytest.mark.parametrize("policy", ["random", "power_of_two"])
def test_random_policies_use_every_routable_node(fakes: FakeCluster, start_lb, policy: str) -> None:
    nodes = fakes.start(2)
    lb = start_lb(*node_args(*(n.url for n in nodes)), "--policy", policy)
    counts = Counter(served_by(lb.http.post("/generate", json={"text": "x"})) for _ in range(40))
    assert set(counts) == {n.url for n in nodes}


def test_least_inflight_avoids_the_busy_node(module_fakes: FakeCluster, shared_lb: LB) -> None:
    busy, idle = module_fakes.start(2)
    gate = Gate(module_fakes)
    stream = sse(SSE_PIECES, gate=gate)
    busy.handlers["/generate"] = idle.handlers["/generate"] = stream
    set_members(shared_lb, busy.url, idle.url)
    with shared_lb.http.stream("POST", "/generate", json={"stream": True}) as held:
        held_chunks = held.iter_raw()  # keep it: a dropped iterator closes the stream
        next(held_chunks)
        holder = busy if busy.requests_to("/generate") else idle
        other = idle if holder is busy else busy
        other.handlers["/generate"] = reply(200, {"node": other.url})
        for _ in range(4):
            assert served_by(shared_lb.http.post("/generate", json={"text": "x"})) == other.url
        gate.open()
        assert b"".join(held_chunks).endswith(b"[DONE]\n\n")
    wait_until(lambda: all(n["in_flight"] == 0 for n in shared_lb.nodes()), timeout=5, what="in_flight 0")


def test_sse_is_relayed_byte_for_byte_and_first_byte_first(module_fakes: FakeCluster, shared_lb: LB) -> None:
    node = module_fakes.start_one()
    gate = Gate(module_fakes)
    node.handlers["/v1/chat/completions"] = sse(SSE_PIECES, gate=gate)
    set_members(shared_lb, node.url)
    with shared_lb.http.stream("POST", "/v1/chat/completions", json={"stream": True}) as answer:
        assert answer.status_code == 200
        assert answer.headers["content-type"] == "text/event-stream"
        chunks = answer.iter_raw()
        first = next(chunks)  # the node holds everything else until the gate opens
        assert first == SSE_PIECES[0]
        gate.open()
        rest = b"".join(chunks)
    assert first + rest == b"".join(SSE_PIECES)


def test_client_disconnect_cancels_the_upstream_stream(module_fakes: FakeCluster, shared_lb: LB) -> None:
    node = module_fakes.start_one()
    node.handlers["/generate"] = sse(SSE_PIECES, gate=Gate(module_fakes))  # never opened
    set_members(shared_lb, node.url)
    with shared_lb.http.stream("POST", "/generate", json={"stream": True}) as answer:
        next(answer.iter_raw())
    assert node.disconnected.wait(5), "the node never saw the LB close the request"
    wait_until(lambda: shared_lb.node(node.url)["in_flight"] == 0, timeout=5, what="in_flight 0")


def test_client_disconnect_cancels_a_waiting_request(module_fakes: FakeCluster, shared_lb: LB) -> None:
    node = module_fakes.start_one()
    node.handlers["/generate"] = hang()
    set_members(shared_lb, node.url)
    with pytest.raises(httpx.ReadTimeout):
        shared_lb.http.post("/generate", json={"text": "x"}, timeout=0.5)
    assert node.disconnected.wait(5)
    wait_until(lambda: shared_lb.node(node.url)["in_flight"] == 0, timeout=5, what="in_flight 0")
    wait_until(lambda: shared_lb.metric("handoff_lb_requests_total", route="/generate", code="499") == 1,
               timeout=5, what="499 counted")


def test_client_disconnect_after_a_large_body_cancels_a_waiting_request(module_fakes: FakeCluster,
                                                                        shared_lb: LB) -> None:
    """A body over uvicorn's 64 KiB read buffer leaves the connection's reading paused once it is in: the LB
    must read again to see the client leave (a disconnect noticed without a watcher task first missed it, and
    the node's request ran on for a client long gone)."""
    node = module_fakes.start_one()
    node.handlers["/generate"] = hang()
    set_members(shared_lb, node.url)
    body = b'{"text": "x"}' + b" " * (1 << 20)  # JSON allows the trailing whitespace
    with pytest.raises(httpx.ReadTimeout):
        shared_lb.http.post("/generate", content=body, headers={"content-type": "application/json"}, timeout=1)
    assert node.disconnected.wait(5), "the LB never closed the node's request after its client left"
    wait_until(lambda: shared_lb.node(node.url)["in_flight"] == 0, timeout=5, what="in_flight 0")


def test_refused_connection_is_retried_on_another_node(fakes: FakeCluster, start_lb) -> None:
    gone, alive = fakes.start(2)
    lb = start_lb(*node_args(gone.url, alive.url), "--policy", "round_robin", "--health-interval", "60",
                  fast_health=False)
    gone.stop()  # the LB still believes it healthy: no check for a minute
    for _ in range(4):
        answer = lb.http.post("/generate", json={"text": "x"})
        assert answer.status_code == 200 and served_by(answer) == alive.url
    assert lb.metric("handoff_lb_generate_retries_total") >= 1
    assert lb.node(gone.url)["health"] == "unhealthy"


def test_a_node_failing_mid_stream_ends_it_with_an_error_event(module_fakes: FakeCluster, shared_lb: LB) -> None:
    node = module_fakes.start_one()

    async def first_event_then_reset(fake, ex) -> None:
        ex.start_chunked()
        ex.chunk(SSE_PIECES[0])
        ex.abort()

    node.handlers["/generate"] = first_event_then_reset
    set_members(shared_lb, node.url)
    with shared_lb.http.stream("POST", "/generate", json={"stream": True}) as answer:
        body = answer.read()  # a clean end of the chunked body, not a truncated one
    assert body.startswith(SSE_PIECES[0])
    last = json.loads(body[len(SSE_PIECES[0]):].removeprefix(b"data: "))
    assert last["error"]["type"] == "upstream_error" and node.url in last["error"]["message"]


@pytest.mark.parametrize("handler,status,error_type", [
    (drop(), 502, "upstream_error"),
    (stall_after_headers(), 504, "upstream_timeout"),
    (hang(), 504, "upstream_timeout"),
], ids=["dropped", "stalled", "hung"])
def test_node_failures_after_the_request_was_sent(fakes: FakeCluster, start_lb, handler, status: int,
                                                  error_type: str) -> None:
    node = fakes.start_one()
    node.handlers["/generate"] = handler
    lb = start_lb(*node_args(node.url), "--generate-timeout", "0.5")
    answer = lb.http.post("/generate", json={"text": "x"})
    assert answer.status_code == status and answer.json()["error"]["type"] == error_type
    assert answer.json()["error"]["node"] == node.url


def test_released_nodes_are_skipped_and_all_released_is_503(module_fakes: FakeCluster, shared_lb: LB) -> None:
    released, serving = module_fakes.start(2)
    released.set_released()
    set_members(shared_lb, released.url, serving.url)
    assert shared_lb.node(released.url)["health"] == "healthy"  # released is not unhealthy
    for _ in range(4):
        assert served_by(shared_lb.http.post("/generate", json={"text": "x"})) == serving.url
    serving.set_released()
    serving.state["not_serving_reason"] = "node_released"  # each sidecar says why it does not serve
    released.state["not_serving_reason"] = "x" * 10_000  # a peer's word too long to repeat
    shared_lb.wait_routable([serving.url], expected=False)
    answer = shared_lb.http.post("/generate", json={"text": "x"})
    assert answer.status_code == 503 and answer.json()["error"]["type"] == "no_available_node"
    assert int(answer.headers["retry-after"]) >= 1
    # the 503 says why each node does not serve, as the node said it (it said only "admission closed")
    message = answer.json()["error"]["message"]
    assert f"{serving.url}: not serving (node_released, admission closed)" in message, message
    assert f"{released.url}: not serving (admission closed)" in message, message


def test_a_stale_view_is_corrected_by_the_nodes_503(fakes: FakeCluster, start_lb) -> None:
    """Released behind the LB's back: the sidecar's 503 node_released sends the request elsewhere."""
    first, second = fakes.start(2)
    lb = start_lb(*node_args(first.url, second.url), "--policy", "round_robin", "--health-interval", "60",
                  fast_health=False)
    first.set_released()
    for _ in range(3):
        assert served_by(lb.http.post("/generate", json={"text": "x"})) == second.url
    assert lb.metric("handoff_lb_generate_not_serving_retries_total") == 1
    second.set_released()
    answer = lb.http.post("/generate", json={"text": "x"})
    assert answer.status_code == 503 and answer.json()["error"]["type"] == "no_available_node"
    assert "retry-after" in answer.headers


def test_unhealthy_nodes_are_skipped(module_fakes: FakeCluster, shared_lb: LB) -> None:
    sick, well = module_fakes.start(2)
    sick.handlers["/memory_occupation"] = reply(500, b"broken")
    set_members(shared_lb, sick.url, well.url)
    assert shared_lb.node(sick.url)["health"] == "unhealthy"
    for _ in range(3):
        assert served_by(shared_lb.http.post("/generate", json={"text": "x"})) == well.url


def test_holding_nodes_take_requests_when_none_serves(module_fakes: FakeCluster, shared_lb: LB) -> None:
    holding = module_fakes.start_one()
    holding.state = {**holding.state, "serving": False, "admission": "holding"}
    holding.handlers["/generate"] = reply(200, {"node": holding.url, "held": True})
    set_members(shared_lb, holding.url)
    assert shared_lb.http.post("/generate", json={"text": "x"}).json()["held"] is True


def test_other_503s_are_relayed_not_retried(module_fakes: FakeCluster, shared_lb: LB) -> None:
    busy, other = module_fakes.start(2)
    for node in (busy, other):
        node.handlers["/generate"] = reply(503, {"error": {"type": "queue_full", "message": "try later"}})
    set_members(shared_lb, busy.url, other.url)
    answer = shared_lb.http.post("/generate", json={"text": "x"})
    assert answer.status_code == 503 and answer.json()["error"]["type"] == "queue_full"
    assert len(busy.requests_to("/generate")) + len(other.requests_to("/generate")) == 1


def test_a_503_whose_error_type_is_not_a_string_is_relayed(module_fakes: FakeCluster, shared_lb: LB) -> None:
    """The LB reads a 503's error type to decide whether to reroute: a list there was a 500 (unhashable)."""
    node = module_fakes.start_one()
    node.handlers["/generate"] = reply(503, {"error": {"type": ["node_released"], "message": "odd"}})
    set_members(shared_lb, node.url)
    answer = shared_lb.http.post("/generate", json={"text": "x"})
    assert answer.status_code == 503 and answer.json()["error"]["type"] == ["node_released"]


def test_a_non_stream_answer_over_the_cap_is_a_502(fakes: FakeCluster, start_lb) -> None:
    """A non-stream answer is buffered (a failure midway becomes a status), so it is bounded: past
    --max-answer-bytes the client gets a 502 naming the node, and the LB never holds more than the cap."""
    node = fakes.start_one()
    node.handlers["/generate"] = reply(200, b'{"text": "' + b"x" * 3_000_000 + b'"}')
    lb = start_lb("--node", node.url, "--max-answer-bytes", "1000000")
    answer = lb.http.post("/generate", json={"text": "x"})
    assert answer.status_code == 502, answer.text
    error = answer.json()["error"]
    assert error["type"] == "upstream_error" and error["node"] == node.url and "--max-answer-bytes" in error["message"]
    node.handlers["/generate"] = reply(200, b'{"text": "' + b"x" * 900_000 + b'"}')
    assert lb.http.post("/generate", json={"text": "x"}).status_code == 200


def test_content_encoding_travels_with_the_bytes(module_fakes: FakeCluster, shared_lb: LB) -> None:
    """A gzip answer keeps its Content-Encoding through the LB (it was dropped: clients got gzip bytes they
    took for JSON)."""
    node = module_fakes.start_one()
    packed = gzip.compress(b'{"text": "hello"}')

    async def gzipped(fake, ex) -> None:
        ex.respond(200, packed, headers={"Content-Encoding": "gzip"})

    node.handlers["/generate"] = gzipped
    set_members(shared_lb, node.url)
    answer = shared_lb.http.post("/generate", json={"text": "x"})
    assert answer.headers["content-encoding"] == "gzip"
    assert answer.json() == {"text": "hello"}  # httpx decodes it because the header came along
