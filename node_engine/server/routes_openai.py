"""OpenAI-compatible ``/v1/completions``, ``/v1/chat/completions``, ``/v1/models`` (SGLang 0.5.23's shapes).

Each request becomes the equivalent ``/generate`` body, as SGLang's
``serving_completions.py`` / ``serving_chat.py`` build it, and runs through the
same plan (:mod:`node_engine.server.generate_plan`): ``n``, seeds, penalties,
logprobs and ``rid`` behave exactly as on ``/generate``. Choices are in SGLang's
order (a prompt's ``n`` samples next to each other).
"""

from __future__ import annotations

import asyncio
import functools
from typing import Any, Awaitable, Callable

from fastapi import APIRouter, Request
from starlette.responses import JSONResponse, Response

from handoff.protocol.generate_request import GenerateBody
from handoff.protocol.generation import SequenceAnswer, SequenceChunk
from handoff.service.bodies import openapi_body, parse_body, parse_value
from handoff.service.errors import InvalidRequest, NotFound, ServiceError
from handoff.service.peer_json import PeerJSONError, loads_bounded
from handoff.service.disconnect import unless_disconnected
from node_engine.engine import Engine
from node_engine.server.content_parts import refuse_unsupported_parts, template_content
from node_engine.server.generate_plan import GeneratePlan, plan_generate
from node_engine.server.generation import check_prompt_chars, check_prompt_ids, max_prompt_chars, openai_error
from node_engine.server.generation_run import GenerationRun
from node_engine.server.openai_answer import (Answer, ChatDeltas, continuous_usage_of, finish_fields,
                                              include_usage_of, token_id_fields)
from node_engine.server.openai_shapes import chat_logprobs, completion_logprobs
from node_engine.server.openai_bodies import (ChatCompletionBody, CompletionBody, refuse_adapter_model,
                                              refuse_unsupported_openai)
from node_engine.server.openai_tools import check_tools, effective_tools, template_tools, tools_in_play
from node_engine.server.tool_schemas import check_tool_schemas
from node_engine.chat_template import ChatTemplateError

router = APIRouter()


def _sglang_error_fields(handler: Callable[[Request], Awaitable[Response]]) -> Callable[[Request], Awaitable[Response]]:
    """A generation route whose refusals carry SGLang's ``ErrorResponse`` fields (:func:`openai_error`)."""
    @functools.wraps(handler)
    async def route(request: Request) -> Response:
        try:
            return await handler(request)
        except ServiceError as exc:
            openai_error(exc)
            raise

    return route


async def _plan(request: Request, body: CompletionBody | ChatCompletionBody, prompt: dict[str, Any],
                max_new_tokens: int | None, logprobs: dict[str, Any], *, is_chat: bool = False) -> GeneratePlan:
    """The plan of the equivalent ``/generate`` body (``prompt``: its ``text`` or ``input_ids``, and
    ``image_data``). The route has refused unsupported fields. For chat, as SGLang's: without
    ``max_new_tokens`` a sequence may use what the context leaves (instead of ``/generate``'s default of 128),
    and sampling fields left out take the model's defaults (``--sampling-defaults model``)."""
    engine: Engine = request.app.state.engine
    defaults = engine.tokenizer.sampling_defaults if is_chat and engine.config.sampling_defaults == "model" else {}
    generate = parse_value({**prompt, "sampling_params": {**defaults, **body.sampling_params(max_new_tokens)},
                            "rid": body.rid, "stream": body.stream, **body.forwarded(), **logprobs}, GenerateBody)
    return await unless_disconnected(request, plan_generate(engine, generate, request.app.state.images,
                                                            to_context_by_default=is_chat))


@router.post("/v1/completions", openapi_extra=openapi_body(CompletionBody))
@_sglang_error_fields
async def completions(request: Request) -> Response:
    engine: Engine = request.app.state.engine
    body = await parse_body(request, CompletionBody)
    refuse_unsupported_openai(body)
    refuse_adapter_model(body.model, engine.config.model_name)
    prompt = body.prompt
    if not prompt or (isinstance(prompt, list) and all(not p for p in prompt)):
        raise InvalidRequest("prompt must not be empty")
    is_text = isinstance(prompt, str) or isinstance(prompt[0], str)
    if not is_text:
        check_prompt_ids(engine, prompt)  # before the ids are copied into the /generate body
    with_prompt_logprobs = body.echo and bool(body.logprobs)  # SGLang: echo with logprobs >= 1
    logprobs = {} if body.logprobs is None else {
        "return_logprob": True, "top_logprobs_num": body.logprobs, "return_text_in_logprobs": True,
        "logprob_start_len": 0 if with_prompt_logprobs else -1}
    plan = await _plan(request, body, {"text" if is_text else "input_ids": prompt}, body.max_tokens, logprobs)
    run = GenerationRun(engine, plan.sequences, stream=body.stream)
    ids = token_id_fields(body, plan)
    echoes = [_echo(engine, prompt, spec.prompt_ids, spec.prompt_index, is_text) if body.echo else ""
              for spec in plan.sequences]

    def lists(piece: SequenceChunk | SequenceAnswer, first: bool) -> dict[str, Any] | None:
        if body.logprobs is None:
            return None
        meta = piece.meta_info() if isinstance(piece, SequenceAnswer) else None
        get = (lambda key: meta.get(key)) if meta is not None else (lambda key: getattr(piece, key))
        tokens = list(get("output_token_logprobs") or [])
        tops = list(get("output_top_logprobs") or [])
        if with_prompt_logprobs and first:
            tokens = list(get("input_token_logprobs") or []) + tokens
            tops = list(get("input_top_logprobs") or []) + tops
        return completion_logprobs(engine.tokenizer, tokens, tops)

    return await Answer(engine, "text_completion", run.rids, plan.n, body.model, completion_chunks=True).respond(
        request, run, lambda i, a: {"index": i, "text": echoes[i] + a.text, "logprobs": lists(a, True),
                                    **finish_fields(a.finish_reason), **ids(i, a.output_ids, True)},
        lambda i, c, first: {"index": i, "text": (echoes[i] if first else "") + c.text, "logprobs": lists(c, first),
                             **finish_fields(c.finish_reason), **ids(i, c.output_ids, first)},
        stream=body.stream, include_usage=include_usage_of(body), continuous_usage=continuous_usage_of(body),
        chunk_obj="text_completion")


def _echo(engine: Engine, prompt: Any, prompt_ids: list[int], index: int, is_text: bool) -> str:
    """The prompt as ``echo`` repeats it: its text, or its ids decoded (SGLang's ``_get_echo_text``)."""
    if is_text:
        return prompt if isinstance(prompt, str) else prompt[index]
    return engine.tokenizer.decode(prompt_ids, skip_special_tokens=True)


def _num_chars(value: Any) -> int:
    """The characters of every string in ``value`` (the messages, their roles, names and extra fields), and one
    for every other value (a number, ``true``, ``null``: a template writes each as one character or more; counted
    as none, a tool's ``parameters`` of millions of numbers reached the schema check and the template)."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, dict):
        return sum(_num_chars(k) + _num_chars(v) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return sum(_num_chars(item) for item in value)
    return 1


def _messages(body: ChatCompletionBody,
              content_format: str) -> tuple[list[dict[str, Any]], list[object], str | None]:
    """The messages as the chat template reads them, the ``image_url`` parts' URLs in order, and the text the
    answer continues (or None).

    Content parts as SGLang gives them to the template (:func:`template_content`). An assistant's tool-call
    arguments written as a JSON string are given to the template as the object (SGLang's
    ``normalize_assistant_tool_call_arguments``). A last message from the assistant with text content (text
    parts a string template gets joined included; None as ``""``) is, as SGLang's
    ``_handle_last_assistant_message`` takes it: with ``continue_final_message``, left out and its text returned
    (the prompt ends with it); without, a user message (the prompt always ends with the user's turn)."""
    messages: list[dict[str, Any]] = []
    images: list[object] = []
    for n, message in enumerate(body.messages):
        fields = message.template_dict()
        messages.append({**fields, "content": template_content(message.role, message.content, content_format,
                                                                images)})
        _parse_tool_call_arguments(messages[-1], n)
    if messages and messages[-1]["role"] == "assistant" and isinstance(messages[-1]["content"], str):
        if body.continue_final_message:
            return messages[:-1], images, messages[-1]["content"]
        messages[-1] = {"role": "user", "content": messages[-1]["content"]}
    return messages, images, None


def _parse_tool_call_arguments(message: dict[str, Any], n: int) -> None:
    calls = message.get("tool_calls")
    if message["role"] != "assistant" or not isinstance(calls, list):
        return
    parsed = []
    for k, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if isinstance(function, dict) and isinstance(function.get("arguments"), str):
            try:
                arguments = loads_bounded(function["arguments"].encode())
            except (PeerJSONError, UnicodeError):
                raise InvalidRequest(f"messages.{n}.tool_calls.{k}.function.arguments must be valid "
                                     "JSON") from None
            if not isinstance(arguments, dict):
                raise InvalidRequest(f"messages.{n}.tool_calls.{k}.function.arguments must be a JSON object")
            call = {**call, "function": {**function, "arguments": arguments}}
        parsed.append(call)
    message["tool_calls"] = parsed


# What one message adds at least to the characters :func:`check_prompt_chars` counts for a chat: its keys "role" and
# "content" and a role of four letters or more ("user", "tool", ...).
_MIN_MESSAGE_CHARS = len("role") + len("content") + len("user")


def _check_message_counts(engine: Engine, value: Any) -> None:
    """400 for more messages (or content parts) than any chat that fits could have, before a message is validated:
    validating and copying them costs the event loop about 16 us each (a 57 MiB body of 2 million one-letter
    messages held it 24 s and grew the engine by 2 GiB before its 400). Refuses nothing the character check
    after validation would take: each message counts at least ``_MIN_MESSAGE_CHARS`` there, and a content list
    of k parts at least k - 1 (text parts joined with spaces, or parts each with their ``type``)."""
    messages = value.get("messages") if isinstance(value, dict) else None
    if not isinstance(messages, list):
        return  # validation names the problem
    limit = max_prompt_chars(engine)
    if len(messages) * _MIN_MESSAGE_CHARS > limit:
        raise InvalidRequest(f"{len(messages)} messages can never fit the context of "
                             f"{engine.runner.kv_plan.context_len} tokens (at most {limit // _MIN_MESSAGE_CHARS})")
    num_parts = sum(len(m["content"]) for m in messages if isinstance(m, dict) and isinstance(m.get("content"), list))
    if num_parts > limit + len(messages):
        raise InvalidRequest(f"{num_parts} content parts can never fit the context of "
                             f"{engine.runner.kv_plan.context_len} tokens")


async def _check_tool_schemas(engine: Engine, body: ChatCompletionBody) -> None:
    """SGLang's check of the tools' ``parameters`` (:func:`check_tool_schemas`), before the template renders them
    (it rewrites database type names in place). Off the event loop: the metaschema check of 100k properties
    takes 20 s; and after a 400 for schemas the template would render that are longer than any prompt."""
    rendered = [tool for message in body.messages if message.tools for tool in message.tools]
    if tools_in_play(body):
        rendered += body.tools or []
    check_prompt_chars(engine, _num_chars([tool.function.parameters for tool in rendered]))
    await asyncio.to_thread(check_tool_schemas, effective_tools(body))


def _chat_prompt(engine: Engine, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                 template_kwargs: dict[str, Any] | None, prefix: str | None) -> list[int]:
    """The rendered template's ids (it ends with the generation prompt), then those of the assistant's text the
    answer continues, if any (SGLang's ``_append_assistant_prefix_to_prompt_ids``; an empty text adds none)."""
    ids = engine.tokenizer.apply_chat_template(messages, tools=tools, template_kwargs=template_kwargs)
    return ids + engine.tokenizer.assistant_prefix_ids(prefix) if prefix else ids


@router.post("/v1/chat/completions", openapi_extra=openapi_body(ChatCompletionBody))
@_sglang_error_fields
async def chat_completions(request: Request) -> Response:
    engine: Engine = request.app.state.engine
    body = await parse_body(request, ChatCompletionBody,
                            before_validation=lambda value: _check_message_counts(engine, value))
    refuse_unsupported_openai(body)
    refuse_unsupported_parts([message.content for message in body.messages])
    refuse_adapter_model(body.model, engine.config.model_name)
    check_tools(body)
    if tools_in_play(body):
        body.skip_special_tokens = False  # SGLang keeps them for a tool-call parser, so without one as well
    await _check_tool_schemas(engine, body)
    tools = template_tools(body)
    if body.stream and (body.return_token_ids or body.return_prompt_token_ids):
        raise InvalidRequest("return_token_ids and return_prompt_token_ids are not supported with streaming; "
                             "set stream=false to get them")
    messages, images, prefix = _messages(body, engine.tokenizer.content_format)
    if images:
        request.app.state.images.check_supported("messages: image_url")
    check_prompt_chars(engine, _num_chars([messages, tools, body.chat_template_kwargs, prefix or ""]))  # the prompt
    try:  # rendered and tokenized off the event loop, like every prompt
        ids = await asyncio.to_thread(_chat_prompt, engine, messages, tools, body.chat_template_kwargs, prefix)
    except ChatTemplateError as exc:
        raise InvalidRequest(str(exc)) from exc
    logprobs = {"return_logprob": True, "top_logprobs_num": body.top_logprobs or 0,
                "return_text_in_logprobs": True} if body.logprobs else {}
    plan = await _plan(request, body, {"input_ids": ids, "image_data": images or None}, body.max_new_tokens,
                       logprobs, is_chat=True)
    run = GenerationRun(engine, plan.sequences, stream=body.stream)
    token_ids = token_id_fields(body, plan)

    def lists(tokens: Any, tops: Any) -> dict[str, Any] | None:
        return chat_logprobs(engine.tokenizer, tokens or [], tops) if body.logprobs else None

    def whole(i: int, a: SequenceAnswer) -> dict[str, Any]:
        meta = a.meta_info()
        return {"index": i, "message": {"role": "assistant", "content": a.text, "reasoning_content": None},
                "logprobs": lists(meta.get("output_token_logprobs"), meta.get("output_top_logprobs")),
                **finish_fields(a.finish_reason), **token_ids(i, a.output_ids, True)}

    deltas = ChatDeltas(lists)
    return await Answer(engine, "chat.completion", run.rids, plan.n, body.model).respond(
        request, run, whole, deltas.choice, stream=body.stream, include_usage=include_usage_of(body),
        continuous_usage=continuous_usage_of(body), chunk_obj="chat.completion.chunk",
        preamble=lambda i: {"index": i, "delta": {"role": "assistant", "content": "", "reasoning_content": None},
                            "logprobs": None, "finish_reason": None, "matched_stop": None},
        finale=deltas.finale)


def _model_card(engine: Engine) -> dict[str, Any]:
    name = engine.config.model_name
    return {"id": name, "object": "model", "created": 0, "owned_by": "handoff", "root": name, "parent": None,
            "max_model_len": engine.runner.kv_plan.context_len}


@router.get("/v1/models")
async def models(request: Request) -> JSONResponse:
    return JSONResponse({"object": "list", "data": [_model_card(request.app.state.engine)]})


@router.get("/v1/models/{model:path}")
async def model(request: Request, model: str) -> JSONResponse:
    engine: Engine = request.app.state.engine
    if model != engine.config.model_name:  # SGLang's param and code (http_server.py retrieve_model)
        raise NotFound(f"the model {model!r} does not exist; this engine serves {engine.config.model_name!r}",
                       extra={"param": "model", "code": "model_not_found"})
    return JSONResponse(_model_card(engine))
