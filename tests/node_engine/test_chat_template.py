"""Chat templates as SGLang renders them (``node_engine/chat_template.py``): content format detection, the
extra variables, and errors that stay the request's."""

from __future__ import annotations

import pytest

from node_engine.chat_template import ChatTemplateError, content_format, render
from node_engine.tokenizer import BUILTIN_CHAT_TEMPLATE, BUILTIN_VL_CHAT_TEMPLATE

LOOPS_OVER_CONTENT = ("{% for message in messages %}{% for part in message['content'] %}{{ part['text'] }}"
                      "{% endfor %}{% endfor %}")
LOOPS_WITH_FILTER = "{% for m in messages %}{% for c in m.content | list %}{{ c }}{% endfor %}{% endfor %}"
TOOL_CALLS = ("{% for m in messages %}{{ m['role'] }}:{% if m.tool_calls %}{{ m.tool_calls[0].function.arguments "
              "| tojson }}{% endif %}{{ m.content }};{% endfor %}")
THINKING = "{% if enable_thinking %}<think>{% endif %}{{ messages[0]['content'] }}"


@pytest.mark.parametrize(("source", "expected"), [
    (BUILTIN_CHAT_TEMPLATE, "string"), (BUILTIN_VL_CHAT_TEMPLATE, "openai"), (LOOPS_OVER_CONTENT, "openai"),
    (LOOPS_WITH_FILTER, "openai"), (TOOL_CALLS, "string"), ("{% for %}", "string"),
])
def test_content_format_is_detected_as_sglang_does(source: str, expected: str) -> None:
    assert content_format(source) == expected


def kw(**extra: object) -> dict[str, object]:
    return {"add_generation_prompt": False, "bos_token": "", "eos_token": "", **extra}


def test_template_kwargs_reach_the_template_but_never_replace_its_variables() -> None:
    messages = [{"role": "user", "content": "hi"}]
    assert render(THINKING, messages, **kw(template_kwargs={"enable_thinking": True})) == "<think>hi"
    assert render(THINKING, messages, **kw()) == "hi"
    with pytest.raises(ChatTemplateError, match="may not set 'messages'"):
        render(THINKING, messages, **kw(template_kwargs={"messages": []}))


def test_what_a_template_raises_on_the_messages_is_a_template_error() -> None:
    no_arguments = [{"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f"}}]}]
    assert render(TOOL_CALLS, no_arguments, **kw()) == "assistant:null;"  # an undefined field is null in tojson
    with pytest.raises(ChatTemplateError, match="rejected the messages"):
        render(TOOL_CALLS, [{"role": "assistant", "content": "", "tool_calls": "abc"}], **kw())
    with pytest.raises(ChatTemplateError, match="could not render the messages .TypeError"):
        render("{{ messages[0]['content'] + 1 }}", no_arguments, **kw())
    with pytest.raises(ChatTemplateError, match="rejected the messages"):
        render("{{ raise_exception('no system messages') }}", no_arguments, **kw())
