"""A chat's ``messages``, as SGLang 0.5.23 takes them (``entrypoints/openai/protocol.py``
``ChatCompletionMessageParam``): a ``user`` message has ``role`` and ``content`` alone, the other roles the fields
of ``ChatCompletionMessageGenericParam``, typed strictly; any other field, of a message or of a tool call in the
history, is dropped unread, so it never reaches the chat template (its name logged once:
:mod:`handoff.protocol.ignored_fields`). Content parts are
:mod:`node_engine.server.content_parts`'s, tools :mod:`node_engine.server.openai_tools`'s."""

from __future__ import annotations

from typing import Any, Literal, Union

from pydantic import field_validator, model_validator

from node_engine.server.content_parts import Content, ThinkingPart
from handoff.protocol.ignored_fields import IgnoresUnknown, note_ignored
from node_engine.server.openai_tools import Tool

__all__ = ["GENERIC_ROLES", "ChatMessage", "ToolCall", "ToolCallFunction"]

# SGLang's roles: "user" as written, the others in any case (``ChatCompletionMessageGenericParam``)
GENERIC_ROLES = ("system", "assistant", "tool", "function", "developer", "latest_reminder", "root")


class ToolCallFunction(IgnoresUnknown):
    ignored_where = "a tool call's function"
    name: str | None = None
    arguments: Union[str, dict[str, Any], None] = None


class ToolCall(IgnoresUnknown):
    """An assistant's earlier tool call, in the history (SGLang's ``ToolCall``)."""

    ignored_where = "a tool call"
    id: str | None = None
    index: int | None = None
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(IgnoresUnknown):
    """A chat message, as SGLang's ``ChatCompletionMessageParam`` takes it: a ``user`` message has ``role`` and
    ``content`` alone (``ChatCompletionMessageUserParam``), the other roles the fields of
    ``ChatCompletionMessageGenericParam``; any other field is dropped unread."""

    ignored_where = "a message"
    role: str
    content: Content | None = None
    tool_call_id: str | None = None
    name: str | None = None
    phase: Literal["commentary", "final_answer"] | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCall] | None = None
    tools: list[Tool] | None = None
    prefix: bool | None = None  # DeepSeek's prefix completion: only its templates read it

    @model_validator(mode="before")
    @classmethod
    def _user_fields(cls, value: Any) -> Any:
        if isinstance(value, dict) and value.get("role") == "user":
            note_ignored("a user message", (key for key in value if isinstance(key, str)
                                            and key not in ("role", "content")))
            value = {key: item for key, item in value.items() if key in ("role", "content")}
        return value

    @field_validator("role")
    @classmethod
    def _role(cls, value: str) -> str:
        if value == "user" or value.lower() in GENERIC_ROLES:
            return value if value == "user" else value.lower()
        raise ValueError(f"'role' must be 'user' or one of {', '.join(map(repr, GENERIC_ROLES))} (any case), "
                         f"got {value[:40]!r}")

    def template_dict(self) -> dict[str, Any]:
        """The message as the chat template gets it (SGLang's ``model_dump``, then its null fields left out):
        what is nested is dumped whole, a tool's null ``description`` and ``parameters`` and a tool call's null
        ``id`` and ``index`` included."""
        return {key: value for key, value in self.model_dump().items() if value is not None}

    @model_validator(mode="after")
    def _user_content(self) -> ChatMessage:
        if self.role == "user" and self.content is None:
            raise ValueError("a user message needs content")
        parts = self.content if isinstance(self.content, list) else ()
        if self.role != "assistant" and any(isinstance(part, ThinkingPart) for part in parts):
            raise ValueError("thinking content parts are only valid in assistant messages")
        return self
