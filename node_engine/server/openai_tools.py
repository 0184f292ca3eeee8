"""A chat's ``tools`` and ``tool_choice``, as SGLang 0.5.23 takes them without a tool-call parser
(``entrypoints/openai/protocol.py`` ``Tool``, ``ToolChoice``; ``serving_chat.py`` ``_effective_tools``,
``_validate_request``, ``_process_messages``).

- The tools reach the chat template's ``tools`` variable as SGLang's ``model_dump`` makes them: a function's keys
  in the client's order, ``description`` and ``parameters`` null when left out, ``strict`` and ``defer_loading``
  only when given; fields SGLang does not know are dropped. Tools on a ``system``, ``developer`` or ``root``
  message stay on that message and count as the request's.
- With tools in play and ``tool_choice`` not ``"none"``, special tokens stay in the output text (SGLang sets
  ``skip_special_tokens`` to false then). No tool calls are parsed: the answer is the model's raw text.
- ``tool_choice: "required"`` or a named function makes SGLang constrain decoding with a JSON schema; this engine
  has no constrained decoding, so they are 400 ``unsupported``. ``parallel_tool_calls`` only shapes that schema:
  accepted, it changes nothing.
"""

from __future__ import annotations

from typing import Any, Literal, Optional, Union

from pydantic import Field, model_serializer, model_validator

from handoff.service.errors import InvalidRequest, Unsupported
from handoff.protocol.ignored_fields import IgnoresUnknown

__all__ = ["TOOL_MESSAGE_ROLES", "Tool", "ToolChoice", "ToolChoiceValue", "check_tools", "default_tool_choice",
           "effective_tools", "template_tools", "tools_in_play"]

# SGLang's types, strictly (a string where a bool goes is a 400, as everywhere in this engine's bodies); fields
# it does not know are ignored and dropped, as its models drop them (IgnoresUnknown)
# the roles whose message ``tools`` are the request's (``_effective_tools``)
TOOL_MESSAGE_ROLES = ("root", "system", "developer")


class Function(IgnoresUnknown):
    """A tool's function (SGLang's ``Function``): dumped with the client's key order."""

    ignored_where = "a tool's function"
    description: Optional[str] = None
    name: str
    parameters: Optional[object] = None
    strict: Optional[bool] = None
    defer_loading: Optional[bool] = None
    key_order: list[str] = Field(default_factory=list, exclude=True)

    @model_validator(mode="before")
    @classmethod
    def _capture_key_order(cls, data: Any) -> Any:
        if isinstance(data, dict):
            data = {**data, "key_order": list(data.keys())}
        return data

    @model_serializer(mode="wrap")
    def _serialize(self, handler: Any) -> dict[str, Any]:
        data = handler(self)
        if self.defer_loading is None:
            data.pop("defer_loading", None)
        if self.strict is None:
            data.pop("strict", None)
        if self.key_order:
            rest = [key for key in data if key not in self.key_order]
            data = {key: data[key] for key in self.key_order + rest if key in data}
        return data


class Tool(IgnoresUnknown):
    """A tool (SGLang's ``Tool``); its ``defer_loading`` is copied to the function when the function has none."""

    ignored_where = "a tool"
    type: str = "function"
    function: Function
    defer_loading: Optional[bool] = None

    @model_validator(mode="after")
    def _propagate_defer_loading(self) -> Tool:
        if self.defer_loading is not None and self.function.defer_loading is None:
            self.function.defer_loading = self.defer_loading
        return self


class ToolChoiceFuncName(IgnoresUnknown):
    ignored_where = "tool_choice's function"
    name: Optional[str] = None


class ToolChoice(IgnoresUnknown):
    """A named function (SGLang's ``ToolChoice``)."""

    ignored_where = "tool_choice"
    function: ToolChoiceFuncName
    type: Literal["function"] = "function"


ToolChoiceValue = Union[ToolChoice, Literal["auto", "required", "none"]]


def default_tool_choice(values: Any) -> Any:
    """SGLang's ``set_tool_choice_default``: a ``tool_choice`` left out (or null) is ``"none"`` without tools
    (neither ``tools``, even empty, nor a message's), else ``"auto"``."""
    if not isinstance(values, dict) or values.get("tool_choice") is not None:
        return values
    messages = values.get("messages")
    message_tools = isinstance(messages, list) and any(
        isinstance(m, dict) and isinstance(m.get("role"), str) and m["role"].lower() in TOOL_MESSAGE_ROLES
        and bool(m.get("tools")) for m in messages)
    return {**values, "tool_choice": "none" if values.get("tools") is None and not message_tools else "auto"}


def effective_tools(body: Any) -> list[Tool]:
    """The request's tools and those of its ``system``, ``developer`` and ``root`` messages."""
    tools = list(body.tools or [])
    for message in body.messages:
        if message.role in TOOL_MESSAGE_ROLES and message.tools:
            tools.extend(message.tools)
    return tools


def check_tools(body: Any) -> None:
    """SGLang's ``_validate_request`` checks of ``tool_choice`` against the tools (its messages, as 400s), then
    400 ``unsupported`` for a ``tool_choice`` SGLang serves with constrained decoding."""
    tools = effective_tools(body)
    choice = body.tool_choice
    if choice == "required" and not tools:
        raise InvalidRequest("Tools cannot be empty if tool choice is set to required.")
    if isinstance(choice, ToolChoice):
        if not tools:
            raise InvalidRequest("Tools cannot be empty if tool choice is set to a specific tool.")
        if not any(tool.function.name == choice.function.name for tool in tools):
            raise InvalidRequest(f"Tool '{choice.function.name}' not found in tools list.")
    if any(m.role in TOOL_MESSAGE_ROLES and m.tools for m in body.messages):
        names = [tool.function.name for tool in tools]
        if len(names) != len(set(names)):
            raise InvalidRequest("Tool names must be unique across request and message tools.")
    if choice == "required" or isinstance(choice, ToolChoice):
        what = "'required'" if choice == "required" else "a named function"
        raise Unsupported(f"tool_choice: {what} needs constrained decoding (a JSON schema of the calls), "
                          "which this engine does not support; use 'auto' and parse the calls from the text")


def tools_in_play(body: Any) -> bool:
    """Whether the model may call tools: tools given (a message's count) and ``tool_choice`` not ``"none"``."""
    return body.tool_choice != "none" and bool(effective_tools(body))


def template_tools(body: Any) -> list[dict[str, Any]] | None:
    """The chat template's ``tools``: the request's own, dumped as SGLang dumps them; None when none are in play
    (a message's tools stay on the message)."""
    if not tools_in_play(body) or not body.tools:
        return None
    return [tool.model_dump() for tool in body.tools]
