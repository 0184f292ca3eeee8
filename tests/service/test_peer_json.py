"""A peer's JSON is parsed within bounds: the depth check agrees with the parsed value's real depth."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from handoff.service.peer_json import PeerJSONError, loads_bounded, nests_deeper_than

# strings full of brackets, quotes and backslashes: the check must skip them
TRICKY_TEXT = st.text(alphabet='[]{}"\\ab\u2028', max_size=6)
VALUES = st.recursive(st.none() | st.integers() | TRICKY_TEXT,
                      lambda inner: st.lists(inner, max_size=3) | st.dictionaries(TRICKY_TEXT, inner, max_size=3),
                      max_leaves=40)


def depth(value: object) -> int:
    if isinstance(value, list):
        return 1 + max((depth(v) for v in value), default=0)
    if isinstance(value, dict):
        return 1 + max((depth(v) for v in value.values()), default=0)
    return 0


@settings(max_examples=400, deadline=None)
@given(VALUES)
def test_depth_check_matches_the_value(value: object) -> None:
    raw = json.dumps(value).encode()
    real = depth(value)
    assert not nests_deeper_than(raw, real)
    if real:
        assert nests_deeper_than(raw, real - 1)
    assert loads_bounded(raw, max_depth=max(real, 1)) == value


@pytest.mark.parametrize("raw", [b"[" * 1_000_000 + b"]" * 1_000_000, b'{"a":' * 200_000 + b"1" + b"}" * 200_000,
                                 b"[" * 5000])
def test_deep_or_broken_nesting_is_one_clear_error(raw: bytes) -> None:
    with pytest.raises(PeerJSONError, match="more than 64 deep"):
        loads_bounded(raw)


def test_size_and_syntax_are_checked() -> None:
    with pytest.raises(PeerJSONError, match="over the 10-byte limit"):
        loads_bounded(b'{"success": false}', max_bytes=10)
    for bad in (b"{", b"\xff", b"nan!", b"[1]]", b"NaN", b'{"a": [Infinity]}', b"-Infinity", b"1e999",
                b'{"freed": -1.5e400}', b"[1E+400]", b"1" + b"0" * 400 + b".5", b'["\\ud800"]', b'{"\\udfff": 1}',
                b'["a\\ud83d"]'):
        with pytest.raises(PeerJSONError, match="not valid JSON"):
            loads_bounded(bad)
    assert loads_bounded(b'[1e308, -0.0, 5e-324, 12345678901234567890]') == [1e308, -0.0, 5e-324, 12345678901234567890]
    assert loads_bounded(b'["\\ud83d\\ude00", "\\\\ud800"]') == ["\U0001f600", "\\ud800"]  # a pair; a backslash


@pytest.mark.timeout(20)
@pytest.mark.parametrize("raw", [b'["' + b"a" * 2_000_000, b"[" * 70 + b'"\\' * 1_000_000,
                                 b"[" * 70 + b'"[' * 1_000_000, b"[" * 70 + b'a"' * 1_000_000],
                         ids=["unterminated", "quote-backslash", "openers-in-strings", "alternating"])
def test_no_input_makes_the_check_quadratic(raw: bytes) -> None:
    """Megabytes of quotes and backslashes are refused in one linear pass (a backtracking scan took minutes)."""
    with pytest.raises(PeerJSONError):
        loads_bounded(raw)


@pytest.mark.parametrize("raw", [b"[2" + b"0" * 250 + b"e60]", b'{"a": -' + b"9" * 300 + b'.5e9}',
                                 b"[2" + b"0" * 209 + b"e99]"])
def test_a_float_past_its_range_without_a_long_exponent_is_refused(raw: bytes) -> None:
    """``2`` and 250 zeros ``e60`` is 2e310: past a double's range with neither a 3-digit exponent nor 309
    digits in a row, so it was read as ``inf`` (found by review)."""
    with pytest.raises(PeerJSONError, match="not valid JSON"):
        loads_bounded(raw)
    assert loads_bounded(b"[" + b"9" * 209 + b"e99]") == [float("9" * 209 + "e99")]  # just within: kept


def test_a_lone_surrogate_in_utf8_bytes_is_refused() -> None:
    """``json.loads`` decodes bytes with ``surrogatepass``: a peer's UTF-8 for U+D800 (``ED A0 80``, no escape to
    look for) was read as a lone surrogate, and the LB's ``/get_server_info`` answer built from it could not be
    written (a 500, not the 502 naming the node). Bytes are strict UTF-8 now (found by review)."""
    for raw in (b'["\xed\xa0\x80"]', b'{"\xed\xb0\x80": 1}', b'\xff\xfe[\x001\x00]\x00'):  # the last: UTF-16
        with pytest.raises(PeerJSONError, match="not valid JSON"):
            loads_bounded(raw)
    assert loads_bounded('["\U0001f600"]'.encode()) == ["\U0001f600"]


@pytest.mark.parametrize("raw", [b"[" * 65 + b"]" * 65, b"[" * 100_000 + b"]" * 100_000, b"[1e999]", b"[-1e400]",
                                 b'{"a": [NaN]}', b"[1, 2", b'"\\ud800"'])
def test_parsing_in_turns_refuses_what_the_byte_scans_refuse(raw: bytes) -> None:
    """``in_turns`` (a thread parsing a large answer) measures the nesting on the value and reads every float
    through Python instead of scanning the bytes: the same bodies are refused."""
    with pytest.raises(PeerJSONError):
        loads_bounded(raw, in_turns=True)
    assert loads_bounded(b"[" * 64 + b"1.5e3, 7" + b"]" * 64, in_turns=True) == \
        loads_bounded(b"[" * 64 + b"1.5e3, 7" + b"]" * 64)
