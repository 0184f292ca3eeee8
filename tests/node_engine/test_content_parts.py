"""A chat message's content parts as SGLang 0.5.23 gives them to the chat template, on real engine processes:
one template loops over a message's content (SGLang's ``"openai"`` content format), the other prints it whole
(``"string"``). Each part keeps its model's fields; thinking parts reach no template; ``tool_reference`` parts
reach an ``"openai"`` template; video and audio are ``unsupported``; a ``reasoning`` object is read as SGLang's
``normalize_reasoning_inputs`` reads it.

The tokenizer is byte-level, so the prompt's ids are the rendered text's bytes.
"""

from __future__ import annotations

from typing import Any, Iterator

import httpx
import pytest

from tests.node_engine.checkpoints import CHAT_USER, post_chat, rendered_prompt, templated_engine
from tests.support.procs import ServerProcess

pytestmark = pytest.mark.timeout(120)

END = "{% if add_generation_prompt %}<assistant>{% endif %}{% if enable_thinking %}<think>{% endif %}"
PARTS_TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{% if m['content'] is string %}S{{ m['content'] }}"
                  "{% else %}L{% for p in m['content'] %}{{ p | tojson }}{% endfor %}{% endif %}{% endfor %}" + END)
STRING_TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] | tojson }}{% endfor %}" + END
USER = CHAT_USER
HISTORY = [
    {"role": "user", "content": [{"type": "text", "text": "a", "cache_control": {"type": "ephemeral"}},
                                 {"type": "text", "text": "b"}]},
    {"role": "assistant", "content": [{"type": "thinking", "thinking": "hmm", "signature": "s"},
                                      {"type": "text", "text": "c"},
                                      {"type": "tool_reference", "name": "weather", "extra": 1}]},
    {"role": "assistant", "content": [{"type": "reasoning", "text": "r"}]},
    {"role": "tool", "tool_call_id": "c1", "content": [{"type": "text", "text": "t1"}, {"type": "text", "text": "t2"}]},
    {"role": "tool", "tool_call_id": "c2", "content": [{"type": "tool_reference", "name": "weather"}]},
    {"role": "user", "content": []},
    USER]


def _engine(tmp_path_factory: pytest.TempPathFactory, name: str, template: str) -> Iterator[ServerProcess]:
    proc = templated_engine(tmp_path_factory.mktemp(name), template, 512)
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def parts_engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    yield from _engine(tmp_path_factory, "parts_template", PARTS_TEMPLATE)


@pytest.fixture(scope="module")
def string_engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    yield from _engine(tmp_path_factory, "string_template", STRING_TEMPLATE)


@pytest.fixture
def client(parts_engine: ServerProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=parts_engine.url, timeout=60) as c:
        yield c


def refused(client: httpx.Client, kind: str, **body: Any) -> str:
    r = post_chat(client, **body)
    assert r.status_code == 400 and r.json()["error"]["type"] == kind, r.text
    return r.json()["error"]["message"]


def test_parts_reach_a_template_that_loops_over_them_as_sglang_gives_them(client: httpx.Client) -> None:
    """SGLang's ``process_content_for_template_format`` ("openai"): a text part is ``{type, text}`` alone, a
    ``tool_reference`` part its model's fields, a thinking part nothing; a tool message's text parts are joined
    (``normalize_tool_content``), its other parts stay a list; an empty list stays a list."""
    assert rendered_prompt(client, messages=HISTORY) == (
        '<user>L{"type": "text", "text": "a"}{"type": "text", "text": "b"}'
        '<assistant>L{"type": "text", "text": "c"}{"type": "tool_reference", "name": "weather"}'
        '<assistant>L<tool>St1 t2<tool>L{"type": "tool_reference", "name": "weather"}<user>L<user>Shi<assistant>')


def test_parts_reach_a_template_that_prints_content_joined(string_engine: ServerProcess) -> None:
    """SGLang's "string" format: the text parts joined with single spaces, every other part left out."""
    with httpx.Client(base_url=string_engine.url, timeout=60) as c:
        assert rendered_prompt(c, messages=HISTORY) == (
            '<user>"a b"<assistant>"c"<assistant>""<tool>"t1 t2"<tool>""<user>""<user>"hi"<assistant>')


@pytest.mark.parametrize("content, role, message", [
    ([{"type": "thinking", "thinking": "x"}], "user", "thinking content parts are only valid in assistant"),
    ([{"type": "reasoning", "text": "x"}], "system", "thinking content parts are only valid in assistant"),
    ([{"type": "thinking", "thinking": "x", "text": "y"}], "assistant", "exactly one of 'thinking' or 'text'"),
    ([{"type": "thinking"}], "assistant", "exactly one of 'thinking' or 'text'"),
    ([{"type": "input_text", "text": "x"}], "user", "does not match any of the expected tags"),
    ([{"type": "text", "text": 1}], "user", "content.parts.0.text.text"),
    ([{"type": "text"}], "user", "content.parts.0.text.text"),
    ([{"type": "tool_reference"}], "user", "content.parts.0.tool_reference.name"),
    ([{"type": "image_url", "image_url": "data:image/png;base64,AAAA"}], "user", "image_url"),
    ([{"type": "image_url", "image_url": {"url": "data:,", "detail": "max"}}], "user", "detail"),
    ([{"type": "video_url", "video_url": {}}], "user", "video_url.url"),
    ([{"type": "input_audio", "input_audio": {"data": "AAAA", "format": "ogg"}}], "user", "format"),
    (["hi"], "user", "content.parts.0"),
])
def test_malformed_parts_are_400s_as_sglang_checks_them(client: httpx.Client, content: list, role: str,
                                                         message: str) -> None:
    assert message in refused(client, "invalid_request", messages=[{"role": role, "content": content}, USER])


@pytest.mark.parametrize("part", [{"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAA"}},
                                  {"type": "audio_url", "audio_url": {"url": "data:audio/wav;base64,AAAA"}},
                                  {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}])
def test_video_and_audio_parts_are_unsupported(client: httpx.Client, part: dict) -> None:
    """The engine takes text and images: SGLang's model-level refusal (``_validate_media_content``), typed as
    what the engine lacks rather than a malformed request."""
    message = refused(client, "unsupported", messages=[{"role": "user", "content": [{"type": "text", "text": "x"},
                                                                                     part]}])
    assert message.startswith(f"messages.0.content.1: {part['type']} parts are not supported"), message


def test_image_fields_the_engine_cannot_honour_are_unsupported(client: httpx.Client) -> None:
    image = {"url": "data:image/png;base64,AAAA", "max_long_side_pixel": 512}
    message = refused(client, "unsupported", messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": image}]}])
    assert message.startswith("messages.0.content.0.image_url.max_long_side_pixel"), message


def test_a_reasoning_object_is_read_as_sglang_reads_it(client: httpx.Client) -> None:
    """SGLang's ``normalize_reasoning_inputs``: ``reasoning.enabled`` turns on ``thinking`` and ``enable_thinking``
    unless ``chat_template_kwargs`` sets them; ``reasoning.effort`` is ``reasoning_effort`` (refused here: no
    reasoning models); anything but an object is read as nothing."""
    plain = rendered_prompt(client)
    assert rendered_prompt(client, reasoning={"enabled": True}) == plain + "<think>"
    assert rendered_prompt(client, reasoning={"enable": "yes"}) == plain + "<think>"
    kwargs_win = rendered_prompt(client, reasoning={"enabled": True}, chat_template_kwargs={"enable_thinking": False})
    assert kwargs_win == plain
    assert rendered_prompt(client, reasoning={"enabled": False}) == rendered_prompt(client, reasoning="high") == plain
    assert refused(client, "unsupported", reasoning={"effort": "high"}).startswith("reasoning_effort")
    assert "invalid reasoning effort" in refused(client, "invalid_request", reasoning={"effort": "huge"})
