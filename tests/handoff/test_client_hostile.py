"""The clients against servers that misbehave (a raw-socket server for what a well-behaved HTTP framework will
not send, the scripted server otherwise) and against a real sidecar: every outcome is a result or one
:class:`HandoffError`, never another exception type, an empty success or a call without end."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from typing import Callable

import pytest

from handoff.client import AsyncHandoffClient, FanoutFailed, HandoffClient, HandoffError, RetryPolicy
from handoff.client.calls import DEFAULT_CONTROL_TIMEOUT_S, DEFAULT_WEIGHT_SYNC_TIMEOUT_S, _Calls
from handoff.service.flag_types import MAX_SECONDS
from tests.handoff.scripted import UNAVAILABLE, received, script

pytestmark = pytest.mark.timeout(60)

HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"


def _drip(conn: socket.socket) -> None:
    conn.sendall(HEAD + b"Transfer-Encoding: chunked\r\n\r\n")
    for _ in range(100):  # 1 byte every 0.1 s: each read arrives well within any per-read timeout
        conn.sendall(b"1\r\n \r\n")
        time.sleep(0.1)


def _endless(conn: socket.socket) -> None:
    conn.sendall(HEAD + b"Transfer-Encoding: chunked\r\n\r\n")
    chunk = b"%x\r\n%s\r\n" % (65536, b" " * 65536)
    for _ in range(256):  # 16 MiB offered
        conn.sendall(chunk)


def _truncated(conn: socket.socket) -> None:
    conn.sendall(HEAD + b"Content-Length: 100\r\n\r\n{\"text\": ")


def _cut_stream(conn: socket.socket) -> None:
    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
    event = b'data: {"text": "a"}\n\n'
    conn.sendall(b"%x\r\n%s\r\n" % (len(event), event) + b"40\r\ndata: {\"te")


def refused_url() -> str:
    with socket.create_server(("127.0.0.1", 0)) as s:
        return f"http://127.0.0.1:{s.getsockname()[1]}"


def error_of(call: Callable[[], object]) -> HandoffError:
    with pytest.raises(HandoffError) as info:
        call()
    return info.value


def test_a_dribbled_answer_ends_at_the_calls_timeout(raw_server) -> None:
    started = time.monotonic()
    with HandoffClient(raw_server(_drip), timeout=1.0) as client:
        error = error_of(lambda: client.generate("x"))
    assert error.status == 0 and error.type == "timeout" and time.monotonic() - started < 5


def test_an_endless_answer_stops_at_the_cap(raw_server) -> None:
    with HandoffClient(raw_server(_endless), max_answer_bytes=1 << 20) as client:
        error = error_of(client.memory_occupation)
    assert error.type == "invalid_response" and "cap of 1048576 bytes" in error.message


def test_the_network_failing_is_one_error(raw_server) -> None:
    with HandoffClient(raw_server(_truncated), timeout=5) as client:
        truncated = error_of(lambda: client.generate("x"))
    with HandoffClient(refused_url(), timeout=5) as client:
        refused = error_of(client.release)
    assert (truncated.status, truncated.type) == (0, "incomplete_response")
    assert (refused.status, refused.type) == (0, "unreachable")


def test_a_stream_cut_mid_chunk_is_incomplete(raw_server) -> None:
    url = raw_server(_cut_stream)
    events: list[dict] = []
    with HandoffClient(url) as client:
        with pytest.raises(HandoffError) as info:
            for event in client.stream_generate("x"):
                events.append(event)
    assert events == [{"text": "a"}] and info.value.type == "incomplete_stream"

    async def run() -> str:
        async with AsyncHandoffClient(url) as client:
            with pytest.raises(HandoffError) as info:
                async for _ in client.stream_generate("x"):
                    pass
        return info.value.type
    assert asyncio.run(run()) == "incomplete_stream"


@pytest.mark.parametrize(("answer", "kind"), [
    ({"raw": "<html>oops</html>"}, "invalid_response"),
    ({"status": 400, "body": {"error": "bad thing"}}, "http_error"),
    ({"body": [1, 2, 3]}, "invalid_response"),
    ({"body": {"total": "many", "results": []}}, "invalid_response"),
    ({"body": {"success": False, "message": "nothing released"}}, "control_failed"),
])
def test_odd_answers_are_one_clear_error(server, answer: dict, kind: str) -> None:
    script(server, answer)
    with HandoffClient(server.url) as client:
        error = error_of(client.release)
    assert error.type == kind, error


def test_a_502_with_odd_failures_still_names_what_it_can(server) -> None:
    script(server, {"status": 502, "body": {"message": "m", "total": "2", "failures": ["a", {"node": "http://b"}]}})
    with HandoffClient(server.url) as client:
        with pytest.raises(FanoutFailed) as info:
            client.release()
    assert info.value.failed_nodes == ["http://b"] and info.value.total == 0


def test_a_503_before_a_stream_starts_is_retried(server) -> None:
    done = 'data: {"text": "ok"}\n\ndata: [DONE]\n\n'
    ok = {"raw": done, "headers": {"content-type": "text/event-stream"}}
    script(server, {**UNAVAILABLE, "headers": {"Retry-After": "0.1"}}, ok)
    with HandoffClient(server.url, retry=RetryPolicy(max_attempts=3)) as client:
        assert list(client.stream_generate("hi")) == [{"text": "ok"}]
    script(server, {**UNAVAILABLE, "headers": {"Retry-After": "0.1"}}, ok)

    async def run() -> list[dict]:
        async with AsyncHandoffClient(server.url, retry=RetryPolicy(max_attempts=3)) as client:
            return [event async for event in client.stream_generate("hi")]
    assert asyncio.run(run()) == [{"text": "ok"}]


def test_a_control_call_waits_at_least_the_lbs_own_timeout() -> None:
    client = HandoffClient("http://127.0.0.1:1", timeout=3600)
    assert client._timeout_of(_Calls.resume(None, None, None)) == 3600  # the client's own, longer
    short = HandoffClient("http://127.0.0.1:1", timeout=1)
    assert short._timeout_of(_Calls.resume(None, None, None)) > DEFAULT_CONTROL_TIMEOUT_S  # what the LB may take
    assert short._timeout_of(_Calls.resume(None, None, 30)) == 40  # asked 30 s per node, plus the margin
    # a disk reload gets the LB's --weight-sync-timeout per node (600 s), not --control-timeout
    assert short._timeout_of(_Calls.update_weights("/ckpt", None, None, None)) > DEFAULT_WEIGHT_SYNC_TIMEOUT_S
    assert short._timeout_of(_Calls.update_weights("/ckpt", None, None, 30)) == 40
    client.close()
    short.close()


def _dribbled_head(conn: socket.socket) -> None:
    conn.sendall(b"HTTP/1.1 200 OK\r\nX-Slow: ")
    for _ in range(200):  # a byte every 50 ms: each read well within any per-read timeout, the head never ends
        conn.sendall(b"a")
        time.sleep(0.05)


def _not_gzip(conn: socket.socket) -> None:
    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Encoding: gzip\r\nContent-Length: 15\r\n\r\nnot gzip at all")


def test_the_calls_timeout_covers_a_dribbled_head(raw_server) -> None:
    """The deadline was checked per body chunk only: a head dribbled a byte at a time held a timeout=1 call for
    as long as the server liked (found by review)."""
    url = raw_server(_dribbled_head)
    for call in (lambda c: c.generate("x"), lambda c: next(iter(c.stream_generate("x")))):
        started = time.monotonic()
        with HandoffClient(url, timeout=1.0) as client:
            error = error_of(lambda: call(client))
        assert (error.status, error.type) == (0, "timeout") and time.monotonic() - started < 6  # not the 10 s

    async def run_async() -> tuple[HandoffError, HandoffError]:
        async with AsyncHandoffClient(url, timeout=1.0) as client:
            with pytest.raises(HandoffError) as whole:
                await client.generate("x")
            with pytest.raises(HandoffError) as stream:
                async for _ in client.stream_generate("x"):
                    pass
        return whole.value, stream.value

    started = time.monotonic()
    errors = asyncio.run(run_async())
    # two calls of 1 s; a head read without the call's timeout: 10 s each
    assert [e.type for e in errors] == ["timeout", "timeout"] and time.monotonic() - started < 8


def test_a_body_that_breaks_its_content_encoding_is_one_error(raw_server) -> None:
    url = raw_server(_not_gzip)
    with HandoffClient(url) as client:
        assert error_of(lambda: client.generate("x")).type == "invalid_response"
        assert error_of(client.release).type == "invalid_response"

    async def run_async() -> str:
        async with AsyncHandoffClient(url) as client:
            with pytest.raises(HandoffError) as info:
                await client.memory_occupation()
        return info.value.type

    assert asyncio.run(run_async()) == "invalid_response"


@pytest.mark.parametrize("answer", [{}, {"nodes": 5}, [1, 2]])
def test_a_nodes_answer_that_is_not_a_list_of_nodes_is_one_error(server, answer) -> None:
    """``{}`` raised KeyError; the others came back as if they were nodes (found by review)."""
    script(server, {"body": answer})
    with HandoffClient(server.url) as client:
        assert error_of(client.nodes).type == "invalid_response"


def test_tokens_urls_and_timeouts_are_checked_when_the_client_is_made() -> None:
    """A token read from a file keeps its newline: it is stripped as the services strip it; one that cannot be
    sent is a ValueError naming the parameter, never quoting the token (it was sent, and httpx's error quoted
    the header in the exception's text)."""
    client = HandoffClient("http://127.0.0.1:1", admin_token="s3cr3t\n", api_key=" key ")
    assert client._headers == {"admin": {"Authorization": "Bearer s3cr3t"}, "api": {"Authorization": "Bearer key"}}
    admin_only = HandoffClient("http://127.0.0.1:1", admin_token="adm")  # the admin token opens generation too
    assert admin_only._headers["api"] == {"Authorization": "Bearer adm"}
    for token in ("s3cr3t-tökén", "two words", "  "):
        with pytest.raises(ValueError, match="admin_token") as info:
            HandoffClient("http://127.0.0.1:1", admin_token=token)
        assert token.strip() not in str(info.value) or not token.strip()
    for url in ("lb:8000", "127.0.0.1:8000", "ftp://x", "http://", "http://h:99999"):
        with pytest.raises(ValueError, match="base_url"):
            HandoffClient(url)
    for timeout in (None, 0, -1, float("nan")):
        with pytest.raises(ValueError, match="timeout"):
            HandoffClient("http://127.0.0.1:1", timeout=timeout)
    client.close()
    admin_only.close()


def test_a_drain_timeout_sets_the_per_node_deadline_it_needs() -> None:
    """docs/rl-guide.md's loop calls release(drain_timeout=120) without timeout: the LB's default per-node 120 s
    cannot cover it, and it answered 400 (found by review). The LB now raises its own deadline for such a drain;
    the client sends no ?timeout= of its own (drain_timeout + 10 cut the LB's 120 s to 10 s for drain_timeout=0)
    and waits for the longer of the two."""
    call = _Calls.release(None, "wait", 120, None, None, None)
    assert call.params == {} and call.lb_default_timeout == 130.0
    zero = _Calls.release(None, "wait", 0, None, None, None)
    assert zero.params == {} and zero.lb_default_timeout == 120.0
    assert _Calls.release(None, "wait", 120, None, None, 300).params == {"timeout": 300}
    assert "timeout" not in _Calls.release(None, "wait", None, None, None, None).params


@pytest.mark.parametrize("timeout", [float("nan"), float("inf"), 1e300, 1e10, -5, 0])
def test_a_calls_timeout_out_of_bounds_is_refused_before_anything_is_sent(server, timeout: float) -> None:
    """Found by review: ``release(timeout=nan)`` sent the release and raised ``timeout`` at once (the call went on
    unseen); ``inf``, ``1e300`` and ``1e10`` raised ``OverflowError`` from Python's waits, the release sent too;
    ``-5`` and ``0`` went to the LB. The client's own ``timeout=1e10`` was taken and every call overflowed."""
    sent = len(received(server))
    with HandoffClient(server.url) as client:
        for call in (lambda: client.release(timeout=timeout), lambda: client.flush_cache(timeout=timeout)):
            with pytest.raises(ValueError, match="timeout"):
                call()

    async def run_async() -> None:
        async with AsyncHandoffClient(server.url) as client:
            with pytest.raises(ValueError, match="timeout"):
                await client.resume(timeout=timeout)
    asyncio.run(run_async())
    assert len(received(server)) == sent  # nothing reached the server
    for make in (HandoffClient, AsyncHandoffClient):
        with pytest.raises(ValueError, match="timeout"):
            make(server.url, timeout=timeout)
    with pytest.raises(ValueError, match="default_retry_after_s"):
        RetryPolicy(max_attempts=2, default_retry_after_s=timeout)


def test_a_week_long_timeout_still_works(server) -> None:
    with HandoffClient(server.url, timeout=MAX_SECONDS, retry=RetryPolicy(max_wait_s=MAX_SECONDS)) as client:
        assert client.memory_occupation() == {"ok": True}
        assert client.flush_cache(timeout=MAX_SECONDS).total == 1


def test_a_502_names_each_failed_node_and_why_in_its_message(server) -> None:
    """A 502's text said only "failed on 2/3 nodes": a traceback in a training log did not say which (found by
    review)."""
    failures = [{"node": "http://a:1", "role": "mixed", "reason": "connect_failed"},
                {"node": "http://b:2", "role": "mixed", "reason": "http_status", "status": 409, "detail": "x" * 5000},
                {"node": "http://c:3", "reason": "http_status", "status": 503,
                 "detail": json.dumps({"error": {"type": "engine_unavailable", "message": "down"}})},
                {"node": "http://d:4", "reason": "timeout", "error": "no answer within 5 s"}]
    script(server, {"status": 502, "body": {"message": "/flush_cache failed on 2/3 nodes", "total": 3, "failed": 2,
                                            "failures": failures}})
    with HandoffClient(server.url) as client:
        with pytest.raises(FanoutFailed) as info:
            client.flush_cache()
    text = str(info.value)
    assert "http://a:1 (connect_failed)" in text and "http://b:2 (409)" in text, text
    assert "http://c:3 (503 engine_unavailable)" in text and "http://d:4 (timeout: no answer within 5 s)" in text
    assert "xxxx" not in text and info.value.failed_nodes == ["http://a:1", "http://b:2", "http://c:3", "http://d:4"]
    many = [{"node": f"http://n{i}:1", "reason": "timeout"} for i in range(25)]
    script(server, {"status": 502, "body": {"message": "m", "failures": many}})
    with HandoffClient(server.url) as client:
        with pytest.raises(FanoutFailed) as info:
            client.flush_cache()
    assert "http://n9:1" in str(info.value) and "http://n10:1" not in str(info.value) and "15 more" in str(info.value)


def test_a_redirect_is_an_error_not_followed(server) -> None:
    """A redirect (a proxy in front of the LB) is not followed with the bearer token: it is the caller's error."""
    script(server, {"status": 307, "headers": {"Location": "http://127.0.0.1:9/elsewhere"}, "raw": ""})
    with HandoffClient(server.url, admin_token="adm") as client:
        error = error_of(client.release)
    assert error.status == 307 and error.type == "http_error"


OK_NODE = {"node": "http://a", "role": "mixed", "status": 200, "body": {"success": True}}
FAILED_IN_A_200 = {  # a 200 fan-out answer whose results do not all say the node succeeded
    "a node's 500": [OK_NODE, {"node": "http://b", "role": "mixed", "status": 500, "body": None}],
    "a node's success false": [OK_NODE, {"node": "http://b", "role": "mixed", "status": 200,
                                         "body": {"success": False, "message": "not released"}}],
    "a failure's reason": [OK_NODE, {"node": "http://b", "role": "mixed", "reason": "timeout", "error": "late"}],
    "no status": [OK_NODE, {"node": "http://b", "role": "mixed", "body": {}}],
}


@pytest.mark.parametrize("results", FAILED_IN_A_200.values(), ids=FAILED_IN_A_200.keys())
def test_a_200_that_lists_a_failed_node_is_never_a_success(server, results: list[dict]) -> None:
    """The LB answers 200 only when every node succeeded: a 200 listing a node that did not is refused, naming
    it, by both clients, rather than taken for the call's success."""
    answer = {"body": {"success": True, "total": len(results), "results": results}}
    script(server, answer)
    with HandoffClient(server.url) as client:
        error = error_of(client.release)
    assert error.type == "control_failed" and "http://b" in error.message and "http://a" not in error.message, error

    async def run() -> HandoffError:
        async with AsyncHandoffClient(server.url) as client:
            with pytest.raises(HandoffError) as info:
                await client.resume()
        return info.value
    script(server, answer)
    assert asyncio.run(run()).type == "control_failed"


@pytest.mark.parametrize("body", [{"success": True, "total": 3, "results": [OK_NODE]},
                                  {"success": True, "total": 0, "results": []}], ids=["total 3 of 1", "no node"])
def test_a_200_whose_results_do_not_cover_its_nodes_is_invalid(server, body: dict) -> None:
    """A result per node called, at least one: a release answered for no node, or for fewer nodes than it counts,
    released nothing that can be shown."""
    script(server, {"body": body})
    with HandoffClient(server.url) as client:
        assert error_of(client.release).type == "invalid_response"


@pytest.mark.parametrize(("event", "kind", "message"), [
    ({"error": "the engine died"}, "stream_error", "the engine died"),
    ({"error": {"type": 5, "message": {"nested": True}}}, "stream_error", "an error event"),
    ({"error": {"type": "invalid_request_error", "message": "bad"}}, "invalid_request_error", "bad"),
])
def test_a_streams_error_event_is_read_whatever_its_shape(server, event: dict, kind: str, message: str) -> None:
    """An error event's type and message are strings (a peer's other values are not carried as them), and a
    bare string is its message, never dropped."""
    script(server, {"raw": f"data: {json.dumps(event)}\n\ndata: [DONE]\n\n",
                    "headers": {"Content-Type": "text/event-stream"}})
    with HandoffClient(server.url) as client:
        error = error_of(lambda: list(client.stream_generate("x")))
    assert (error.type, error.message) == (kind, message)


def test_an_event_whose_error_is_null_is_no_error(server) -> None:
    """``"error": null`` beside the text is a normal event, as the openai client reads it (``data.get("error")``)."""
    event = {"text": "ok", "error": None, "meta_info": {"id": "a"}}
    script(server, {"raw": f"data: {json.dumps(event)}\n\ndata: [DONE]\n\n",
                    "headers": {"Content-Type": "text/event-stream"}})
    with HandoffClient(server.url) as client:
        assert [e["text"] for e in client.stream_generate("x")] == ["ok"]


def test_an_error_envelopes_odd_fields_are_not_carried_as_text(server) -> None:
    script(server, {"status": 500, "body": {"error": {"type": {"x": 1}, "message": None}}})
    with HandoffClient(server.url) as client:
        error = error_of(lambda: client.generate("x"))
    assert (error.status, error.type, error.message) == (500, "http_error", "HTTP 500")
