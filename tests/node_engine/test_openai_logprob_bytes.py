"""A chat logprob's ``bytes`` on a SentencePiece-style vocabulary (a Llama checkpoint with a Llama-2-style
tokenizer: ``▁`` pieces, ``<0xNN>`` byte fallback), as SGLang 0.5.23 gives them
(``entrypoints/openai/serving_chat.py`` ``_build_token_logprobs_from_raw``): the GPT-2 byte alphabet is read only
for a byte-level tokenizer (``utils.py`` ``_is_byte_level_tokenizer``, ``token_id_to_bytes``); for any other the
bytes are the token's text in UTF-8, so ``é`` is ``[195, 169]``, never the alphabet's ``[233]``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

import openai
import pytest

from tests.node_engine.checkpoints import make_checkpoint
from tests.node_engine.tokenizer_kinds import FALLBACK_IDS, byte_fallback
from tests.support.procs import ServerProcess

pytestmark = pytest.mark.timeout(180)

TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
BYTE_C3 = 3 + 0xC3  # the tokenizer's <0xC3>


@pytest.fixture(scope="module")
def sdk(tmp_path_factory: pytest.TempPathFactory) -> Iterator[openai.OpenAI]:
    folder = tmp_path_factory.mktemp("sentencepiece")
    make_checkpoint(folder, "llama-mha-tied", shard=False)
    byte_fallback(folder)  # replaces the checkpoint's byte-level tokenizer
    config_file = folder / "tokenizer_config.json"
    config_file.write_text(json.dumps({**json.loads(config_file.read_text()), "chat_template": TEMPLATE}))
    proc = ServerProcess("node_engine", ["--model-path", str(folder), "--context-length", "256"],
                         log_dir=Path(folder))
    proc.start()
    try:
        with openai.OpenAI(base_url=proc.url + "/v1", api_key="unused", timeout=60, max_retries=0) as client:
            yield client
    finally:
        proc.stop()


@pytest.mark.parametrize(("token_id", "text", "expected"), [
    (FALLBACK_IDS["é"], "é", [195, 169]),  # the alphabet would read it as the byte 0xE9
    (BYTE_C3, "\ufffd", [239, 191, 189]),  # SGLang: the text of a lone byte token, U+FFFD
    (FALLBACK_IDS["▁Hello"], "Hello", list(b"Hello")),
])
def test_a_sentencepiece_tokens_bytes_are_its_texts_as_sglang_gives_them(sdk: openai.OpenAI, token_id: int,
                                                                          text: str, expected: list[int]) -> None:
    forced = {"max_tokens": 1, "temperature": 0, "logit_bias": {str(token_id): 100.0},
              "extra_body": {"ignore_eos": True}}
    chat = sdk.chat.completions.create(model="m", messages=[{"role": "user", "content": "ab"}], logprobs=True,
                                       **forced)
    (entry,) = chat.choices[0].logprobs.content
    assert (entry.token, entry.bytes) == (text, expected)
    completion = sdk.completions.create(model="m", prompt="ab", logprobs=0, **forced)
    assert completion.choices[0].logprobs.tokens == [text]  # the names stay SGLang's (_lossless_token_text)
