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


# What Hugging Face's renderer (SGLang's, through ``tokenizer.apply_chat_template``) takes beyond plain Jinja:
# loop controls, the ``{% generation %}`` tag of assistant masks (SmolLM3's and laguna's templates, TRL's
# assistant-only loss) and ``tojson``'s keywords (GLM-4.5's and MiniCPM5's ``tojson(ensure_ascii=False)``).
HF_EXTENSIONS = (
    "{% for m in messages %}{% if m.role == 'system' %}{% continue %}{% endif %}"
    "{% if m.role == 'assistant' %}{% generation %}<a>{{ m.content }}</a>{% endgeneration %}"
    "{% else %}<u>{{ m.content }}</u>{% endif %}{% if loop.index0 >= 3 %}{% break %}{% endif %}{% endfor %}"
    "{% for t in tools %}{{ t | tojson(ensure_ascii=False) }}|{{ t | tojson(ensure_ascii=True) }}|"
    "{{ t | tojson(indent=2, sort_keys=True) }}{% endfor %}{% if add_generation_prompt %}<a>{% endif %}")


def test_templates_render_with_hugging_face_jinja_extensions_as_sglang_renders_them() -> None:
    from transformers.utils.chat_template_utils import render_jinja_template

    messages = [{"role": "system", "content": "s"}, {"role": "user", "content": "q é"},
                {"role": "assistant", "content": "r"}, {"role": "user", "content": "q2"},
                {"role": "assistant", "content": "cut by break"}]
    tools = [{"type": "function", "function": {"name": "météo", "parameters": {"b": 1, "a": "<&>"}}}]
    expected = render_jinja_template([messages], chat_template=HF_EXTENSIONS, tools=tools,
                                     add_generation_prompt=True)[0][0]
    assert render(HF_EXTENSIONS, messages, **kw(add_generation_prompt=True, tools=tools)) == expected
    assert '"météo"' in expected and "m\\u00e9t\\u00e9o" in expected and "cut by break" not in expected
