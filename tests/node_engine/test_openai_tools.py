"""A chat's ``tools`` and ``tool_choice`` as SGLang 0.5.23 serves them without a tool-call parser, on a real engine
process: the tools reach the chat template, special tokens stay in the text, no tool calls are parsed, and what
would need constrained decoding is refused.

The checkpoint's template writes ``tools`` (and a message's) with ``tojson``; its tokenizer is byte-level, so the
prompt's ids are the rendered text's bytes.
"""

from __future__ import annotations

import json
from typing import Any, Iterator

import httpx
import openai
import pytest

from tests.node_engine.checkpoints import CHAT_USER, post_chat, rendered_prompt, templated_engine
from tests.support.procs import ServerProcess

pytestmark = pytest.mark.timeout(120)

TEMPLATE = ("{% if tools and tools[0]['function'] is defined and tools[0]['function']['name'] == 'flat' %}"
            "{{ raise_exception('this template takes bare functions') }}{% endif %}"
            "{% if tools %}[tools]{{ tools | tojson }}{% endif %}"
            "{% for m in messages %}<{{ m['role'] }}>{% if m.tools %}{{ m.tools | tojson }}{% endif %}"
            "{% for k, v in m | dictsort if k not in ('role', 'content', 'tools') %}({{ k }}={{ v | tojson }})"
            "{% endfor %}{{ m['content'] }}{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}")
USER = CHAT_USER
CITY = {"type": "object", "properties": {"city": {"type": "string"}}}
WEATHER = {"type": "function", "function": {"name": "weather", "description": "the weather", "parameters": CITY}}
RESERVED_ID = 258  # a special token of the byte-level tokenizer ("<reserved_0>")


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    proc = templated_engine(tmp_path_factory.mktemp("tool_template"), TEMPLATE, 512)
    yield proc
    proc.stop()


@pytest.fixture
def client(engine: ServerProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=engine.url, timeout=60) as c:
        yield c


def test_tools_reach_the_template_as_sglang_dumps_them(engine: ServerProcess, client: httpx.Client) -> None:
    """SGLang's ``Tool.model_dump``: the function's keys in the client's order, a null description and parameters
    when left out, ``strict`` only when given, unknown fields dropped, the tool's ``defer_loading`` always."""
    tools = [{"function": {"parameters": {"type": "object"}, "name": "f", "strict": True, "extra": 1}, "x": 2},
             {"type": "function", "function": {"name": "g"}, "defer_loading": True}]
    expected = [{"type": "function", "function": {"parameters": {"type": "object"}, "name": "f", "strict": True,
                                                  "description": None}, "defer_loading": None},
                {"type": "function", "function": {"name": "g", "description": None, "parameters": None,
                                                  "defer_loading": True}, "defer_loading": True}]
    assert rendered_prompt(client, tools=tools) == f"[tools]{json.dumps(expected)}<user>hi<assistant>"
    assert rendered_prompt(client, tools=tools, tool_choice="auto") == rendered_prompt(client, tools=tools)
    assert rendered_prompt(client, tools=tools, tool_choice="none") == "<user>hi<assistant>"
    # through the OpenAI client: the answer is the raw text, no tool call parsed
    with openai.OpenAI(base_url=engine.url + "/v1", api_key="unused", timeout=60) as sdk:
        answer = sdk.chat.completions.create(model="tiny-llama", messages=[USER], tools=[WEATHER], max_tokens=3,
                                             temperature=0, extra_body={"return_prompt_token_ids": True})
    choice = answer.choices[0]
    assert choice.message.tool_calls is None and choice.finish_reason in ("stop", "length")
    prompt = bytes(choice.model_extra["prompt_token_ids"]).decode()
    assert prompt == f"[tools]{json.dumps([{**WEATHER, 'defer_loading': None}])}<user>hi<assistant>"


def test_a_system_messages_tools_stay_on_it_and_count_as_the_requests(client: httpx.Client) -> None:
    system = {"role": "System", "content": "s", "tools": [{"function": {"name": "g"}}]}
    dumped = [{"type": "function", "function": {"name": "g", "description": None, "parameters": None},
               "defer_loading": None}]
    assert rendered_prompt(client, messages=[system, USER]) == f"<system>{json.dumps(dumped)}s<user>hi<assistant>"
    # a user message has no tools in SGLang: dropped unread
    assert rendered_prompt(client, messages=[{**USER, "tools": [1]}]) == "<user>hi<assistant>"
    # they make tools in play: special tokens stay (below), and names must be unique across both
    r = post_chat(client, messages=[system, USER], tools=[{"function": {"name": "g"}}])
    assert r.status_code == 400 and r.json()["error"]["message"] == \
        "Tool names must be unique across request and message tools."


def test_a_messages_fields_reach_the_template_as_sglang_keeps_them(client: httpx.Client) -> None:
    """SGLang's message models keep the fields they declare and drop the rest unread: a user message has
    ``role`` and ``content`` alone, the other roles their own fields; a tool call is dumped whole (null ``id``
    and ``index``), its unknown fields dropped. A declared field of the wrong type is a 400."""
    user = {**USER, "name": "u", "foo": 1}
    assistant = {"role": "assistant", "content": "a", "name": "bot", "reasoning_content": "r", "refusal": None,
                 "audio": None, "annotations": [], "foo": {"x": 1}, "prefix": False,
                 "tool_calls": [{"function": {"name": "f", "arguments": {"a": 1}, "extra": 2}, "x": 3}]}
    tool = {"role": "tool", "content": "t", "tool_call_id": "c1", "bogus": "x"}
    calls = [{"id": None, "index": None, "type": "function", "function": {"name": "f", "arguments": {"a": 1}}}]
    assert rendered_prompt(client, messages=[user, assistant, tool, USER]) == (
        '<user>hi<assistant>(name="bot")(prefix=false)(reasoning_content="r")'
        f'(tool_calls={json.dumps(calls)})a<tool>(tool_call_id="c1")t<user>hi<assistant>')
    for wrong in ({"name": 5}, {"phase": "draft"}, {"reasoning_content": ["r"]}, {"tool_call_id": 1}):
        r = post_chat(client, messages=[{"role": "assistant", "content": "a", **wrong}, USER])
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request", r.text


def test_special_tokens_stay_in_the_text_with_tools(client: httpx.Client) -> None:
    """SGLang sets ``skip_special_tokens`` to false when tools are in play (even when the client sets it true)."""
    forced = {"max_tokens": 2, "logit_bias": {str(RESERVED_ID): 100}, "temperature": 0}
    plain = post_chat(client, **forced).json()["choices"][0]["message"]["content"]
    with_tools = post_chat(client, tools=[WEATHER], skip_special_tokens=True, **forced).json()
    declined = post_chat(client, tools=[WEATHER], tool_choice="none", **forced).json()
    assert plain == "" and declined["choices"][0]["message"]["content"] == ""
    assert with_tools["choices"][0]["message"]["content"] == "<reserved_0><reserved_0>"
    assert "tool_calls" not in with_tools["choices"][0]["message"]
    assert with_tools["choices"][0]["finish_reason"] == "length"


def test_a_template_that_wants_bare_functions_gets_them_on_a_second_try(client: httpx.Client) -> None:
    """SGLang renders again with each tool's ``function`` alone when the template fails with the tools."""
    tools = [{"type": "function", "function": {"name": "flat"}}]
    flat = [{"name": "flat", "description": None, "parameters": None}]
    assert rendered_prompt(client, tools=tools) == f"[tools]{json.dumps(flat)}<user>hi<assistant>"


@pytest.mark.parametrize(("body", "message"), [
    ({"tool_choice": "required"}, "Tools cannot be empty if tool choice is set to required."),
    ({"tools": [], "tool_choice": "required"}, "Tools cannot be empty if tool choice is set to required."),
    ({"tool_choice": {"type": "function", "function": {"name": "f"}}},
     "Tools cannot be empty if tool choice is set to a specific tool."),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "f"}}},
     "Tool 'f' not found in tools list."),
])
def test_tool_choice_against_the_tools_as_sglang_checks_it(client: httpx.Client, body: dict, message: str) -> None:
    r = post_chat(client, **body)
    error = r.json()["error"]
    assert r.status_code == 400 and (error["type"], error["message"]) == ("invalid_request", message), r.text


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "weather"}}])
def test_a_tool_choice_that_needs_constrained_decoding_is_unsupported(client: httpx.Client, choice: Any) -> None:
    r = post_chat(client, tools=[WEATHER], tool_choice=choice)
    assert r.status_code == 400 and r.json()["error"]["type"] == "unsupported"
    assert "tool_choice" in r.json()["error"]["message"] and "constrained decoding" in r.json()["error"]["message"]


@pytest.mark.parametrize("body", [
    {"tools": [{"type": "function", "function": {"description": "no name"}}]},
    {"tools": [{"type": "function"}]},
    {"tools": [{"function": {"name": 1}}]},
    {"tools": {"function": {"name": "f"}}},
    {"tools": [WEATHER], "tool_choice": "AUTO"},
    {"tools": [WEATHER], "parallel_tool_calls": None},
    {"messages": [{"role": "system", "content": "s", "tools": [{"function": {}}]}, USER]},
])
def test_malformed_tools_are_400s(client: httpx.Client, body: dict) -> None:
    r = post_chat(client, **body)
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request", r.text


@pytest.mark.parametrize(("tools", "index", "why"), [
    ([{"function": {"name": "f", "parameters": "a string"}}], 0, "'a string' is not of type 'object', 'boolean'"),
    ([WEATHER, {"function": {"name": "f", "parameters": {"type": "varchar2"}}}], 1, "is not valid under any"),
    ([{"function": {"name": "f", "parameters": {"properties": {"a": {"required": "a"}}}}}], 0, "is not of type"),
    ([{"function": {"name": "f", "parameters": [1]}}], 0, "is not of type 'object', 'boolean'"),
    # found by review (R2): a pattern whose repetition count overflows made the metaschema's regex check raise
    # OverflowError, not its SchemaError: a 500
    ([{"function": {"name": "f", "parameters": {"properties": {"a": {"pattern": "a{99999999999999999999}"}}}}}], 0,
     "repetition number is too large"),
])
def test_tool_parameters_that_are_no_json_schema_are_400s(engine: ServerProcess, client: httpx.Client,
                                                           tools: list, index: int, why: str) -> None:
    """SGLang checks each tool's ``parameters`` against JSON Schema 2020-12's metaschema (``_validate_request``),
    with ``tool_choice`` "none" too, and a system message's tools after the request's."""
    message = f"Tool {index} function has invalid 'parameters' schema: "
    for body in ({"tools": tools}, {"tools": tools, "tool_choice": "none"},
                 {"tools": tools[:-1], "messages": [{"role": "system", "content": "s", "tools": tools[-1:]}, USER]}):
        r = post_chat(client, **body)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["type"] == "invalid_request" and error["message"].startswith(message) and why in error["message"]
    with openai.OpenAI(base_url=engine.url + "/v1", api_key="unused", timeout=60, max_retries=0) as sdk:
        with pytest.raises(openai.BadRequestError, match="invalid 'parameters' schema"):
            sdk.chat.completions.create(model="tiny-llama", messages=[USER], tools=tools, max_tokens=1)


def test_database_type_names_in_parameters_are_rewritten_as_sglang_does(client: httpx.Client) -> None:
    """SGLang's ``normalize_json_schema_types``: the template renders JSON Schema's type names, the request's
    tools and a system message's; a name it does not map is left as it is, and the metaschema refuses it."""
    def tool(name: str, properties: dict) -> dict:
        return {"function": {"name": name, "parameters": {"type": "object", "properties": properties}}}

    def dumped(name: str, properties: dict) -> str:
        parameters = {"type": "object", "properties": properties}
        return json.dumps([{"type": "function", "function": {"name": name, "parameters": parameters,
                                                             "description": None}, "defer_loading": None}])

    r = post_chat(client, tools=[tool("f", {"a": {"type": "internal"}})])  # "int" names no type inside "internal"
    assert r.status_code == 400 and "'internal' is not valid" in r.json()["error"]["message"], r.text
    given = {"a": {"type": "VARCHAR(9)"}, "b": {"type": ["int32", "bigint", "null"]},
             "c": {"items": {"type": "decimal(9,2)"}}, "d": {"anyOf": [{"type": "list[str]"}, {"type": "map"}]}}
    expected = {"a": {"type": "string"}, "b": {"type": ["integer", "null"]}, "c": {"items": {"type": "number"}},
                "d": {"anyOf": [{"type": "array"}, {"type": "object"}]}}
    system = {"role": "system", "content": "s", "tools": [tool("g", {"e": {"type": "bool"}})]}
    assert rendered_prompt(client, tools=[tool("f", given)], messages=[system, USER]) == (
        f"[tools]{dumped('f', expected)}<system>{dumped('g', {'e': {'type': 'boolean'}})}s<user>hi<assistant>")


def test_parallel_tool_calls_changes_nothing(client: httpx.Client) -> None:
    """Without a tool-call parser SGLang reads it only for the schema of required calls."""
    base = post_chat(client, tools=[WEATHER], max_tokens=4, temperature=0, return_prompt_token_ids=True).json()
    off = post_chat(client, tools=[WEATHER], max_tokens=4, temperature=0, return_prompt_token_ids=True,
               parallel_tool_calls=False).json()
    assert off["choices"][0]["message"] == base["choices"][0]["message"]
    assert off["choices"][0]["prompt_token_ids"] == base["choices"][0]["prompt_token_ids"]



def test_numbers_in_parameters_count_against_the_prompt_bound(client: httpx.Client) -> None:
    """Found by review (R2): the character bound on what the template renders counted strings only, so a tool's
    ``parameters`` of 60,000 numbers (360 KB) passed it, and the schema check (a list scan per item in the type
    rewrite, then the metaschema over each) held a worker thread, and the GIL in turns, for minutes before its
    400; a body of a few megabytes of them, hours."""
    import time

    parameters = {"type": "object", "properties": {"a": {"type": list(range(60_000)) + ["string", "string"]}}}
    started = time.monotonic()
    r = post_chat(client, tools=[{"function": {"name": "f", "parameters": parameters}}])
    elapsed = time.monotonic() - started
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request", r.text
    assert elapsed < 10, f"{elapsed:.1f} s before the 400"


def test_the_type_rewrite_deduplicates_in_linear_time_as_sglang_keeps_items() -> None:
    """Found by review (R2): a ``type`` list was deduplicated with a list scan per item (SGLang's
    ``_normalize_type_list``): 40,000 distinct names, within an engine of a long context's character bound,
    took 20 s of a worker thread before the metaschema refused them. What is kept is SGLang's: the first of
    items equal as Python compares them (``1``, ``true`` and ``1.0`` are one), database names mapped first."""
    import time

    from node_engine.server.tool_schemas import normalize_json_schema_types

    schema: dict[str, Any] = {"type": [1, True, 1.0, "int", "integer", None, None, {"a": 1}, {"a": 1}, [2], [2]]}
    normalize_json_schema_types(schema)
    assert schema["type"] == [1, "integer", None, {"a": 1}, [2]]
    schema = {"type": [f"t{i}" for i in range(40_000)]}
    started = time.monotonic()
    normalize_json_schema_types(schema)
    # 0.3 s on a loaded 2-core box; quadratic, it took 20 s
    assert time.monotonic() - started < 5 and len(schema["type"]) == 40_000
