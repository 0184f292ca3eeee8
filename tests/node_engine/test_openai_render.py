"""A whole OpenAI answer with logprobs is rendered by encoder calls of bounded size, so the event loop keeps its
turns while a thread renders it (``node_engine/server/openai_answer.py``): byte for byte what ``JSONResponse``
renders. The event loop's turns end to end: ``test_exhaustion.py``."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from starlette.responses import JSONResponse

from handoff.service.json_pieces import render_in_pieces

# JSON writes a key that is not a string as one (1 as "1", None as "null"), as JSONResponse does
_KEYS = st.text() | st.integers() | st.booleans() | st.none() | st.floats(allow_nan=False, allow_infinity=False)
_JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False)
                     | st.text(), lambda inner: st.lists(inner, max_size=600) | st.dictionaries(_KEYS, inner),
                     max_leaves=2000)


@settings(max_examples=200, deadline=None)
@given(value=_JSON)
def test_an_answer_rendered_in_pieces_is_what_json_response_renders(value: object) -> None:
    assert render_in_pieces(value).encode() == JSONResponse(value).body


def test_a_long_logprob_list_is_rendered_in_pieces_alike() -> None:
    entry = {"token": "a\u00e9\"", "bytes": [97, 195, 169, 34], "logprob": -0.5,
             "top_logprobs": [{"token": "b", "bytes": [98], "logprob": -1.25}] * 3}
    answer = {"id": "x", "choices": [{"index": i, "logprobs": {"content": [entry] * 1000}} for i in range(3)],
              "usage": {"prompt_tokens": 1, "prompt_tokens_details": None}}
    assert render_in_pieces(answer).encode() == JSONResponse(answer).body


def test_keys_that_are_not_strings_are_written_as_strings() -> None:
    answer = {"choices": [{"logprobs": {7: 1, None: 2, True: 3, 1.5: 4}}], 3: {"a": 1}}
    assert render_in_pieces(answer).encode() == JSONResponse(answer).body
