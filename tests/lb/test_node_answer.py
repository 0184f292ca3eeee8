"""What a fan-out's nodes answered, parsed once per distinct value (``lb/node_answer.py``)."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from starlette.responses import JSONResponse

from handoff.service.peer_json import PeerJSONError
from lb.node_answer import ParsedAnswers, dumps_answer

JSON_LEAVES = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text()
JSON_VALUES = st.recursive(JSON_LEAVES, lambda inner: st.lists(inner, max_size=4)
                           | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=20)


def test_the_same_body_is_parsed_once_and_shared() -> None:
    parsed = ParsedAnswers()
    first = parsed.body(b'{"success": true, "released": ["weights"]}')
    assert parsed.body(b'{"success": true, "released": ["weights"]}') is first
    assert parsed.body(b'{"success": true, "released": []}') is not first


def test_an_unreadable_body_fails_every_time_with_its_own_error() -> None:
    parsed = ParsedAnswers()
    raised = []
    for _ in range(3):
        with pytest.raises(PeerJSONError, match="not valid JSON") as info:
            parsed.body(b'{"freed": Infinity}')
        raised.append(info.value)
    assert len({id(error) for error in raised}) == 3  # no traceback piles up on one shared exception


@pytest.mark.parametrize("value", [None, "[1, 2]", "{not json", "\u0100"])
def test_a_missing_or_unreadable_state_is_none(value: str | None) -> None:
    assert ParsedAnswers().state(value) is None


def test_the_same_state_is_shared() -> None:
    parsed = ParsedAnswers()
    state = parsed.state('{"serving": true}')
    assert state == {"serving": True} and parsed.state('{"serving": true}') is state


@st.composite
def fanout_answers(draw: st.DrawFn) -> dict:
    """A fan-out's answer as :class:`lb.fanout.FanOut` and the weight routes build it: result entries whose
    bodies are often one shared object, scalar fields, and anything else a route adds."""
    bodies = draw(st.lists(JSON_VALUES, min_size=1, max_size=3))
    entry = st.fixed_dictionaries(
        {"node": st.text(), "role": st.sampled_from(["mixed", "prefill", "decode"])},
        optional={"status": st.integers(100, 599) | st.none(), "body": st.sampled_from(bodies) | JSON_VALUES,
                  "reason": st.text(), "error": st.text(), "detail": st.text(), "rank_offset": st.integers(0, 1 << 40),
                  "extra": JSON_VALUES})
    payload = draw(st.dictionaries(st.text(max_size=8), JSON_VALUES, max_size=3))
    for key in draw(st.sets(st.sampled_from(["results", "failures", "succeeded", "rolled_back"]))):
        payload[key] = draw(st.lists(entry | JSON_VALUES, max_size=6))
    return payload


@settings(max_examples=400, deadline=None)
@given(fanout_answers())
def test_a_fanout_answer_encodes_as_json_response_would(payload: dict) -> None:
    """Differential: the encoder that shares bodies writes exactly the bytes of Starlette's JSONResponse."""
    assert dumps_answer(payload) == JSONResponse(payload).body


def test_a_shared_body_is_in_every_entry_and_nan_is_refused_as_before() -> None:
    body = {"success": True, "released": ["weights"], "duration_s": 0.25}
    payload = {"success": True, "total": 3, "results": [{"node": f"n{i}", "status": 200, "body": body} for i in range(3)]}
    assert dumps_answer(payload).count(b'"released":["weights"]') == 3
    for bad in ({"x": math.nan}, {"results": [{"body": {"freed": math.inf}}]}):
        with pytest.raises(ValueError):
            JSONResponse(bad)
        with pytest.raises(ValueError):
            dumps_answer(bad)
