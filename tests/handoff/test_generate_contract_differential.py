"""``/generate`` bodies: handoff's schema takes exactly what SGLang 0.5.23's JSON contract takes (a differential test).

The reference is SGLang's own generated decoder (``tests/support/sglang_api_types.py``, vendored from the wheel):
``GenerateRequest.from_json_value`` is the check ``http_server.py`` ``generate_request`` runs on every body
(``entrypoints/api_contract.py``); a ``JsonContractError`` is its 400. Handoff's side is the body model
(:class:`GenerateBody`) and :func:`refuse_unsupported`, never the engine's later semantic checks (ids in the
vocabulary, ``n`` >= 1, ...). Left out, each a choice ``docs/api.md`` names:

- a body handoff answers 400 ``unsupported`` (a ``default only`` field set) where SGLang takes it;
- ``sampling_params.seed``, handoff's earlier name of ``sampling_seed`` (SGLang: unknown field, 400);
- ``image_data``: its shape is checked when its images are read (``generate_sequences``), not by the body model;
- fields SGLang's contract does not know but its ``GenerateReqInput`` does (``model``, ``log_metrics``, ...): the
  contract ignores them, so it is no reference for their types.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from handoff.protocol import errors as E
from handoff.protocol.generate_request import GenerateBody, GenerateFieldError, refuse_unsupported
from tests.support.sglang_api_types import (_FIELDS_SamplingParams, GenerateRequest, JsonContractError,
                                            SamplingParams)

TOP_FIELDS = tuple(name for name in GenerateRequest.__struct_fields__ if name != "image_data")
SAMPLING_FIELDS = tuple(name for name in _FIELDS_SamplingParams)
UNKNOWN = ("surprise", "temprature", "max_tokens", "prompt", "seed_", "", "x" * 300, "é", "sampling-params")
# JSON values of every type each field might be given: right, wrong, edge (null, bool for int, 4.0 for 4, past
# int64, empty and nested lists, lists of mixed types, maps)
POOL: tuple[Any, ...] = (
    None, True, False, 0, 4, -1, 4.0, 0.5, -0.0, 1e308, 2**63, -(2**63) - 1, 2**70, "", "a", "4", [], [1], [1, 2],
    [0], ["a"], [""], [True], [None], [[1], [2]], [[]], [1, "a"], [1, [2]], [[1], 2], [["a"]], [["a"], ["b"]],
    [4.0], [2**64], [None, "a"], ["a", None], [None, 1], [[None]], {}, {"a": 1.0}, {"a": "b"}, {"a": None},
    {"a": 1}, {"enabled": True}, {"prefix": "p"}, [{}], [{}, None], [{"max_new_tokens": 1}])


def sglang_takes(body: Any) -> bool:
    try:
        GenerateRequest.from_json_value(body)
    except JsonContractError:
        return False
    return True


def handoff_takes(body: Any) -> bool | None:
    """True / False as handoff's body model and field check answer; None: a deliberate 400 ``unsupported``."""
    if not isinstance(body, dict):
        return False
    try:
        parsed = GenerateBody.model_validate(body)
    except ValidationError:
        return False
    try:
        refuse_unsupported(parsed)
    except GenerateFieldError as exc:
        if exc.kind is E.UNSUPPORTED:
            return None
        return False
    return True


def disagreement(body: Any) -> str | None:
    sglang, handoff = sglang_takes(body), handoff_takes(body)
    if handoff is None and sglang:
        return None  # a default-only field set: handoff refuses what it cannot do, by design
    if bool(handoff) != sglang:
        return f"SGLang {'takes' if sglang else 'refuses'}, handoff {'takes' if handoff else 'refuses'}: {body!r}"
    return None


def _by_field(found: dict[tuple[int, str], str]) -> str:
    """One line per field and verdict: how many bodies, and the first."""
    groups: dict[str, list[str]] = {}
    for field, line in sorted(found.items()):
        groups.setdefault(f"{field[1]}  {line.split(':')[0]}", []).append(line)
    return "\n".join(f"{key}: {len(lines)} bodies, e.g. {lines[0].split(': ', 1)[1][:120]}"
                     for key, lines in groups.items())


@pytest.fixture(autouse=True)
def _quiet_ignored_fields(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.ERROR, logger="handoff.protocol.ignored_fields")


def test_every_field_with_every_kind_of_value_alone() -> None:
    """Each field of SGLang's GenerateRequest and SamplingParams, and unknown keys at both levels, given each value
    of :data:`POOL` (a single prompt, and a batch of two)."""
    found: dict[tuple[int, str], str] = {}
    for prompt in ({"text": "x"}, {"input_ids": [[1], [2]]}):
        for i, value in enumerate(POOL):
            for name in TOP_FIELDS + UNKNOWN:
                body = {name: value} if name in ("text", "input_ids") else {**prompt, name: value}
                if (line := disagreement(body)) is not None:
                    found[(i, name if name in TOP_FIELDS else "(unknown key)")] = line
            for name in SAMPLING_FIELDS + UNKNOWN:
                field = f"sampling_params.{name if name in SAMPLING_FIELDS else '(unknown key)'}"
                for params in ({name: value}, [{}, {name: value}]):
                    if (line := disagreement({**prompt, "sampling_params": params})) is not None:
                        found[(i, field)] = line
    assert not found, f"{len(found)} bodies judged otherwise than SGLang:\n" + _by_field(found)


def _json(depth: int = 2) -> st.SearchStrategy[Any]:
    leaves = st.one_of(st.sampled_from(POOL[:17]), st.integers(), st.floats(allow_nan=False, allow_infinity=False),
                       st.text(max_size=4))
    return st.recursive(leaves, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                        st.dictionaries(st.text(max_size=3), inner, max_size=2)),
                        max_leaves=6)


def _sampling() -> st.SearchStrategy[Any]:
    names = st.sampled_from(SAMPLING_FIELDS + UNKNOWN[:3])
    params = st.dictionaries(names, st.one_of(st.sampled_from(POOL), _json()), max_size=4)
    return st.one_of(params, st.lists(params, max_size=2), st.sampled_from(POOL))


def _body() -> st.SearchStrategy[Any]:
    names = st.sampled_from(tuple(n for n in TOP_FIELDS if n != "sampling_params") + UNKNOWN[:4])
    fields = st.dictionaries(names, st.one_of(st.sampled_from(POOL), _json()), max_size=4)
    prompt = st.sampled_from(({"text": "x"}, {"text": ["a", "b"]}, {"input_ids": [1, 2]}, {"input_ids": [[1]]}, {}))
    return st.builds(lambda p, f, sp, with_sp: {**p, **f, **({"sampling_params": sp} if with_sp else {})},
                     prompt, fields, _sampling(), st.booleans())


@settings(max_examples=1500, derandomize=True, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(body=_body())
def test_random_bodies_are_judged_as_sglang_judges_them(body: dict[str, Any]) -> None:
    """Several fields at once, values of any JSON shape, unknown keys at both levels."""
    assert disagreement(body) is None


def test_the_reference_is_sglangs_contract() -> None:
    """The vendored decoder says what its docstrings say: unknown keys ignored at the top, refused in
    ``sampling_params``, no null for ``return_prompt_token_ids``, a float never an integer."""
    assert sglang_takes({"text": "x", "surprise": 1})
    assert not sglang_takes({"text": "x", "sampling_params": {"temprature": 1}})
    assert not sglang_takes({"text": "x", "return_prompt_token_ids": None})
    assert not sglang_takes({"text": "x", "sampling_params": {"max_new_tokens": 4.0}})
    assert SamplingParams.from_json_value({"temperature": 1}).temperature == 1.0
