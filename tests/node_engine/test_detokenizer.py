"""The incremental detokenizer against the tokenizer's own decode and SGLang's stop-string rule, by random
cases (hypothesis) on three kinds of tokenizer: the built-in byte tokenizer, a byte-level BPE whose tokens
split multi-byte characters, and a Llama-2-style one with byte fallback.

The reference of a stop string is SGLang 0.5.23's check after each token (``Req._check_str_based_finish``)
on the whole output instead of its token window: the first stop string of the request's list that the
output, decoded with special tokens shown, holds ends the request at that token; the text (decoded with
the request's ``skip_special_tokens``) is cut at its first occurrence, or kept whole when it does not hold
it (``trim_matched_stop``).
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from node_engine.detokenizer import IncrementalDetokenizer
from node_engine.tokenizer import Tokenizer
from tests.node_engine.tokenizer_kinds import BYTES, all_kinds

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Tokenizer]:
    return all_kinds(tmp_path_factory.mktemp("tokenizers"))


def run(tokenizer: Tokenizer, ids: list[int], stop: tuple[str, ...] = (), *, skip: bool = True,
        no_stop_trim: bool = False) -> tuple[str, str | None, int, list[str]]:
    """(text, matched stop, tokens taken, stream deltas) as the engine drives a detokenizer."""
    detok = IncrementalDetokenizer(tokenizer, stop, skip_special_tokens=skip, no_stop_trim=no_stop_trim)
    deltas, taken = [], 0
    for token in ids:
        detok.add(token)
        taken += 1
        if detok.matched_stop is not None:
            break
        deltas.append(detok.take_delta(is_final=False))
    detok.finish()
    deltas.append(detok.take_delta(is_final=True))
    return detok.text, detok.matched_stop, taken, deltas


def reference(tokenizer: Tokenizer, ids: list[int], stop: tuple[str, ...], *, skip: bool,
              no_stop_trim: bool) -> tuple[str, str | None, int]:
    for taken in range(1, len(ids) + 1):
        shown = tokenizer.decode(ids[:taken], skip_special_tokens=False)
        matched = next((s for s in stop if s in shown), None)
        if matched is not None:
            text = tokenizer.decode(ids[:taken], skip_special_tokens=skip)
            at = text.find(matched)
            if at != -1:
                text = text[:at + len(matched)] if no_stop_trim else text[:at]
            return text, matched, taken
    return tokenizer.decode(ids, skip_special_tokens=skip), None, len(ids)


def ids_of(tokenizer: Tokenizer) -> st.SearchStrategy[list[int]]:
    return st.lists(st.integers(0, tokenizer.vocab_size - 1), max_size=40)


@pytest.mark.parametrize("kind", ["bytes", "bpe", "byte_fallback"])
@SETTINGS
@given(data=st.data(), skip=st.booleans())
def test_text_is_the_tokenizers_own_decode_streamed_or_not(tokenizers, kind, data, skip) -> None:
    tokenizer = tokenizers[kind]
    ids = data.draw(ids_of(tokenizer))
    text, _, _, deltas = run(tokenizer, ids, skip=skip)
    assert text == "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=skip)
    lazy = IncrementalDetokenizer(tokenizer, is_lazy=True, skip_special_tokens=skip)
    for token in ids:
        lazy.add(token)
    lazy.finish()
    assert lazy.text == text


@pytest.mark.parametrize("kind", ["bytes", "bpe"])
@SETTINGS
@given(data=st.data(), skip=st.booleans(), no_stop_trim=st.booleans())
def test_stop_strings_end_a_request_where_sglang_would(tokenizers, kind, data, skip, no_stop_trim) -> None:
    tokenizer = tokenizers[kind]
    ids = data.draw(ids_of(tokenizer))
    shown = tokenizer.decode(ids, skip_special_tokens=False).replace("\ufffd", "")
    # stop strings taken from the output itself (so that they match), and some that never do
    pieces = st.builds(lambda a, n: shown[a:a + n], st.integers(0, max(0, len(shown) - 1)), st.integers(1, 6))
    stop = tuple(s for s in data.draw(st.lists(st.one_of(pieces, st.sampled_from(["zz", "世", "<eos>"])),
                                               min_size=1, max_size=4)) if s)
    if not stop:
        return
    text, matched, taken, deltas = run(tokenizer, ids, stop, skip=skip, no_stop_trim=no_stop_trim)
    assert (text, matched, taken) == reference(tokenizer, ids, stop, skip=skip, no_stop_trim=no_stop_trim)
    assert "".join(deltas) == text  # nothing streamed was taken back


# -- the cases a review found, by name --------------------------------------------------------------------

def _token_with(tokenizer: Tokenizer, head: str) -> int:
    """A BPE token holding ``head`` and the first bytes of another character."""
    for token_id in range(tokenizer.vocab_size):
        text = tokenizer.decode([token_id])
        if text.startswith(head) and text.endswith("\ufffd") and len(text) == len(head) + 1:
            return token_id
    pytest.skip(f"no token holds {head!r} and part of another character")


def test_a_stop_string_ending_before_a_partial_character_stops_at_once(tokenizers) -> None:
    """Found by review: the decode ended in U+FFFD, so the stop string was looked for only once the
    character was complete, a token (or the whole request) late, with the wrong finish reason."""
    bpe = tokenizers["bpe"]
    token = _token_with(bpe, "世")
    text, matched, taken, _ = run(bpe, [token, token, token], ("世",))
    assert (text, matched, taken) == ("", "世", 1)


def test_a_stop_string_naming_a_special_token_stops_as_in_sglang() -> None:
    """Found by review: stop strings were looked for in the text without special tokens, so a stop string
    naming one (``<|im_end|>`` on a base model) never stopped; SGLang looks with them shown."""
    special = BYTES.encode("<reserved_0>", add_special_tokens=False)
    assert len(special) == 1 and special[0] >= 256
    text, matched, taken, _ = run(BYTES, [65, special[0], 66], ("<reserved_0>",))
    assert (text, matched, taken) == ("A", "<reserved_0>", 2)
    # and a special token between two characters hides a stop string from SGLang's check, as here
    text, matched, _, _ = run(BYTES, [97, special[0], 98, 67], ("ab",))
    assert (text, matched) == ("abC", None)


def test_the_first_stop_string_of_the_list_wins_as_in_sglang() -> None:
    assert run(BYTES, list(b"xab"), ("b", "xab"))[:3] == ("xa", "b", 3)
    assert run(BYTES, list(b"xab"), ("xab", "b"))[:3] == ("", "xab", 3)
    assert run(BYTES, list(b"xab"), ("ab", "a"), no_stop_trim=True)[:3] == ("xa", "a", 2)


def test_a_byte_fallback_run_renders_the_same_streamed_or_not(tokenizers) -> None:
    """Found by review: ``<0xC3><0xA9>`` streamed "é", then a stray byte made the decoder render the whole run
    as U+FFFD: the stream said "é���" where the answer said "����"."""
    tokenizer = tokenizers["byte_fallback"]
    run_ids = [3 + 0xC3, 3 + 0xA9, 3 + 0xA9, 3 + 0xA9]
    text, _, _, deltas = run(tokenizer, run_ids)
    assert "".join(deltas) == text == tokenizer.decode(run_ids) == "\ufffd" * 4


def test_a_stream_holds_back_only_what_could_begin_a_stop_string() -> None:
    detok = IncrementalDetokenizer(BYTES, ("Observation:",))
    deltas = []
    for token in b"AAAObs":
        detok.add(token)
        deltas.append(detok.take_delta(is_final=False))
    assert deltas == ["A", "A", "A", "", "", ""]
    detok.add(ord("!"))
    assert detok.take_delta(is_final=False) == "Obs!"
