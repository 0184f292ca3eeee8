"""The names ``/v1/completions`` gives logprob tokens are SGLang 0.5.23's (a differential test).

:func:`sglang_name` is SGLang's own ``_lossless_token_text``, copied (pure Python) with the helpers it calls from
``sglang/srt/entrypoints/openai/utils.py`` (``_build_byte_decoder`` :29, ``token_id_to_bytes`` :96,
``_lossless_token_text`` :177; ``_is_byte_level_tokenizer`` :46 is true for the byte tokenizer, whose pieces are
all in the byte alphabet). The engine's route end to end: ``test_openai_sglang.py``.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from node_engine.server.openai_shapes import completion_logprobs
from node_engine.tokenizer import Tokenizer

TOKENIZER = Tokenizer.builtin_bytes()


def _build_byte_decoder() -> dict[str, int]:  # utils.py:29
    bs = (list(range(ord("!"), ord("~") + 1)) + list(range(ord(chr(0xA1)), ord(chr(0xAC)) + 1))
          + list(range(ord(chr(0xAE)), ord(chr(0xFF)) + 1)))
    cs = bs[:]
    n = 0
    for b in range(2**8):
        if b not in bs:
            bs.append(b)
            cs.append(2**8 + n)
            n += 1
    return dict(zip([chr(c) for c in cs], bs))


_BYTE_DECODER = _build_byte_decoder()


def _token_id_to_bytes(token_id: int) -> list[int] | None:  # utils.py:96
    piece = TOKENIZER._hf.id_to_token(token_id)  # convert_ids_to_tokens
    if piece is None:
        return None
    out = bytearray()
    for ch in piece:
        b = _BYTE_DECODER.get(ch)
        if b is None:
            return None
        out.append(b)
    return list(out) if out else None


def sglang_name(token_id: int, token_text: str | None) -> str:  # utils.py:177
    if token_text is not None and "\ufffd" not in token_text:
        return token_text
    raw = _token_id_to_bytes(token_id)
    if raw is None:
        return token_text if token_text is not None else ""
    try:
        bytes(raw).decode("utf-8")
        return token_text if token_text is not None else ""
    except UnicodeDecodeError:
        pass
    return bytes(raw).decode("latin-1")


@settings(max_examples=300, deadline=None)
@given(token_id=st.integers(0, TOKENIZER.vocab_size - 1), text=st.one_of(st.none(), st.just("\ufffd"), st.text()),
       decoded=st.booleans())
def test_completion_logprob_names_are_sglangs(token_id: int, text: str | None, decoded: bool) -> None:
    if decoded:  # the engine's own text for the token
        text = TOKENIZER.decode([token_id], skip_special_tokens=False)
    answer = completion_logprobs(TOKENIZER, [(-1.0, token_id, text)], [[(-1.0, token_id, text)]])
    assert answer["tokens"] == [sglang_name(token_id, text)]
    assert list(answer["top_logprobs"][0]) == [sglang_name(token_id, text)]
