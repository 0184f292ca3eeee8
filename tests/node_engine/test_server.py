"""The engine's HTTP API against a real engine process on loopback (builtin:tiny, CPU)."""

from __future__ import annotations

import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from node_engine.tokenizer import Tokenizer
from tests.support.procs import wait_until
from tests.support.sse import read_stream

GREEDY = {"temperature": 0, "ignore_eos": True}
TOKENIZER = Tokenizer.builtin_bytes()


@pytest.fixture(scope="module")
def engine(tiny_engine):
    return tiny_engine


@pytest.fixture
def client(engine):
    with httpx.Client(base_url=engine.url, timeout=30) as c:
        yield c


def metric(client: httpx.Client, name: str) -> float:
    text = client.get("/metrics").text
    match = re.search(rf"^{re.escape(name)} ([0-9.e+-]+)$", text, re.M)
    assert match, f"{name} not in /metrics"
    return float(match.group(1))


def slots_held_by_requests(client: httpx.Client) -> float:
    """KV slots in use minus those the prefix cache keeps for reuse."""
    return metric(client, "handoff_engine_kv_slots_used") - metric(client, "handoff_engine_cached_tokens")


def gen(client: httpx.Client, body: dict) -> dict:
    r = client.post("/generate", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def test_batch_gives_the_same_tokens_as_each_prompt_alone(client) -> None:
    prompts = ["The quick brown fox", "Hello", "A much longer prompt that spans more tokens than the others do"]
    for params in (dict(GREEDY, max_new_tokens=24), {"temperature": 0.9, "top_p": 0.9, "seed": 11,
                                                      "max_new_tokens": 24, "ignore_eos": True}):
        batch = gen(client, {"text": prompts, "sampling_params": params})
        alone = [gen(client, {"text": p, "sampling_params": params}) for p in prompts]
        assert [b["output_ids"] for b in batch] == [a["output_ids"] for a in alone]
        assert all(len(b["output_ids"]) == 24 for b in batch)


def test_concurrent_requests_match_sequential_ones(client) -> None:
    bodies = [{"input_ids": [256] + list(range(i, i + 5 + i)), "sampling_params": dict(GREEDY, max_new_tokens=16)}
              for i in range(1, 9)]
    sequential = [gen(client, b)["output_ids"] for b in bodies]
    with ThreadPoolExecutor(8) as pool:
        concurrent = list(pool.map(lambda b: gen(client, b)["output_ids"], bodies))
    assert concurrent == sequential


def test_stream_events_are_cumulative_and_end_with_the_non_stream_answer(client) -> None:
    """SGLang's default stream: each event carries the whole answer so far."""
    body = {"text": "Once upon a time", "sampling_params": dict(GREEDY, max_new_tokens=40)}
    whole = gen(client, body)
    events, saw_done = read_stream(client, "/generate", {**body, "stream": True})
    assert saw_done and len(events) > 2
    for before, after in zip(events, events[1:]):
        assert after["text"].startswith(before["text"])
        assert after["output_ids"][:len(before["output_ids"])] == before["output_ids"]
        assert len(after["output_ids"]) == after["meta_info"]["completion_tokens"]
    assert events[-1]["text"] == whole["text"] and events[-1]["output_ids"] == whole["output_ids"]
    assert events[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 40}
    assert all(e["meta_info"]["finish_reason"] is None for e in events[:-1])
    assert "e2e_latency" in events[-1]["meta_info"] and "e2e_latency" not in events[0]["meta_info"]


def test_answer_meta_info_has_sglang_fields(client) -> None:
    answer = gen(client, {"text": "shape", "rid": "shape-1", "sampling_params": dict(GREEDY, max_new_tokens=3)})
    meta = answer["meta_info"]
    assert {"id", "finish_reason", "prompt_tokens", "completion_tokens", "cached_tokens", "weight_version",
            "e2e_latency", "num_retractions"} <= set(meta)
    assert meta["id"] == "shape-1" and meta["finish_reason"]["type"] == "length"
    again = gen(client, {"text": "shape", "sampling_params": dict(GREEDY, max_new_tokens=3)})
    assert again["meta_info"]["cached_tokens"] > 0  # the same prompt: its prefix came from the cache


def test_batch_stream_carries_indices(client) -> None:
    events, saw_done = read_stream(client, "/generate", {"text": ["a", "b"], "stream": True,
                                                          "sampling_params": dict(GREEDY, max_new_tokens=5)})
    assert saw_done and {e["index"] for e in events} == {0, 1}
    assert sum(1 for e in events if e["meta_info"]["finish_reason"]) == 2
    for index in (0, 1):
        last = [e for e in events if e["index"] == index][-1]
        assert len(last["output_ids"]) == 5


def test_same_seed_same_output_different_seed_differs(client) -> None:
    def sampled(seed: int) -> list[int]:
        params = {"temperature": 1.0, "seed": seed, "max_new_tokens": 32, "ignore_eos": True}
        return gen(client, {"text": "seeded", "sampling_params": params})["output_ids"]
    assert sampled(5) == sampled(5)
    assert sampled(5) != sampled(6)


def test_stop_string_and_stop_token(client) -> None:
    plain = {"temperature": 0, "max_new_tokens": 30}
    free = gen(client, {"text": "x", "sampling_params": plain})
    ids = free["output_ids"]
    stop_id = ids[min(5, len(ids) - 1)]
    cut = gen(client, {"text": "x", "sampling_params": dict(plain, stop_token_ids=[stop_id])})
    end = ids.index(stop_id)
    assert cut["output_ids"] == ids[:end + 1]  # the stop token is in output_ids, its text is not in text
    assert cut["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_id}
    assert cut["text"] == TOKENIZER.decode(ids[:end])
    kept = gen(client, {"text": "x", "sampling_params": dict(plain, stop_token_ids=[stop_id], no_stop_trim=True)})
    assert kept["text"] == TOKENIZER.decode(ids[:end + 1])
    ignoring = gen(client, {"text": "x", "sampling_params": dict(GREEDY, max_new_tokens=30, stop_token_ids=[stop_id])})
    assert len(ignoring["output_ids"]) == 30  # ignore_eos ignores stop_token_ids too, as in SGLang
    text = free["text"]
    stop = next((text[i:i + 2] for i in range(3, len(text) - 2) if text[i:i + 2].isprintable()), None)
    if stop:
        s = gen(client, {"text": "x", "sampling_params": dict(GREEDY, max_new_tokens=30, stop=stop)})
        assert s["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop} and stop not in s["text"]
        assert text.startswith(s["text"])


def test_abort_ends_the_stream_and_frees_slots(client, engine) -> None:
    events: list[dict] = []
    done = threading.Event()

    def run() -> None:
        with httpx.Client(base_url=engine.url, timeout=30) as c:
            evs, saw_done = read_stream(c, "/generate", {"text": "long", "stream": True, "rid": "to-abort",
                                                         "sampling_params": dict(GREEDY, max_new_tokens=3000)})
            events.extend(evs)
            assert saw_done
        done.set()

    t = threading.Thread(target=run)
    t.start()
    wait_until(lambda: metric(client, "handoff_engine_running_requests") == 1, timeout=10)
    r = client.post("/abort_request", json={"rid": "to-abort"})
    assert r.status_code == 200
    assert done.wait(10)
    t.join(10)
    assert events[-1]["meta_info"]["finish_reason"] == {"type": "abort", "message": "Aborted", "status_code": None,
                                                        "err_type": None}
    assert 0 < len(events[-1]["output_ids"]) < 3000
    wait_until(lambda: slots_held_by_requests(client) == 0, timeout=5)
    # SGLang's semantics: a rid that already finished (or never existed) is a no-op, not an error
    again = client.post("/abort_request", json={"rid": "to-abort"})
    assert again.status_code == 200 and again.json()["aborted"] == []
    assert client.post("/abort_request", json={"rid": "", "abort_all": False}).json()["aborted"] == []


def test_a_request_id_in_flight_is_refused_to_another_client(client, engine) -> None:
    """A second request under the id of one still running is 400 (SGLang refuses a duplicate id too): else the
    second client's abort by that id ended the first client's request. Once it ends, the id is free."""
    events: list[dict] = []
    done = threading.Event()

    def run() -> None:
        with httpx.Client(base_url=engine.url, timeout=30) as c:
            events.extend(read_stream(c, "/generate", {"text": "long", "stream": True, "rid": "job-1",
                                                       "sampling_params": dict(GREEDY, max_new_tokens=3000)})[0])
        done.set()

    thread = threading.Thread(target=run)
    thread.start()
    wait_until(lambda: metric(client, "handoff_engine_running_requests") == 1, timeout=10)
    second = client.post("/generate", json={"text": "x", "rid": "job-1", "sampling_params": {"max_new_tokens": 2}})
    assert second.status_code == 400 and "Duplicate request ID" in second.json()["error"]["message"], second.text
    batch = client.post("/generate", json={"text": ["a", "b"], "rid": ["other", "job-1"],
                                           "sampling_params": {"max_new_tokens": 2}})
    assert batch.status_code == 400  # nothing of the batch ran: "other" is free again at once
    assert client.post("/abort_request", json={"rid": "job-1"}).status_code == 200
    assert done.wait(10)
    thread.join(10)
    assert events[-1]["meta_info"]["finish_reason"]["type"] == "abort"
    again = client.post("/generate", json={"text": "x", "rid": "job-1", "sampling_params": {"max_new_tokens": 2}})
    assert again.status_code == 200, again.text
    assert client.post("/generate", json={"text": "x", "rid": "other",
                                          "sampling_params": {"max_new_tokens": 2}}).status_code == 200


def peak_rss_bytes(pid: int) -> int:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM in /proc")


def test_a_long_prompt_times_n_is_refused_before_it_is_copied(client, engine) -> None:
    """200,000 ids with n=128: each sample copied the prompt (twice) before the length check, so a 2 MB body
    grew the engine by gigabytes and held its event loop for seconds. One shared list, the length checked first."""
    before = peak_rss_bytes(engine.pid)
    r = client.post("/generate", json={"input_ids": [0] * 200_000, "sampling_params": {"n": 128, "max_new_tokens": 1}})
    assert r.status_code == 400 and "context length" in r.json()["error"]["message"], r.text
    assert peak_rss_bytes(engine.pid) - before < 256 * 1024 * 1024


@pytest.mark.parametrize("message", [
    {"role": "user", "content": "x" * 3_000_000},
    {"role": "tool", "content": "hi", "tool_call_id": "t" * 3_000_000},  # any field the template may render
    {"role": "system", "content": "hi", "name": "n" * 3_000_000},  # a user message's name is dropped unread
])
def test_a_chat_too_long_for_the_context_is_refused_before_it_is_rendered(client, message: dict) -> None:
    """Only the contents were measured: a 3 MB role went through the template and the tokenizer (a 30 MB one
    took 47 s of the engine's CPU and 4.7 GB before its 400)."""
    r = client.post("/v1/chat/completions", json={"messages": [message], "max_tokens": 1})
    assert r.status_code == 400 and "can never fit the context" in r.json()["error"]["message"], r.text[:300]


def test_logprobs_past_the_entry_limit_are_refused_and_within_it_answered(client) -> None:
    """2000 prompt positions x (1 + 64 top + 256 ids) x 8 samples: 5 million entries, a 3 KB request that made
    a 157 MB answer (built on the event loop). Past 4 million entries it is a 400 naming the knobs."""
    body = {"input_ids": [1] * 2000, "return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": 64,
            "token_ids_logprob": list(range(256)), "sampling_params": {"n": 8, "max_new_tokens": 8}}
    r = client.post("/generate", json=body)
    assert r.status_code == 400 and "entries" in r.json()["error"]["message"], r.text[:300]
    small = client.post("/generate", json={**body, "top_logprobs_num": 2, "token_ids_logprob": [1, 2],
                                           "sampling_params": {"n": 2, "max_new_tokens": 4}})
    assert small.status_code == 200, small.text[:300]
    answer = small.json()[0]["meta_info"]
    assert len(answer["input_token_logprobs"]) == 2000 and len(answer["output_top_logprobs"][0]) == 2


def test_client_disconnect_aborts_the_request(client, engine) -> None:
    before = metric(client, 'handoff_engine_requests_total{finish_reason="abort"}') if "abort" in client.get(
        "/metrics").text else 0.0
    with httpx.Client(base_url=engine.url, timeout=30) as c:
        with c.stream("POST", "/generate", json={"text": "bye", "stream": True,
                                                  "sampling_params": dict(GREEDY, max_new_tokens=3000)}) as r:
            next(r.iter_bytes())  # the stream started; now walk away
    wait_until(lambda: metric(client, "handoff_engine_running_requests") == 0, timeout=10)
    wait_until(lambda: slots_held_by_requests(client) == 0, timeout=5)
    after = metric(client, 'handoff_engine_requests_total{finish_reason="abort"}')
    assert after == before + 1
    # a non-streaming request whose client leaves is aborted too
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(engine.url + "/generate", json={"text": "bye", "sampling_params": dict(GREEDY, max_new_tokens=3000)},
                   timeout=0.5)
    wait_until(lambda: metric(client, 'handoff_engine_requests_total{finish_reason="abort"}') == before + 2,
               timeout=10)
    wait_until(lambda: slots_held_by_requests(client) == 0, timeout=5)


def test_late_request_joins_without_waiting_for_the_batch(client, engine) -> None:
    """Continuous batching: a request arriving mid-batch gets its first token within a few steps. (Eight requests
    of 400 tokens: the engine admits one only if its whole length fits in the 4096-token pool beside the others',
    as SGLang reserves them.)"""
    finished_at: list[float] = []

    def long_request(i: int) -> None:
        with httpx.Client(base_url=engine.url, timeout=60) as c:
            gen(c, {"input_ids": [256, 65 + i], "sampling_params": dict(GREEDY, max_new_tokens=400)})
        finished_at.append(time.monotonic())

    with ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(long_request, i) for i in range(8)]
        wait_until(lambda: metric(client, "handoff_engine_running_requests") == 8, timeout=10)
        tokens_before = metric(client, "handoff_engine_generated_tokens_total")
        wait_until(lambda: metric(client, "handoff_engine_generated_tokens_total") > tokens_before + 400, timeout=30)
        arrived = time.monotonic()
        events, _ = read_stream(client, "/generate", {"text": "late", "stream": True,
                                                       "sampling_params": dict(GREEDY, max_new_tokens=4)})
        ttft = time.monotonic() - arrived  # upper bound: the whole (4-token) late request
        for f in futures:
            f.result(60)
    remaining = max(finished_at) - arrived
    assert events and remaining > 0.3, f"the batch ended too soon to judge ({remaining:.2f}s)"
    assert ttft < remaining / 4, f"late request took {ttft:.3f}s while the batch ran {remaining:.3f}s more"


@pytest.mark.parametrize("body,fragment", [
    ({"text": ""}, "empty"),
    ({"text": 5}, "text"),
    ({"input_ids": []}, "empty"),
    ({"input_ids": [1, 2, 999999]}, "out of range"),
    ({"input_ids": [1, "a"]}, "input_ids"),
    ({"text": "x", "input_ids": [1]}, "exactly one"),
    ({}, "exactly one"),
    ({"text": "x", "sampling_params": {"max_new_tokens": -1}}, "max_new_tokens"),
    ({"text": "x", "sampling_params": {"max_new_tokens": 10**9}}, "exceeds"),
    ({"text": "x", "sampling_params": {"max_new_tokens": "5"}}, "max_new_tokens"),
    ({"text": "x", "sampling_params": {"temperature": -1}}, "temperature"),
    ({"text": "x", "sampling_params": {"top_p": 0}}, "top_p"),
    ({"text": "x", "sampling_params": {"temprature": 1}}, "unknown field"),
    ({"text": "x", "sampling_params": {"frequency_penalty": 3}}, "frequency_penalty"),
    ({"text": "x", "surprise": 1, "sampling_params": {"surprise": 1}}, "unknown field"),
    ({"text": "x" * 5000}, "context length"),
    ({"text": "x", "sampling_params": {"stop_token_ids": [10**7]}}, "stop_token_ids"),
    ({"text": ["a", ""]}, "empty"),
])
def test_bad_input_is_a_400_and_the_engine_keeps_serving(client, body: dict, fragment: str) -> None:
    r = client.post("/generate", json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request" and fragment in error["message"]
    assert gen(client, {"text": "ok", "sampling_params": dict(GREEDY, max_new_tokens=2)})["output_ids"]


@pytest.mark.parametrize("raw", [b"{", b"[1,2]", b"\xff\xfe", b"[" * 100000 + b"]" * 100000, b"null"])
def test_malformed_bodies_are_400(client, raw: bytes) -> None:
    r = client.post("/generate", content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request"


def test_oversized_body_is_413(engine) -> None:
    r = httpx.post(engine.url + "/generate", content=b"x" * (65 * 1024 * 1024), timeout=30)
    assert r.status_code == 413 and r.json()["error"]["type"] == "payload_too_large"


def test_openai_completions_and_chat(client) -> None:
    r = client.post("/v1/completions", json={"prompt": ["hi", "there"], "max_tokens": 5, "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "text_completion" and len(body["choices"]) == 2
    assert body["usage"]["completion_tokens"] <= 10 and body["metadata"]["weight_version"] == "default"
    events, saw_done = read_stream(client, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "hello"}], "max_tokens": 6, "temperature": 0, "stream": True,
        "stream_options": {"include_usage": True}})
    assert saw_done and events[0]["choices"][0]["delta"]["role"] == "assistant"
    assert {e["object"] for e in events} == {"chat.completion.chunk"}
    assert events[-1]["usage"]["completion_tokens"] <= 6
    chat = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hello"}],
                                                     "max_tokens": 6, "temperature": 0}).json()
    streamed = "".join(e["choices"][0]["delta"].get("content", "") for e in events if e["choices"])
    assert chat["choices"][0]["message"]["content"] == streamed
    tools = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}], "tools": [
        {"type": "function", "function": {"name": "f"}}], "tool_choice": "required"})
    assert tools.status_code == 400 and tools.json()["error"]["type"] == "unsupported"  # needs constrained decoding
    formatted = client.post("/v1/completions", json={"prompt": "x", "response_format": {"type": "json_object"}})
    assert formatted.status_code == 400 and formatted.json()["error"]["type"] == "unsupported"
    other = client.post("/v1/completions", json={"prompt": "x", "model": "other", "max_tokens": 1})
    assert other.status_code == 200 and other.json()["model"] == "other"  # SGLang takes any name and repeats it
    models = client.get("/v1/models").json()
    assert models["data"][0]["id"] == "builtin:tiny"
    assert client.get("/v1/models/builtin:tiny").json()["id"] == "builtin:tiny"
    assert client.get("/v1/models/other").status_code == 404
    info = client.get("/get_model_info").json()
    assert info["served_model_name"] == "builtin:tiny" and info["is_generation"] is True


def test_info_health_metrics_and_openapi(client) -> None:
    info = client.get("/get_server_info").json()
    assert info["model_path"] == "builtin:tiny" and info["max_total_tokens"] == 4096
    # SGLang 0.5.23's scheduler fields (``get_init_info``, merged into its /get_server_info), which clients read
    # for the pool's size and the longest prompt: the pool, and the smaller of context and pool less 6
    assert info["max_total_num_tokens"] == 4096
    assert info["max_req_input_len"] == min(info["context_length"] - 1, 4096 - 1) - 5
    assert client.get("/health").json() == {"status": "ok"}
    text = client.get("/metrics").text
    for name in ("handoff_engine_requests_total", "handoff_engine_generated_tokens_total",
                 "handoff_engine_running_requests", "handoff_engine_queued_requests", "handoff_engine_kv_slots_used"):
        assert name in text
    for name in ("handoff_engine_release_seconds", "handoff_engine_resume_seconds"):  # moving weights takes minutes
        assert f'{name}_bucket{{le="120.0"}}' in text, f"{name} has no bucket past 10 s"
    schema = client.get("/openapi.json").json()
    assert "/generate" in schema["paths"] and "GenerateBody" in schema["components"]["schemas"]
    assert client.get("/nope").json()["error"]["type"] == "not_found"
