"""``continue_final_message`` on a chat, as SGLang 0.5.23 takes it (``serving_chat.py``
``_handle_last_assistant_message`` and ``_append_assistant_prefix_to_prompt_ids``), on the built-in tiny engine:
a last assistant message with text content is left out of the rendered template (which still ends with the
generation prompt), its text is tokenized with the tokenizer's special tokens and a leading BOS dropped, and
those ids end the prompt; the answer is the continuation alone. The byte-level tokenizer makes the expected
prompt easy to build independently: the template's ids, then the prefix's bytes."""

from __future__ import annotations

from typing import Any, Iterator

import httpx
import openai
import pytest

from node_engine.tokenizer import Tokenizer
from tests.support.procs import ServerProcess

pytestmark = pytest.mark.timeout(120)

USER = {"role": "user", "content": "hi"}
PREFIX = "The answer is"
GREEDY: dict[str, Any] = {"max_tokens": 8, "temperature": 0}


@pytest.fixture(scope="module")
def sdk(tiny_engine: ServerProcess) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=tiny_engine.url + "/v1", api_key="unused", timeout=60, max_retries=0) as client:
        yield client


def _expected_prompt() -> list[int]:
    """The prompt SGLang builds: the messages before the assistant's rendered with the generation prompt, then
    the prefix's tokens (its bytes: the BOS the tokenizer adds is dropped)."""
    return Tokenizer.builtin_bytes().apply_chat_template([USER]) + list(PREFIX.encode())


def _generate(url: str, ids: list[int]) -> str:
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}}
    r = httpx.post(url + "/generate", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["text"]


@pytest.mark.parametrize("content", [PREFIX, [{"type": "text", "text": "The answer"}, {"type": "text", "text": "is"}]])
def test_the_final_assistant_message_is_continued(sdk: openai.OpenAI, tiny_engine: ServerProcess,
                                                  content: Any) -> None:
    """Text parts reach a string template joined, so they are continued as text is (SGLang formats the content
    before it looks at the last message)."""
    ids = _expected_prompt()
    messages: Any = [USER, {"role": "assistant", "content": content}]
    extra = {"continue_final_message": True, "ignore_eos": True}
    whole = sdk.chat.completions.create(model="m", messages=messages, **GREEDY,
                                        extra_body={**extra, "return_prompt_token_ids": True})
    assert whole.usage is not None and whole.usage.prompt_tokens == len(ids)
    assert whole.choices[0].model_extra["prompt_token_ids"] == ids
    expected = _generate(tiny_engine.url, ids)
    assert whole.choices[0].message.content == expected  # the continuation alone, without the prefix
    chunks = list(sdk.chat.completions.create(model="m", messages=messages, stream=True, **GREEDY, extra_body=extra,
                                              stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected
    assert chunks[-1].usage is not None and chunks[-1].usage.prompt_tokens == len(ids)


def test_without_a_final_assistant_text_nothing_is_continued(sdk: openai.OpenAI) -> None:
    """A last user message is rendered as without the flag; ``false`` renders a last assistant text as the
    user's (SGLang: the prompt ends with the user's turn); an empty assistant text is left out, nothing added."""
    def prompt_tokens(messages: Any, flag: bool) -> int:
        answer = sdk.chat.completions.create(model="m", messages=messages, max_tokens=1,
                                             extra_body={"continue_final_message": flag})
        assert answer.usage is not None
        return answer.usage.prompt_tokens

    plain = len(Tokenizer.builtin_bytes().apply_chat_template([USER]))
    assert prompt_tokens([USER], True) == plain
    assert prompt_tokens([USER, {"role": "assistant", "content": PREFIX}], False) == \
        len(Tokenizer.builtin_bytes().apply_chat_template([USER, {"role": "user", "content": PREFIX}]))
    assert prompt_tokens([USER, {"role": "assistant", "content": ""}], True) == plain
    assert prompt_tokens([USER, {"role": "assistant", "content": None}], True) == plain
