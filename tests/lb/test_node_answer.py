"""What a fan-out's nodes answered, parsed once per distinct value (``lb/node_answer.py``)."""

from __future__ import annotations

import pytest

from handoff.service.peer_json import PeerJSONError
from lb.node_answer import ParsedAnswers


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
