"""The OpenAI routes where SGLang 0.5.23's behaviour is easy to miss, on a real engine process: a chat without a
token limit, tool-call history, content parts, SGLang's own fields, ``model``, roles, seeds, long id prompts.

The engine serves a small Llama checkpoint whose chat template renders tool-call arguments with ``tojson`` and
reads ``enable_thinking``; its tokenizer is byte-level, so a prompt's token count is its rendered length.
"""

from __future__ import annotations

from typing import Any, Iterator

import httpx
import openai
import pytest

from tests.node_engine.checkpoints import templated_engine
from tests.support.procs import ServerProcess
from tests.support.sse import read_stream

pytestmark = pytest.mark.timeout(120)

CONTEXT = 96
TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{% if m.tool_calls %}"
            "{{ m.tool_calls[0].function.arguments | tojson }}{% endif %}{{ m['content'] }}{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}{% if enable_thinking %}<think>{% endif %}")
USER = {"role": "user", "content": "hi"}


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    proc = templated_engine(tmp_path_factory.mktemp("templated"), TEMPLATE, CONTEXT,
                            generation_config={"top_k": 1, "max_length": 4096})  # chat's default
    yield proc
    proc.stop()


@pytest.fixture
def client(engine: ServerProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=engine.url, timeout=60) as c:
        yield c


def chat(client: httpx.Client, **body: Any) -> dict[str, Any]:
    r = client.post("/v1/chat/completions", json={"messages": [USER], "max_tokens": 1, **body})
    assert r.status_code == 200, r.text
    return r.json()


def test_a_chat_without_a_limit_fills_the_context_as_sglang_does(engine: ServerProcess) -> None:
    """SGLang passes no max_new_tokens for a chat without one, not 128: its scheduler cuts it to ``max_req_len -
    prompt - 1`` with ``max_req_len`` the context less one (scheduler.py:2709-2716, tp_worker.py:568-571)."""
    with openai.OpenAI(base_url=engine.url + "/v1", api_key="unused", timeout=60) as client:
        answer = client.chat.completions.create(model="any-name", messages=[USER], temperature=0,
                                                extra_body={"ignore_eos": True})
    assert answer.model == "any-name"  # SGLang takes any model name and repeats it
    assert answer.choices[0].finish_reason == "length"
    assert answer.usage.completion_tokens == CONTEXT - answer.usage.prompt_tokens - 2


def test_max_completion_tokens_or_max_tokens(client: httpx.Client) -> None:
    answer = chat(client, max_completion_tokens=0, max_tokens=3, ignore_eos=True)  # SGLang's `or`
    assert answer["usage"]["completion_tokens"] == 3


def test_tool_call_arguments_reach_the_template_as_an_object(client: httpx.Client) -> None:
    def prompt_tokens(arguments: object) -> int:
        call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": arguments}}
        messages = [USER, {"role": "assistant", "content": "", "tool_calls": [call]},
                    {"role": "tool", "content": "2", "tool_call_id": "c1"}]
        return chat(client, messages=messages)["usage"]["prompt_tokens"]

    as_object = prompt_tokens({"a": 1})
    assert prompt_tokens('{"a": 1}') == as_object  # not the string's JSON (4 more characters of quoting)
    for bad, why in (("not json", "must be valid JSON"), ("[1]", "must be a JSON object")):
        messages = [USER, {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": bad}}]}]
        r = client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 1})
        assert r.status_code == 400 and why in r.json()["error"]["message"], r.text


def test_a_tool_call_the_template_cannot_render_is_a_400(client: httpx.Client) -> None:
    messages = [USER, {"role": "assistant", "content": "", "tool_calls": "abc"}]
    r = client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 1})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request", r.text


def test_text_parts_are_joined_with_spaces_for_a_string_template(client: httpx.Client) -> None:
    parts = [{"type": "text", "text": "Hello"}, {"type": "text", "text": "world"}]
    joined = chat(client, messages=[{"role": "user", "content": parts}])["usage"]["prompt_tokens"]
    assert joined == chat(client, messages=[{"role": "user", "content": "Hello world"}])["usage"]["prompt_tokens"]


def test_chat_template_kwargs_and_token_ids(client: httpx.Client) -> None:
    plain = chat(client)
    thinking = chat(client, chat_template_kwargs={"enable_thinking": True}, return_token_ids=True)
    assert thinking["usage"]["prompt_tokens"] == plain["usage"]["prompt_tokens"] + len("<think>")
    choice = thinking["choices"][0]
    assert len(choice["prompt_token_ids"]) == thinking["usage"]["prompt_tokens"]
    assert len(choice["response_token_ids"]) == 1
    clash = client.post("/v1/chat/completions", json={"messages": [USER], "chat_template_kwargs": {"messages": []}})
    assert clash.status_code == 400 and "may not set 'messages'" in clash.json()["error"]["message"]
    streamed = client.post("/v1/chat/completions", json={"messages": [USER], "stream": True, "return_token_ids": True})
    assert streamed.status_code == 400 and "not supported with streaming" in streamed.json()["error"]["message"]


def test_sglang_fields_are_taken_or_refused_by_name(client: httpx.Client) -> None:
    accepted = {"priority": 1, "extra_key": "k", "cache_salt": "s", "session_id": None, "data_parallel_rank": 0,
                "separate_reasoning": False, "custom_params": {"x": 1}, "user": "u", "return_meta_info": False,
                "continue_final_message": False, "reasoning_effort": None}
    assert chat(client, **accepted)["choices"][0]["finish_reason"] in ("length", "stop")
    for field, value in (("return_meta_info", True), ("data_parallel_rank", 1), ("return_routed_experts", True)):
        r = client.post("/v1/chat/completions", json={"messages": [USER], field: value})
        assert r.status_code == 400 and r.json()["error"]["type"] == "unsupported", (field, r.text)
        assert field in r.json()["error"]["message"]


@pytest.mark.parametrize("message", [{"role": "User", "content": "hi"}, {"role": "foo", "content": "hi"},
                                     {"role": "user", "content": None}])
def test_roles_and_user_content_are_checked_as_sglang_does(client: httpx.Client, message: dict) -> None:
    r = client.post("/v1/chat/completions", json={"messages": [message], "max_tokens": 1})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request", r.text
    assert chat(client, messages=[{"role": "SYSTEM", "content": "s"}, USER])["usage"]["prompt_tokens"] > 0


def test_completions_limits_seeds_and_long_id_prompts(client: httpx.Client) -> None:
    for max_tokens in (0, None):
        r = client.post("/v1/completions", json={"prompt": "x", "max_tokens": max_tokens})
        assert r.status_code == 400, r.text
    for seed in (2**64, -(2**63) - 1):
        r = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 1, "seed": seed})
        assert r.status_code == 400 and "sampling_seed" in r.json()["error"]["message"], r.text
    r = client.post("/v1/completions", json={"prompt": [97] * 200_000, "max_tokens": 1})
    assert r.status_code == 400 and "longer than the model's context length" in r.text, r.text  # before parsing
    # SGLang's rule (tokenizer_manager): a prompt of the context's length is refused whatever max_new_tokens says
    for sampling in ({"max_new_tokens": 0}, {}):
        r = client.post("/generate", json={"input_ids": [97] * CONTEXT, "sampling_params": sampling})
        assert r.status_code == 400 and "longer than the model's context length" in r.text, r.text
    # within the context, but at max_req_input_len (context - 6) or longer: SGLang's scheduler refuses it
    r = client.post("/generate", json={"input_ids": [97] * (CONTEXT - 1), "sampling_params": {"max_new_tokens": 1}})
    assert r.status_code == 400 and "Input length (95 tokens) exceeds" in r.text, r.text
    ids = client.post("/v1/completions", json={"prompt": [97, 98], "max_tokens": 2, "return_token_ids": True,
                                               "ignore_eos": True, "stream": True})
    events = [line for line in ids.text.splitlines() if line.startswith("data: {")]
    assert '"prompt_token_ids": [97, 98]' in events[0].replace(",", ", ").replace(",  ", ", ")
    assert sum(event.count('"token_ids"') for event in events) == len(events)


def test_a_chat_stream_ends_each_choice_with_a_finish_chunk_as_sglang_does(client: httpx.Client) -> None:
    """SGLang's content chunks carry no finish reason; a chunk with an empty delta per choice carries it."""
    events, saw_done = read_stream(client, "/v1/chat/completions", {
        "messages": [USER], "max_tokens": 4, "n": 2, "temperature": 0, "stream": True,
        "stream_options": {"include_usage": True}})
    assert saw_done
    choices = [(event["choices"][0]) for event in events if event["choices"]]
    finals = [c for c in choices if c["finish_reason"] is not None]
    assert [c["index"] for c in finals] == [0, 1]
    assert all(c["delta"] == {"reasoning_content": None} and c["finish_reason"] == "length" and "matched_stop" in c
               for c in finals)
    assert choices[-2:] == finals  # after every content chunk of both choices
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 8


def test_a_chat_leaving_sampling_out_takes_the_models_defaults(client: httpx.Client) -> None:
    """SGLang 0.5.23 (``--sampling-defaults model``, its default) fills the chat fields a request leaves out
    from the model's generation_config.json, here ``top_k: 1``: sampling at temperature 1 gives the greedy
    answer whatever the seed. A request's own value wins; completions keep the OpenAI defaults."""
    body = {"messages": [USER], "max_tokens": 8, "ignore_eos": True}
    greedy = chat(client, **body, temperature=0)["choices"][0]["message"]["content"]
    assert all(chat(client, **body, seed=seed)["choices"][0]["message"]["content"] == greedy for seed in (1, 2, 3))
    sampled = {chat(client, **body, seed=seed, top_k=-1)["choices"][0]["message"]["content"] for seed in (1, 2, 3)}
    assert sampled != {greedy}
    prompt = client.post("/v1/completions", json={"prompt": "<user>hi<assistant>", "max_tokens": 8, "ignore_eos": True,
                                                  "temperature": 0}).json()["choices"][0]["text"]
    completions = {client.post("/v1/completions", json={"prompt": "<user>hi<assistant>", "max_tokens": 8,
                                                       "ignore_eos": True, "seed": seed}).json()["choices"][0]["text"]
                   for seed in (1, 2, 3)}
    assert completions != {prompt}


def test_the_answer_id_is_the_request_id_so_a_client_can_abort_by_it(client: httpx.Client) -> None:
    """SGLang's answer and stream chunk ids are the request's rid (given or generated); a fresh id of its own
    could not be aborted (found by review)."""
    assert chat(client, rid="my-rid")["id"] == "my-rid"
    events, saw_done = read_stream(client, "/v1/chat/completions", {
        "messages": [USER], "max_tokens": 3, "stream": True, "rid": "my-stream", "stream_options": {"include_usage": True}})
    assert saw_done and {event["id"] for event in events} == {"my-stream"}
    completion = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 1, "rid": "my-completion"})
    assert completion.json()["id"] == "my-completion"
    generated = chat(client)["id"]
    assert generated and client.post("/abort_request", json={"rid": generated}).status_code == 200


def test_a_trailing_assistant_message_becomes_the_users_turn(client: httpx.Client) -> None:
    """SGLang's ``_handle_last_assistant_message``: a chat that ends with the assistant's text is rendered with
    that text as the user's, never as an open assistant turn."""
    def prompt_ids(messages: list[dict[str, Any]]) -> list[int]:
        return chat(client, messages=messages, return_prompt_token_ids=True)["choices"][0]["prompt_token_ids"]

    ending_with_assistant = prompt_ids([USER, {"role": "assistant", "content": "partial"}])
    assert ending_with_assistant == prompt_ids([USER, {"role": "user", "content": "partial"}])
    assert bytes(ending_with_assistant).endswith(b"<user>partial<assistant>")


def test_a_tool_messages_text_parts_are_joined_for_any_template() -> None:
    """SGLang's ``normalize_tool_content``: a tool result sent as text parts reaches even a template that reads
    content parts as one string (templates print a tool message's content as it is)."""
    from node_engine.server.openai_bodies import ChatCompletionBody
    from node_engine.server.routes_openai import _messages

    body = ChatCompletionBody.model_validate({"messages": [USER, {"role": "tool", "tool_call_id": "c1", "content": [
        {"type": "text", "text": "r1"}, {"type": "text", "text": "r2"}]}, USER]})
    messages, _, _ = _messages(body, "openai")
    assert messages[1]["content"] == "r1 r2"
    assert messages[2]["content"] == "hi"


def test_a_chat_template_in_chat_template_kwargs_is_refused_as_sglang_does(client: httpx.Client) -> None:
    """SGLang 0.5.23 ``serving_chat.py:1108``: a request-supplied ``chat_template`` is a 400 unless the server
    trusts it; it was passed to the template as an unused variable, so the request was served with another."""
    r = client.post("/v1/chat/completions", json={"messages": [USER], "max_tokens": 1,
                                                  "chat_template_kwargs": {"chat_template": "{{ 'x' }}"}})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["type"] == "invalid_request"
    assert "chat_template" in r.json()["error"]["message"]


def test_completion_logprobs_keep_each_byte_fragment_apart_as_sglang_does(engine: ServerProcess) -> None:
    """SGLang 0.5.23 ``utils.py:177`` (``_lossless_token_text``): a token that is part of a character is named
    by its bytes as latin-1, not U+FFFD, so ``top_logprobs`` keeps ``logprobs`` entries per position (two
    fragments under one U+FFFD key dropped one and kept the other's logprob). This byte-level tokenizer's
    tokens above 127 are all fragments."""
    with openai.OpenAI(base_url=engine.url + "/v1", api_key="unused", timeout=60) as client:
        whole = client.completions.create(model="m", prompt="hi", max_tokens=8, logprobs=5, temperature=0)
        chunks = list(client.completions.create(model="m", prompt="hi", max_tokens=8, logprobs=5, temperature=0,
                                                stream=True))
    for logprobs in [whole.choices[0].logprobs] + [c.choices[0].logprobs for c in chunks if c.choices]:
        assert logprobs is not None
        assert not any("\ufffd" in token for token in logprobs.tokens), logprobs.tokens
        assert [len(row) for row in logprobs.top_logprobs] == [5] * len(logprobs.tokens), logprobs.top_logprobs
        for token, logprob, row in zip(logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs):
            assert row[token] == logprob  # temperature 0: the token is its row's best
    assert "".join(whole.choices[0].logprobs.tokens).encode("latin-1").decode("utf-8", "replace") \
        == whole.choices[0].text


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_pd_and_dp_routing_fields_are_taken_as_sglang_takes_them(client: httpx.Client, path: str) -> None:
    """SGLang 0.5.23 ``protocol.py:348`` (``PDRoutingFields``, a base of both OpenAI bodies): a PD or DP router
    adds them to OpenAI requests as to ``/generate``; they were 400 ``unknown field`` here."""
    routing = {"bootstrap_host": "10.0.0.1", "bootstrap_port": 8998, "bootstrap_room": 7, "routed_dp_rank": 0,
               "disagg_prefill_dp_rank": 0}
    prompt = {"prompt": "hi"} if path == "/v1/completions" else {"messages": [USER]}
    r = client.post(path, json={**prompt, "max_tokens": 1, **routing})
    assert r.status_code == 200, r.text
    r = client.post(path, json={**prompt, "max_tokens": 1, "routed_dp_rank": "zero"})
    assert r.status_code == 400 and "routed_dp_rank" in r.json()["error"]["message"], r.text


@pytest.mark.parametrize("stream", [False, True])
def test_a_chat_of_max_tokens_0_with_top_logprobs_answers_no_logprob_entries(client: httpx.Client,
                                                                              stream: bool) -> None:
    """Found by review: a max_new_tokens 0 request with top logprobs became SGLang's scoring request (one top
    row after the prompt, no token), and chat's logprobs zipped that row with no token strictly: a 500, a stream
    cut by an error. SGLang's chat builds ``content`` from the output tokens (``serving_chat.py``
    ``_build_token_logprobs_from_raw``): none here, so ``[]``."""
    body = {"messages": [USER], "max_tokens": 0, "logprobs": True, "top_logprobs": 2, "stream": stream}
    if not stream:
        r = client.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["logprobs"] == {"content": []}, r.text
        return
    events, is_done = read_stream(client, "/v1/chat/completions", body)
    assert is_done and events and not any("error" in e for e in events), events
    assert all(choice["logprobs"] in (None, {"content": []}) for e in events for choice in e["choices"]), events
