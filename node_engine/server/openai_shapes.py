"""The OpenAI answers' pieces built from SGLang's answer lists (SGLang 0.5.23, ``entrypoints/openai``).

Completions: ``logprobs`` is ``{"tokens", "token_logprobs", "top_logprobs",
"text_offset"}`` (``text_offset`` -1 throughout, as SGLang answers it; with
``echo`` the prompt's entries come first, its first token's logprob ``null``;
a token that is part of a character is named by its bytes read as latin-1,
SGLang's ``_lossless_token_text``, so fragments keep distinct names).
Chat: ``logprobs`` is ``{"content": [{"token", "bytes", "logprob",
"top_logprobs": [{"token", "bytes", "logprob"}]}]}``. Usage counts each
prompt once, however many samples it has.
"""

from __future__ import annotations

from typing import Any, Sequence

from handoff.protocol.generation import LogprobEntry, SequenceAnswer, SequenceChunk
from node_engine.tokenizer import Tokenizer

TopRow = list[LogprobEntry] | None


def usage(answers: Sequence[SequenceAnswer | SequenceChunk], n: int) -> dict[str, Any]:
    """``usage`` of the sequences in SGLang's order (``n`` per prompt), with every key of SGLang's ``UsageInfo``
    (``protocol.py``): ``reasoning_tokens`` 0 and both details null, as SGLang answers them without a reasoning
    parser or ``--enable-cache-report``."""
    prompt = sum(a.prompt_tokens for i, a in enumerate(answers) if i % n == 0)
    completion = sum(a.completion_tokens for a in answers)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": None, "reasoning_tokens": 0, "completion_tokens_details": None}


def completion_logprobs(tokenizer: Tokenizer, tokens: Sequence[LogprobEntry], tops: Sequence[TopRow] | None,
                        ) -> dict[str, Any]:
    return {"text_offset": [-1] * len(tokens),
            "token_logprobs": [entry[0] for entry in tokens],
            "tokens": [_lossless_text(tokenizer, entry) for entry in tokens],
            "top_logprobs": [None if row is None else {_lossless_text(tokenizer, entry): entry[0] for entry in row}
                             for row in tops or []]}


def _lossless_text(tokenizer: Tokenizer, entry: LogprobEntry) -> str:
    """A completions logprob's token name (SGLang 0.5.23 ``entrypoints/openai/utils.py`` ``_lossless_token_text``):
    its text, unless that holds U+FFFD and the token's bytes are not UTF-8 (part of a character), then those bytes
    read as latin-1, one character per byte, so two fragments never share the name U+FFFD."""
    text = entry[2]
    if text is not None and "\ufffd" not in text:
        return text
    raw = tokenizer.token_bytes(entry[1])
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError:
        return raw.decode("latin-1")
    return text or ""


def _token(tokenizer: Tokenizer, entry: LogprobEntry) -> dict[str, Any]:
    return {"token": entry[2], "bytes": list(tokenizer.token_bytes(entry[1])), "logprob": entry[0]}


def chat_logprobs(tokenizer: Tokenizer, tokens: Sequence[LogprobEntry], tops: Sequence[TopRow] | None,
                  ) -> dict[str, Any]:
    # a row per token, as SGLang's _build_token_logprobs_from_raw reads them: a max_new_tokens 0 answer has the
    # top row after the prompt (SGLang's scoring request) and no token, so no entry
    rows = list(tops or [])[:len(tokens)]
    rows += [None] * (len(tokens) - len(rows))
    return {"content": [{**_token(tokenizer, entry), "top_logprobs": [_token(tokenizer, e) for e in row or []]}
                        for entry, row in zip(tokens, rows, strict=True)]}
