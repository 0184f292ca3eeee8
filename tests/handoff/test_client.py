"""HandoffClient against a scripted server: typed errors, the retry policy, tokens, both clients."""

from __future__ import annotations

import time

import pytest

from handoff.client import (AsyncHandoffClient, FanoutFailed, HandoffClient, HandoffError, RetryPolicy,
                            ServiceUnavailable)
from tests.handoff.scripted import UNAVAILABLE, received, script

FANOUT_OK = {"success": True, "total": 2, "results": [
    {"node": "http://a", "role": "mixed", "status": 200, "body": {"released": ["kv_cache"]}},
    {"node": "http://b", "role": "mixed", "status": 200, "body": {"released": []}}]}
FANOUT_502 = {"success": False, "message": "/release_memory_occupation failed on 1/2 nodes", "total": 2,
              "failed": 1, "failures": [{"node": "http://a", "role": "mixed", "error": "connect_failed"}],
              "succeeded": [{"node": "http://b", "role": "mixed", "status": 200, "body": {"released": ["weights"]}}]}


def test_fanout_results_and_failures(server) -> None:
    with HandoffClient(server.url, admin_token="adm", api_key="gen") as client:
        script(server, {"body": FANOUT_OK})
        result = client.release(tags=["kv_cache"], mode="abort", role="mixed", timeout=7)
        assert result.total == 2 and result.bodies()["http://a"] == {"released": ["kv_cache"]}
        last = received(server)[-1]
        assert last["path"] == "/release_memory_occupation" and "role=mixed" in last["query"]
        assert "timeout=7" in last["query"] and last["headers"]["authorization"] == "Bearer adm"
        script(server, {"status": 502, "body": FANOUT_502})
        with pytest.raises(FanoutFailed) as info:
            client.resume()
        exc = info.value
        assert exc.failed_nodes == ["http://a"] and exc.succeeded[0].node == "http://b" and exc.failed == 1
        script(server, {"body": {"text": "ok"}})
        client.generate("hi")
        assert received(server)[-1]["headers"]["authorization"] == "Bearer gen"


def test_errors_carry_status_and_type(server) -> None:
    script(server, {"status": 400, "body": {"error": {"type": "invalid_request", "message": "bad tags"}}})
    with HandoffClient(server.url) as client:
        with pytest.raises(HandoffError) as info:
            client.release(tags=["x"])
    assert info.value.status == 400 and info.value.type == "invalid_request" and "bad tags" in str(info.value)


def test_503_is_retried_only_as_the_policy_allows(server) -> None:
    with HandoffClient(server.url) as client:
        script(server, UNAVAILABLE)
        with pytest.raises(ServiceUnavailable) as info:
            client.generate("hi")  # the default policy retries nothing
        assert info.value.retry_after == 1.0
    policy = RetryPolicy(max_attempts=3, max_wait_s=5)
    with HandoffClient(server.url, retry=policy) as client:
        script(server, UNAVAILABLE, UNAVAILABLE, {"body": {"text": "finally"}})
        started = time.monotonic()
        assert client.generate("hi") == {"text": "finally"}
        assert 1.9 < time.monotonic() - started < 5  # waited Retry-After twice
        script(server, UNAVAILABLE, UNAVAILABLE, UNAVAILABLE, {"body": {"text": "too late"}})
        with pytest.raises(ServiceUnavailable):
            client.generate("hi")  # three attempts, all refused
    # Retry-After 10 s, a budget of 5 s: seconds apart, so the time taken tells "no wait" from "waited out the
    # budget" on a busy machine too (at 1 s and 0.5 s, one call had half a second)
    with HandoffClient(server.url, retry=RetryPolicy(max_attempts=5, max_wait_s=5)) as client:
        script(server, {**UNAVAILABLE, "headers": {"Retry-After": "10"}}, {"body": {}})
        num_received = len(received(server))
        started = time.monotonic()
        with pytest.raises(ServiceUnavailable):
            client.generate("hi")  # Retry-After is beyond the budget: no wait at all, no second attempt
        assert time.monotonic() - started < 5
        assert len(received(server)) == num_received + 1


async def test_async_client_same_contract(server) -> None:
    async with AsyncHandoffClient(server.url, admin_token="adm", retry=RetryPolicy(max_attempts=2)) as client:
        script(server, {"status": 502, "body": FANOUT_502})
        with pytest.raises(FanoutFailed):
            await client.release()
        script(server, UNAVAILABLE, {"body": FANOUT_OK})
        assert (await client.flush_cache()).total == 2
        assert received(server)[-1]["path"] == "/flush_cache"


def test_retry_policy_validates() -> None:
    with pytest.raises(ValueError, match="max_attempts"):
        RetryPolicy(max_attempts=0)


# Event text as the engine writes it (``ensure_ascii=False``): characters str.splitlines (and httpx's
# iter_lines) would cut a line at, though SSE lines end only at CR and LF.
ODD_TEXT = "a\u2028b\x85c\u2029d"  # as json.dumps(..., ensure_ascii=False) leaves them
STREAM = ('data: {"text": "' + ODD_TEXT + '", "output_ids": [1]}\r\n\r\n'
          'data:{"text": "no space after the colon", "output_ids": [2]}\n\n'
          'data: [DONE]\n\n')
SSE = {"Content-Type": "text/event-stream"}


def test_streams_split_lines_only_where_sse_does(server) -> None:
    with HandoffClient(server.url) as client:
        script(server, {"raw": STREAM, "headers": SSE})
        events = list(client.stream_generate("hi"))
    assert [e["text"] for e in events] == [ODD_TEXT, "no space after the colon"]


async def test_async_streams_split_lines_only_where_sse_does(server) -> None:
    async with AsyncHandoffClient(server.url) as client:
        script(server, {"raw": STREAM, "headers": SSE})
        events = [e async for e in client.stream_generate("hi")]
    assert [e["text"] for e in events] == [ODD_TEXT, "no space after the colon"]


@pytest.mark.parametrize("cut", ["no [DONE]", "mid-event"])
def test_a_stream_that_ends_without_done_raises(server, cut: str) -> None:
    body = STREAM.split("data: [DONE]")[0] if cut == "no [DONE]" else STREAM[:40]
    with HandoffClient(server.url) as client:
        script(server, {"raw": body, "headers": SSE})
        with pytest.raises(HandoffError) as info:
            list(client.stream_generate("hi"))
    assert info.value.type == "incomplete_stream"


@pytest.mark.parametrize("event", ["data: {not json\n\n", 'data: {"x": NaN}\n\n', "data: " + "[" * 100 + "\n\n"])
def test_an_event_that_is_not_json_is_one_clear_error(server, event: str) -> None:
    with HandoffClient(server.url) as client:
        script(server, {"raw": event + "data: [DONE]\n\n", "headers": SSE})
        with pytest.raises(HandoffError) as info:
            list(client.stream_generate("hi"))
    assert info.value.type == "invalid_stream"


@pytest.mark.parametrize("header", ["Wed, 21 Oct 2026 07:28:00 GMT", "soon", "-5", "nan"])
def test_a_retry_after_that_is_not_seconds_is_no_hint(server, header: str) -> None:
    with HandoffClient(server.url) as client:
        script(server, {**UNAVAILABLE, "headers": {"Retry-After": header}})
        with pytest.raises(ServiceUnavailable) as info:
            client.generate("hi")
    assert info.value.retry_after is None
