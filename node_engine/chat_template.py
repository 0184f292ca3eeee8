"""Chat templates as SGLang 0.5.23 renders them: a sandboxed Jinja environment with Hugging Face's globals and
filters, the messages' content in the format the template expects, and ``chat_template_kwargs``.

Rules:

- The template runs sandboxed (``ImmutableSandboxedEnvironment``); whatever it
  raises while rendering a request's messages is that request's error
  (:class:`ChatTemplateError`, a 400), never the server's.
- :func:`content_format` is SGLang's ``detect_jinja_template_content_format``:
  ``"openai"`` when the template loops over a message's ``content`` (or names
  images, audio or video), else ``"string"``. A ``"string"`` template gets a
  list of text parts joined with single spaces, as SGLang joins them.
- The environment is Hugging Face's (``transformers`` ``_compile_jinja_template``, which
  SGLang renders with): loop controls (``{% break %}``, ``{% continue %}``), the
  ``{% generation %}`` tag of assistant masks (its body rendered as written), and
  ``tojson`` with ``ensure_ascii`` (off by default), ``indent``, ``separators``
  and ``sort_keys`` (GLM's templates call ``tojson(ensure_ascii=False)``).
- ``chat_template_kwargs`` are passed to the template as extra variables
  (``enable_thinking`` for Qwen3, say); they may not replace the variables the
  renderer sets itself, nor name a ``chat_template`` (a 400, as in SGLang without
  ``--trust-request-chat-template``: ``serving_chat.py`` ``_validate_request``).
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from typing import Any, Iterator

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.parser
from jinja2.sandbox import ImmutableSandboxedEnvironment

__all__ = ["RESERVED_VARIABLES", "ChatTemplateError", "content_format", "render"]

MAX_RENDERED_CHARS = 64 * 1024 * 1024  # far past any context window's text
RESERVED_VARIABLES = frozenset({"messages", "add_generation_prompt", "bos_token", "eos_token", "tools",
                                "documents"})


class ChatTemplateError(ValueError):
    """The messages cannot be rendered (no template, or the template refused them)."""


def render(source: str, messages: list[dict[str, Any]], *, add_generation_prompt: bool, bos_token: str,
           eos_token: str, template_kwargs: dict[str, Any] | None = None,
           tools: list[dict[str, Any]] | None = None) -> str:
    """The template's text for ``messages``; ``tools``: its ``tools`` variable (None without tools)."""
    extra = template_kwargs or {}
    clashing = sorted(RESERVED_VARIABLES & set(extra))
    if clashing:
        raise ChatTemplateError(f"chat_template_kwargs may not set {clashing[0]!r}: the server sets it")
    if "chat_template" in extra:
        raise ChatTemplateError("chat_template_kwargs may not set 'chat_template': a request-supplied chat template "
                                "is not allowed (the model's is used)")
    try:
        chunks = _compile(source).generate(**extra, messages=messages, add_generation_prompt=add_generation_prompt,
                                           bos_token=bos_token, eos_token=eos_token, tools=tools, documents=None)
        return _bounded_join(chunks)
    except jinja2.TemplateError as exc:
        raise ChatTemplateError(f"the chat template rejected the messages: {exc}") from exc
    except (TypeError, ValueError, KeyError, IndexError, AttributeError, ArithmeticError, RecursionError) as exc:
        # the template met a value it cannot handle (a tool call without arguments, a string where it
        # expects a list): the messages' fault, answered as such
        raise ChatTemplateError(f"the chat template could not render the messages "
                                f"({type(exc).__name__}: {str(exc)[:200]})") from exc


@lru_cache(maxsize=8)
def content_format(source: str) -> str:
    """``"openai"`` (content parts stay a list) or ``"string"`` (text parts joined), as SGLang decides."""
    if any(word in source for word in ("image", "audio", "video", "vision")):
        return "openai"
    try:
        tree = _compile(source).environment.parse(source)
    except jinja2.TemplateError:
        return "string"
    for loop in tree.find_all(jinja2.nodes.For):
        if any(_reads(loop.iter, name, "content") for name in ("message", "msg", "m")):
            return "openai"
    return "string"


def _reads(node: jinja2.nodes.Node, name: str, key: str) -> bool:
    """Whether ``node`` is ``name[key]`` or ``name.key``, through filters, tests and slices."""
    if isinstance(node, (jinja2.nodes.Filter, jinja2.nodes.Test)):
        return node.node is not None and _reads(node.node, name, key)
    if isinstance(node, jinja2.nodes.Getitem) and isinstance(node.arg, jinja2.nodes.Slice):
        return _reads(node.node, name, key)
    if isinstance(node, jinja2.nodes.Getitem):
        return _is_name(node.node, name) and isinstance(node.arg, jinja2.nodes.Const) and node.arg.value == key
    if isinstance(node, jinja2.nodes.Getattr):
        return _is_name(node.node, name) and node.attr == key
    return False


def _is_name(node: jinja2.nodes.Node, name: str) -> bool:
    return isinstance(node, jinja2.nodes.Name) and node.ctx == "load" and node.name == name


def _bounded_join(chunks: Iterator[str]) -> str:
    """The rendered text, refused once it passes :data:`MAX_RENDERED_CHARS` (a template looping over
    ``range`` in ``range`` renders gigabytes)."""
    parts: list[str] = []
    size = 0
    for chunk in chunks:
        size += len(chunk)
        if size > MAX_RENDERED_CHARS:
            raise ChatTemplateError(f"the chat template rendered more than {MAX_RENDERED_CHARS} characters")
        parts.append(chunk)
    return "".join(parts)


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    """Hugging Face's ``tojson``, its keywords in its order; an undefined value (a field a message lacks) is
    ``null``."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys,
                      default=_undefined_as_null)


def _undefined_as_null(value: Any) -> None:
    if isinstance(value, jinja2.Undefined):
        return None
    raise TypeError(f"Object of type {type(value).__name__} is not JSON serializable")


class _GenerationTag(jinja2.ext.Extension):
    """Hugging Face's ``{% generation %}...{% endgeneration %}`` (its ``AssistantTracker``), which marks the
    assistant's tokens for training masks: rendering, it is its body."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.CallBlock:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("render_body"), [], [], body).set_lineno(lineno)

    def render_body(self, caller: Any) -> str:
        return caller()


@lru_cache(maxsize=8)
def _compile(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    env.filters["tojson"] = _tojson
    return env.from_string(source)
