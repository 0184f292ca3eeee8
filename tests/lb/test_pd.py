"""Prefill/decode routing through a real LB process: the SGLang PD protocol against fake nodes."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from handoff.protocol.sse import EventSplitter, event_data
from tests.lb.behaviours import Gate, drop, hang, reply, sse
from tests.lb.fakes import Exchange, FakeCluster, FakeNode
from tests.lb.lbproc import LB, node_args, set_members
from tests.support.procs import wait_until

pytestmark = pytest.mark.timeout(30)

DECODE_ANSWER = {"text": "out", "meta_info": {"input_token_logprobs": [[-0.3, 3, None]], "completion_tokens": 2}}
PREFILL_ANSWER = {"text": "", "meta_info": {"input_token_logprobs": [[None, 1, None], [-1.5, 2, None]]}}


def pd_pair(fakes: FakeCluster) -> tuple[FakeNode, FakeNode]:
    prefill, decode = fakes.start(2)
    prefill.handlers["/generate"] = reply(200, PREFILL_ANSWER)
    decode.handlers["/generate"] = reply(200, DECODE_ANSWER)
    return prefill, decode


def test_single_request_gets_bootstrap_fields_and_the_decode_answer(module_fakes: FakeCluster,
                                                                     shared_lb: LB) -> None:
    prefill, decode = pd_pair(module_fakes)
    lb = shared_lb
    set_members(lb, (prefill.url, "prefill", 8998), (decode.url, "decode"))
    answer = lb.http.post("/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 2},
                                             "a_newer_sglang_field": [1]})
    assert answer.status_code == 200 and answer.json() == DECODE_ANSWER
    [to_prefill], [to_decode] = prefill.requests_to("/generate"), decode.requests_to("/generate")
    assert to_prefill.body == to_decode.body
    sent = to_decode.json()
    assert sent["text"] == "hi" and sent["sampling_params"] == {"max_new_tokens": 2}
    assert sent["a_newer_sglang_field"] == [1]  # a key SGLang ignores passes on, for the nodes to ignore
    assert sent["bootstrap_host"] == "127.0.0.1" and sent["bootstrap_port"] == 8998
    assert isinstance(sent["bootstrap_room"], int) and 0 <= sent["bootstrap_room"] < 2 ** 63


def test_a_prompt_outside_ascii_reaches_the_nodes_no_larger(module_fakes: FakeCluster, shared_lb: LB) -> None:
    """Found by review: the LB wrote the body it adds bootstrap fields to with every non-ASCII character
    escaped, 6 bytes for a CJK character's 3 and 12 for an emoji's 4: a body within the nodes' own
    ``--max-body-bytes`` (the same default as the LB's) could reach them three times as large, and be refused
    there."""
    prefill, decode = pd_pair(module_fakes)
    set_members(shared_lb, (prefill.url, "prefill"), (decode.url, "decode"))
    prompt = "日本語のテキスト 🙂" * 2000
    request = json.dumps({"text": prompt}, ensure_ascii=False).encode()
    answer = shared_lb.http.post("/generate", content=request, headers={"Content-Type": "application/json"})
    assert answer.status_code == 200, answer.text
    [sent] = decode.requests_to("/generate")
    assert sent.json()["text"] == prompt and len(sent.body) < len(request) + 200


@pytest.mark.parametrize("payload,size", [({"text": ["a", "b", "c"]}, 3), ({"input_ids": [[1, 2], [3]]}, 2),
                                          ({"input_ids": [1, 2, 3]}, None)])
def test_batches_get_lists(module_fakes: FakeCluster, shared_lb: LB, payload: dict, size: int | None) -> None:
    prefill, decode = pd_pair(module_fakes)
    lb = shared_lb
    set_members(lb, (prefill.url, "prefill"), (decode.url, "decode"))
    assert lb.http.post("/generate", json=payload).status_code == 200
    sent = decode.requests_to("/generate")[0].json()
    if size is None:
        assert sent["bootstrap_port"] is None and isinstance(sent["bootstrap_room"], int)
        return
    assert sent["bootstrap_host"] == ["127.0.0.1"] * size and sent["bootstrap_port"] == [None] * size
    assert len(set(sent["bootstrap_room"])) == size


def test_input_logprobs_are_merged_when_asked(module_fakes: FakeCluster, shared_lb: LB) -> None:
    prefill, decode = pd_pair(module_fakes)
    lb = shared_lb
    set_members(lb, (prefill.url, "prefill"), (decode.url, "decode"))
    merged = lb.http.post("/generate", json={"text": "hi", "return_logprob": True}).json()
    assert merged["meta_info"]["input_token_logprobs"] == [[None, 1, None], [-1.5, 2, None], [-0.3, 3, None]]
    assert merged["meta_info"]["completion_tokens"] == 2
    plain = lb.http.post("/generate", json={"text": "hi"}).json()
    assert plain == DECODE_ANSWER


def test_streams_relay_the_decode_bytes_and_merge_logprobs_when_asked(module_fakes: FakeCluster,
                                                                      shared_lb: LB) -> None:
    prefill, decode = module_fakes.start(2)
    prefill.handlers["/generate"] = sse([b"data: " + json.dumps(PREFILL_ANSWER).encode() + b"\n\n",
                                         b"data: [DONE]\n\n"])
    events = [b'data: {"text": "a", "meta_info": {"input_token_logprobs": []}}\n\n',
              b'data: {"text": "ab", "meta_info": {"input_token_logprobs": []}}\n\n', b"data: [DONE]\n\n"]
    decode.handlers["/generate"] = sse([events[0][:20], events[0][20:], *events[1:]])
    lb = shared_lb
    set_members(lb, (prefill.url, "prefill"), (decode.url, "decode"))
    plain = lb.http.post("/generate", json={"text": "hi", "stream": True})
    assert plain.content == b"".join(events)
    merged = lb.http.post("/generate", json={"text": "hi", "stream": True, "return_logprob": True})
    data = [line for line in merged.content.split(b"\n\n") if line]
    assert data[-1] == b"data: [DONE]"
    for event in data[:-1]:
        logprobs = json.loads(event.removeprefix(b"data: "))["meta_info"]["input_token_logprobs"]
        assert logprobs == PREFILL_ANSWER["meta_info"]["input_token_logprobs"]


def test_chat_completions_get_bootstrap_fields(module_fakes: FakeCluster, shared_lb: LB) -> None:
    prefill, decode = module_fakes.start(2)
    lb = shared_lb
    set_members(lb, (prefill.url, "prefill", 9000), (decode.url, "decode"))
    answer = lb.http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
    assert answer.status_code == 200 and answer.json()["node"] == decode.url
    sent = prefill.requests_to("/v1/chat/completions")[0].json()
    assert sent["bootstrap_port"] == 9000 and sent["messages"][0]["content"] == "hi"


def test_a_refusing_prefill_node_is_replaced(fakes: FakeCluster, start_lb) -> None:
    gone, prefill, decode = fakes.start(3)
    prefill.handlers["/generate"] = reply(200, PREFILL_ANSWER)
    decode.handlers["/generate"] = reply(200, DECODE_ANSWER)
    lb = start_lb(*node_args(gone.url, prefill.url, flag="--prefill"), "--decode", decode.url,
                  "--policy", "round_robin", "--health-interval", "60", fast_health=False)
    gone.stop()
    for _ in range(3):
        assert lb.http.post("/generate", json={"text": "hi"}).json() == DECODE_ANSWER
    assert lb.metric("handoff_lb_generate_retries_total") >= 1
    rooms = [r.json()["bootstrap_room"] for r in decode.requests_to("/generate")]
    assert len(rooms) >= 3 and len(set(rooms)) == len(rooms)  # each attempt is a new pair with a new room


@pytest.mark.parametrize("fault,counter", [
    ("node_released", "handoff_lb_generate_not_serving_retries_total"),
    ("overloaded", "handoff_lb_generate_overloaded_retries_total"),
])
def test_a_pd_refusal_counts_as_a_retry_only_when_another_pair_was_tried(fakes: FakeCluster, start_lb, fault: str,
                                                                         counter: str) -> None:
    """Found by review: the last prefill node's refusal, answered 503 for want of another, counted as a retry;
    a node's ``overloaded`` 503 (nothing ran) moves the pair on as a not-serving one does."""
    first, second, decode = fakes.start(3)
    for node in (first, second):
        node.handlers["/generate"] = reply(503, {"error": {"type": fault, "message": "full"}})
    decode.handlers["/generate"] = reply(200, DECODE_ANSWER)
    lb = start_lb(*node_args(first.url, second.url, flag="--prefill"), "--decode", decode.url,
                  "--health-interval", "60", fast_health=False)
    answer = lb.http.post("/generate", json={"text": "hi"})
    assert answer.status_code == 503 and answer.json()["error"]["type"] == "no_available_node", answer.text
    assert len(first.requests_to("/generate")) == len(second.requests_to("/generate")) == 1
    assert lb.metric(counter) == 1
    if fault == "overloaded":  # both stay in rotation: the next request tries them again
        second.handlers["/generate"] = reply(200, PREFILL_ANSWER)
        for _ in range(2):  # whichever prefill node is picked first, the request ends on the one that serves
            assert lb.http.post("/generate", json={"text": "hi"}).json() == DECODE_ANSWER
        assert lb.metric(counter) == len(first.requests_to("/generate"))


def test_no_decode_node_serving_is_503(module_fakes: FakeCluster, shared_lb: LB) -> None:
    prefill, decode = pd_pair(module_fakes)
    decode.set_released()
    lb = shared_lb
    set_members(lb, (prefill.url, "prefill"), (decode.url, "decode"))
    answer = lb.http.post("/generate", json={"text": "hi"})
    assert answer.status_code == 503 and answer.json()["error"]["type"] == "no_available_node"
    assert "decode" in answer.json()["error"]["message"] and "retry-after" in answer.headers


def test_a_body_that_is_not_json_is_400_in_pd_mode(module_fakes: FakeCluster, shared_lb: LB) -> None:
    prefill, decode = pd_pair(module_fakes)
    lb = shared_lb
    set_members(lb, (prefill.url, "prefill"), (decode.url, "decode"))
    answer = lb.http.post("/generate", content=b"\xff not json")
    assert answer.status_code == 400 and answer.json()["error"]["type"] == "invalid_request"
    for text in (5, True, {"a": 1}):  # len() of it was a 500
        answer = lb.http.post("/generate", json={"text": text})
        assert answer.status_code == 400 and "text must be a string" in answer.json()["error"]["message"]


@pytest.mark.parametrize("blank_line", [b"\r\n\r\n", b"\r\r", b"\n\r\n"])
def test_crlf_streams_are_merged_event_by_event(module_fakes: FakeCluster, shared_lb: LB, blank_line: bytes) -> None:
    """Events ending in CRLF or CR blank lines are found as they arrive (the relay looked for LF LF only, so it
    buffered such a stream to its end and merged nothing)."""
    prefill, decode = module_fakes.start(2)
    prefill.handlers["/generate"] = sse([b"data: " + json.dumps(PREFILL_ANSWER).encode() + blank_line,
                                         b"data: [DONE]" + blank_line])
    gate = Gate(module_fakes)
    first = b'data: {"text": "a", "meta_info": {"input_token_logprobs": []}}' + blank_line
    decode.handlers["/generate"] = sse([first, b'data: {"text": "ab", "meta_info": {}}' + blank_line,
                                        b"data: [DONE]" + blank_line], gate=gate)
    set_members(shared_lb, (prefill.url, "prefill"), (decode.url, "decode"))
    body = {"text": "hi", "stream": True, "return_logprob": True}
    with shared_lb.http.stream("POST", "/generate", json=body) as answer:
        chunks = answer.iter_bytes()
        head = next(chunks)  # arrives while the decode node holds the rest: nothing waits for the end
        assert json.loads(head.split(b"data: ", 1)[1])["meta_info"]["input_token_logprobs"] == \
            PREFILL_ANSWER["meta_info"]["input_token_logprobs"]
        gate.open()
        rest = b"".join(chunks)
    splitter = EventSplitter()
    events = [event_data(e) for e in splitter.feed(head + rest)]
    assert events[-1] == b"[DONE]" and splitter.finish() == b""
    for event in events[:-1]:
        merged = json.loads(event)["meta_info"]["input_token_logprobs"]
        assert merged == PREFILL_ANSWER["meta_info"]["input_token_logprobs"]


def test_a_decode_event_that_never_ends_is_a_failure_of_that_node(module_fakes: FakeCluster, shared_lb: LB) -> None:
    """An event whose blank line never comes is bounded (the splitter held all of it before: the LB grew without
    limit): past the bound the stream ends with an error event naming the node, and the LB serves on."""
    prefill, decode = module_fakes.start(2)
    prefill.handlers["/generate"] = sse([b"data: " + json.dumps(PREFILL_ANSWER).encode() + b"\n\n",
                                         b"data: [DONE]\n\n"])

    async def endless_event(node: FakeNode, ex: Exchange) -> None:
        ex.start_chunked(200, "text/event-stream")
        ex.chunk(b'data: {"text": "')
        while not ex.is_closed:
            ex.chunk(b"x" * (1 << 20))
            while ex.conn.transport.get_write_buffer_size() > (4 << 20) and not ex.is_closed:
                await asyncio.sleep(0.005)
            await asyncio.sleep(0)

    decode.handlers["/generate"] = endless_event
    lb = shared_lb
    set_members(lb, (prefill.url, "prefill"), (decode.url, "decode"))
    answer = lb.http.post("/generate", json={"text": "hi", "stream": True, "return_logprob": True})
    [last] = [e for e in EventSplitter().feed(answer.content)]  # nothing of the endless event is passed on
    error = json.loads(event_data(last))["error"]
    assert error["type"] == "upstream_error" and decode.url in error["message"] and "event" in error["message"]
    decode.handlers["/generate"] = reply(200, DECODE_ANSWER)
    assert lb.http.post("/generate", json={"text": "hi"}).json()["text"] == "out"


def test_a_client_leaving_while_the_prefill_waits_closes_the_decode_stream(module_fakes: FakeCluster,
                                                                         shared_lb: LB) -> None:
    """The decode node already streams, the prefill has not answered: a client leaving then closes both (the
    decode stream was left open, generating for nobody, until the LB's generate deadline)."""
    prefill, decode = module_fakes.start(2)

    async def never_answers(node: FakeNode, exchange: Exchange) -> None:
        await exchange.wait_closed()

    async def streams(node: FakeNode, exchange: Exchange) -> None:
        exchange.start_chunked()
        exchange.chunk(b'data: {"text": "x"}\n\n')
        await exchange.wait_closed()

    prefill.handlers["/generate"] = never_answers
    decode.handlers["/generate"] = streams
    set_members(shared_lb, (prefill.url, "prefill"), (decode.url, "decode"))
    with pytest.raises(httpx.ReadTimeout):
        shared_lb.http.post("/generate", json={"text": "hi", "stream": True}, timeout=1.0)
    assert decode.disconnected.wait(5), "the decode stream stayed open after the client left"
    assert prefill.disconnected.wait(5)
    wait_until(lambda: shared_lb.node(decode.url)["in_flight"] == 0, timeout=5, what="in_flight 0")


def test_a_decode_failure_known_at_once_does_not_wait_for_the_prefill(fakes: FakeCluster, start_lb) -> None:
    """Found by review: the decode node dropped the request at once, yet the LB waited for the prefill node's
    answer up to --generate-timeout (a real prefill node waits long for a decode node that never comes), while
    the client got nothing. The prefill call is given up (its connection closed) as soon as the decode failed."""
    prefill, decode = fakes.start(2)
    prefill.handlers["/generate"] = hang()
    decode.handlers["/generate"] = drop()
    lb = start_lb("--prefill", prefill.url, "--decode", decode.url, "--generate-timeout", "20")
    lb.wait_routable([prefill.url, decode.url])
    started = time.monotonic()
    answer = lb.http.post("/generate", json={"text": "hi"}, timeout=30)
    assert answer.status_code == 502 and decode.url in answer.text, answer.text
    assert time.monotonic() - started < 10, "the client waited for the prefill node after the decode failed"
    wait_until(lambda: lb.node(prefill.url)["in_flight"] == 0, timeout=5, what="the prefill call given up")


@pytest.mark.parametrize("stream", [False, True])
def test_a_decode_refusal_is_answered_at_once(fakes: FakeCluster, start_lb, stream: bool) -> None:
    """Found by review: a decode node's 400 counted as taking the request, so the LB waited for the prefill
    node (a real one waits for a decode that never comes) and answered 504 naming the prefill node."""
    prefill, decode = fakes.start(2)
    prefill.handlers["/generate"] = hang()
    refusal = {"error": {"type": "invalid_request", "message": "max_new_tokens too large"}}
    decode.handlers["/generate"] = reply(400, refusal)
    lb = start_lb("--prefill", prefill.url, "--decode", decode.url, "--generate-timeout", "20")
    lb.wait_routable([prefill.url, decode.url])
    started = time.monotonic()
    answer = lb.http.post("/generate", json={"text": "hi", "stream": stream}, timeout=30)
    assert answer.status_code == 400 and answer.json() == refusal, answer.text
    assert time.monotonic() - started < 10, "the client waited for the prefill node after the decode refused"
    wait_until(lambda: lb.node(prefill.url)["in_flight"] == 0, timeout=5, what="the prefill call given up")


async def waits_for_the_kv(node: FakeNode, exchange: Exchange) -> None:
    """A decode node whose prefill node never sends the KV cache: it waits until its connection closes (a
    stream's head goes out at once, as SGLang's does)."""
    if exchange.request.json().get("stream"):
        exchange.start_chunked()
    await exchange.wait_closed()


@pytest.mark.parametrize("stream", [False, True])
def test_a_prefill_failure_ends_the_pair_at_once(fakes: FakeCluster, start_lb, stream: bool) -> None:
    """Found by review: a prefill node's answer other than 2xx (a 500: it made no KV cache) was taken for a
    node that took the request, so the LB waited for the decode node, which waits for that KV cache in vain:
    the client got a 504 naming the decode node after --generate-timeout (3600 s by default), or a stream that
    stayed silent that long. The prefill node's answer is the client's at once, and the decode call (a stream
    already begun too) is closed, so that node aborts."""
    prefill, decode = fakes.start(2)
    failure = {"error": {"type": "internal_error", "message": "prefill ran out of memory"}}
    prefill.handlers["/generate"] = reply(500, failure)
    decode.handlers["/generate"] = waits_for_the_kv
    lb = start_lb("--prefill", prefill.url, "--decode", decode.url, "--generate-timeout", "20")
    lb.wait_routable([prefill.url, decode.url])
    started = time.monotonic()
    try:
        answer = lb.http.post("/generate", json={"text": "hi", "stream": stream}, timeout=8)
    except httpx.ReadTimeout:
        pytest.fail("the LB waited for the decode node after the prefill node failed")
    assert answer.status_code == 500 and answer.json() == failure, answer.text
    assert time.monotonic() - started < 5
    assert decode.disconnected.wait(5), "the decode call went on after its prefill node failed"
    wait_until(lambda: lb.node(decode.url)["in_flight"] == 0 and lb.node(prefill.url)["in_flight"] == 0,
               timeout=5, what="both calls over")


class BootstrapRooms:
    """SGLang's PD hand-off, faked on the fakes' loop: a decode node answers once a prefill node took the
    request's bootstrap room, and waits for it until its connection closes (a prefill node that never took the
    request sends no KV)."""

    def __init__(self) -> None:
        self._taken: dict[int, asyncio.Event] = {}

    def _room(self, exchange: Exchange) -> asyncio.Event:
        return self._taken.setdefault(exchange.request.json()["bootstrap_room"], asyncio.Event())

    async def prefill(self, node: FakeNode, exchange: Exchange) -> None:
        self._room(exchange).set()
        exchange.respond(200, PREFILL_ANSWER)

    async def decode(self, node: FakeNode, exchange: Exchange) -> None:
        taken = asyncio.ensure_future(self._room(exchange).wait())
        closed = asyncio.ensure_future(exchange.wait_closed())
        await asyncio.wait({taken, closed}, return_when=asyncio.FIRST_COMPLETED)
        closed.cancel()
        if taken.cancel():
            return
        exchange.respond(200, DECODE_ANSWER)


@pytest.mark.parametrize("refusal", ["node_released", "weight_version_unavailable", "connection_refused"])
def test_a_prefill_refusal_known_at_once_does_not_wait_for_the_decode(fakes: FakeCluster, start_lb,
                                                                       refusal: str) -> None:
    """Found by review: a prefill node that ran nothing (its connection refused, a not-serving 503, or a pin it
    no longer serves) was noticed only once the decode node answered, and a real decode node waits for the KV
    of a prefill node that never took the request: the client waited for the decode node's bootstrap timeout,
    then got its error, where another prefill node could have served it at once. The decode call is given up
    and the pair picked again as soon as the prefill refused."""
    refusing, prefill, decode = fakes.start(3)
    rooms = BootstrapRooms()
    prefill.handlers["/generate"] = rooms.prefill
    decode.handlers["/generate"] = rooms.decode
    refusing.handlers["/generate"] = reply(503, {"error": {"type": refusal, "message": "refused"}})
    lb = start_lb(*node_args(refusing.url, prefill.url, flag="--prefill"), "--decode", decode.url,
                  "--policy", "round_robin", "--health-interval", "60", "--generate-timeout", "20",
                  fast_health=False)
    lb.wait_routable([refusing.url, prefill.url, decode.url])
    if refusal == "connection_refused":
        refusing.stop()
    for _ in range(2):  # round robin: one of the two goes to the refusing prefill node first
        started = time.monotonic()
        try:
            answer = lb.http.post("/generate", json={"text": "hi"}, headers={"X-Weight-Version": "default"},
                                  timeout=8)
        except httpx.ReadTimeout:
            pytest.fail("the LB waited for the decode node after the prefill node refused")
        assert answer.status_code == 200 and answer.json() == DECODE_ANSWER, answer.text
        assert time.monotonic() - started < 5
    assert len(refusing.requests_to("/generate")) == (0 if refusal == "connection_refused" else 1)
    wait_until(lambda: lb.node(decode.url)["in_flight"] == 0, timeout=5, what="the decode calls given up")


STREAM_REFUSAL = {"error": {"message": "Duplicate request ID detected: r1", "type": "invalid_request_error",
                            "code": 400, "retryable": False}}
REFUSAL_EVENTS = [b"data: " + json.dumps(STREAM_REFUSAL).encode() + b"\n\n", b"data: [DONE]\n\n"]


async def waits_for_its_decode_node(node: FakeNode, exchange: Exchange) -> None:
    """A prefill node whose decode node never fetches the KV cache: its stream's head goes out at once, as
    SGLang's does, and nothing more until its connection closes."""
    exchange.start_chunked()
    await exchange.wait_closed()


@pytest.mark.parametrize("logprobs", [False, True])
def test_a_prefill_stream_refusal_ends_the_pair_at_once(fakes: FakeCluster, start_lb, logprobs: bool) -> None:
    """Found by review: SGLang refuses a streamed request it cannot take (a duplicate rid, a prompt too long)
    with a 200 whose first event is the error. A prefill node's such refusal was taken for a stream under
    way: the LB relayed the decode stream, whose node waits for a KV cache the prefill never makes, so the
    client's stream stayed silent until the decode node's own timeout (or --generate-timeout) and the
    prefill node's reason was dropped. The refusal is now the client's, and the decode call is closed."""
    prefill, decode = fakes.start(2)
    prefill.handlers["/generate"] = sse(REFUSAL_EVENTS)
    decode.handlers["/generate"] = waits_for_the_kv
    lb = start_lb("--prefill", prefill.url, "--decode", decode.url, "--generate-timeout", "20")
    lb.wait_routable([prefill.url, decode.url])
    body = {"text": "hi", "stream": True, "return_logprob": logprobs, "rid": "r1"}
    try:
        answer = lb.http.post("/generate", json=body, timeout=8)
    except httpx.ReadTimeout:
        pytest.fail("the client's stream waited for a decode node whose prefill node refused the request")
    assert answer.status_code == 200, answer.text
    events = [event_data(e) for e in EventSplitter().feed(answer.content)]
    assert json.loads(events[0]) == STREAM_REFUSAL and events[1:] == [b"[DONE]"], answer.content
    assert decode.disconnected.wait(5), "the decode call went on after its prefill node refused"
    wait_until(lambda: lb.node(decode.url)["in_flight"] == 0 and lb.node(prefill.url)["in_flight"] == 0,
               timeout=5, what="both calls over")


@pytest.mark.parametrize("logprobs", [False, True])
def test_a_decode_stream_refusal_closes_the_prefill_call(fakes: FakeCluster, start_lb, logprobs: bool) -> None:
    """Found by review: a decode node's stream refusal (a 200 whose first event is the error) was relayed,
    but the prefill answer went on being read in the background: a real prefill node waits for a decode node
    that never comes, holding the request's KV cache and its in-flight count at the LB until its own bootstrap
    timeout (or --generate-timeout). With return_logprob the client got nothing until then, as the prefill
    answer was read before the decode stream. The decode refusal is the client's at once and the prefill call
    is closed."""
    prefill, decode = fakes.start(2)
    prefill.handlers["/generate"] = waits_for_its_decode_node
    decode.handlers["/generate"] = sse(REFUSAL_EVENTS)
    lb = start_lb("--prefill", prefill.url, "--decode", decode.url, "--generate-timeout", "20")
    lb.wait_routable([prefill.url, decode.url])
    body = {"text": "hi", "stream": True, "return_logprob": logprobs}
    try:
        answer = lb.http.post("/generate", json=body, timeout=8)
    except httpx.ReadTimeout:
        pytest.fail("the client waited for a prefill node whose decode node refused the request")
    assert answer.status_code == 200 and answer.content == b"".join(REFUSAL_EVENTS), answer.content
    assert prefill.disconnected.wait(5), "the prefill call went on after its decode node refused"
    wait_until(lambda: lb.node(prefill.url)["in_flight"] == 0, timeout=5, what="the prefill call closed")


def test_a_prefill_event_that_cannot_be_merged_is_an_error_not_an_answer_without_logprobs(
        module_fakes: FakeCluster, shared_lb: LB) -> None:
    """Found by review: a prefill stream event the LB could not read (past the 64 MiB event bound, which the
    input top logprobs of a long prompt reach, or not JSON within bounds) was left out, and the decode stream
    relayed without the prompt's input logprobs: a 200 that looks whole. It is a 502 naming the prefill node, as
    the same failure of a non-streamed answer is."""
    prefill, decode = module_fakes.start(2)
    unreadable = b'data: {"meta_info": {"input_token_logprobs": ' + b"[" * 100 + b"]" * 100 + b"}}\n\n"
    prefill.handlers["/generate"] = sse([unreadable, b"data: [DONE]\n\n"])
    decode.handlers["/generate"] = sse([b'data: {"text": "a", "meta_info": {"input_token_logprobs": []}}\n\n',
                                        b"data: [DONE]\n\n"])
    set_members(shared_lb, (prefill.url, "prefill"), (decode.url, "decode"))
    answer = shared_lb.http.post("/generate", json={"text": "hi", "stream": True, "return_logprob": True})
    assert answer.status_code == 502, answer.content
    error = answer.json()["error"]
    assert error["type"] == "upstream_error" and prefill.url in error["message"], error
    wait_until(lambda: shared_lb.node(decode.url)["in_flight"] == 0, timeout=5, what="the decode call closed")
