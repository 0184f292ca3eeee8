"""SGLang's /generate body, torch-free: normalization into sequences, refusals, and the documented field lists."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest
from pydantic import ValidationError

from handoff.protocol import errors as E
from handoff.protocol import ignored_fields
from handoff.protocol.ignored_fields import MAX_NAME_CHARS
from handoff.protocol.generate_request import DEFAULT_ONLY, GENERATE_FIELDS, SAMPLING_FIELDS, GenerateBody, GenerateFieldError, is_empty
from handoff.protocol.generate_sequences import normalize

API_DOC = Path(__file__).resolve().parents[2] / "docs" / "api.md"


def norm(**body):
    return normalize(GenerateBody.model_validate(body))


def test_batches_and_n_in_sglang_order() -> None:
    request = norm(text=["a", "b"], rid=["x", "y"], sampling_params={"n": 2, "sampling_seed": 5})
    assert request.is_batch and request.n == 2
    assert [(s.prompt_index, s.sample_index, s.text, s.rid) for s in request.sequences] == [
        (0, 0, "a", "x_0"), (0, 1, "a", "x_1"), (1, 0, "b", "y_0"), (1, 1, "b", "y_1")]
    assert norm(text="a", sampling_params={"n": 3}).is_batch  # n > 1 answers a list, as SGLang does
    assert [s.rid for s in norm(input_ids=[[1], [2]], rid="r").sequences] == ["r_0", "r_1"]
    assert [s.rid for s in norm(input_ids=[1, 2], rid="r").sequences] == ["r"]


def test_per_prompt_values_and_their_limits() -> None:
    request = norm(text=["a", "b"], return_logprob=[True, False], logprob_start_len=[0, -1],
                   sampling_params=[{"temperature": 0}, {"temperature": 1}])
    first, second = request.sequences
    assert first.logprobs is not None and first.logprobs.start_len == 0 and second.logprobs is None
    assert [s.sampling.temperature for s in request.sequences] == [0, 1]
    with pytest.raises(GenerateFieldError, match="n > 1"):
        norm(text=["a", "b"], top_logprobs_num=[1, 2], sampling_params={"n": 2})
    with pytest.raises(GenerateFieldError, match="same for every prompt"):
        norm(text=["a", "b"], sampling_params=[{"n": 1}, {"n": 2}])
    with pytest.raises(GenerateFieldError, match="at most"):
        normalize(GenerateBody.model_validate({"text": "a", "sampling_params": {"n": 9}}), max_sequences=8)
    for empty in ({"input_ids": []}, {"input_ids": [[]]}, {"text": [""]}, {"text": ["a", ""]}):
        with pytest.raises(GenerateFieldError, match="empty"):
            norm(**empty)


@pytest.mark.parametrize("body", [{"text": []}, {"text": [], "sampling_params": {"max_new_tokens": 4}},
                                  {"text": [], "sampling_params": {"n": 3}}, {"text": [], "sampling_params": []},
                                  {"text": [], "rid": "r", "return_logprob": True}])
def test_an_empty_text_batch_is_an_empty_request(body: dict) -> None:
    """SGLang: ``text: []`` is a batch of 0 (``io_struct.py:481-486``), every per-prompt list repeated 0 times,
    and the tokenizer manager answers ``[]`` (``tokenizer_manager.py:2074-2187``); an empty ``input_ids`` is a
    400 there (``io_struct.py:488-498``). Once a KeyError (500), found by schemathesis."""
    request = norm(**body)
    assert request.sequences == [] and request.num_prompts == 0 and request.is_batch


def test_text_and_input_ids_together_are_refused() -> None:
    """SGLang runs ``input_ids`` and drops ``text`` when both are given (``tokenizer_manager.py:1118``), with
    the batch shape taken from ``text`` (``io_struct.py:481``): shapes that disagree crash there. A 400 here."""
    for body in ({"text": "a", "input_ids": [1]}, {"text": ["a"], "input_ids": [[1]]}, {"text": [], "input_ids": []}):
        with pytest.raises(GenerateFieldError, match="exactly one"):
            norm(**body)


def test_image_data_per_prompt_by_sglangs_rules() -> None:
    def images(**body):
        return [s.images for s in norm(**body).sequences]

    assert images(text="a") == images(text="a", image_data=[]) == [()]
    assert images(text="a", image_data="x") == [("x",)]                       # one image
    assert images(text="a", image_data=["x", "y"]) == [("x", "y")]            # one prompt's images
    assert images(text="a", image_data=[["x", "y"]]) == [("x", "y")]          # the batch form, one prompt
    assert images(text=["a", "b"], image_data="x") == [("x",), ("x",)]        # every prompt's image
    assert images(text=["a", "b"], image_data=["x", None]) == [("x",), ()]    # one per prompt
    assert images(text=["a", "b"], image_data=[["x", "y"], [None]]) == [("x", "y"), ()]
    assert images(text="a", image_data="x", sampling_params={"n": 2}) == [("x",), ("x",)]
    with pytest.raises(GenerateFieldError, match="3 entries for 2 prompts"):
        norm(text=["a", "b"], image_data=["x", "y", "z"])
    with pytest.raises(GenerateFieldError, match="at most 64 images per prompt"):
        norm(text="a", image_data=["x"] * 65)
    with pytest.raises(GenerateFieldError, match="at most 128 images per request"):
        norm(text=["a", "b", "c"], image_data=[["x"] * 50] * 3)


def test_default_only_fields_refuse_other_values_as_unsupported() -> None:
    assert all(is_empty(v) for v in (None, False, 0, "", [], {}, [None, None], [[], None]))
    assert not any(is_empty(v) for v in ("x", [1], {"a": 1}, True, "last"))
    norm(text="a", image_data=[], lora_path=[None], return_hidden_states=False, sampling_params={"json_schema": ""})
    with pytest.raises(GenerateFieldError) as info:
        norm(text="a", lora_path="adapter")
    assert info.value.kind is E.UNSUPPORTED and str(info.value).startswith("lora_path")
    with pytest.raises(GenerateFieldError) as info:
        norm(text="a", sampling_params={"regex": "a+"})
    assert info.value.kind is E.UNSUPPORTED and "sampling_params.regex" in str(info.value)


def test_docs_list_every_field_with_its_status() -> None:
    """docs/api.md's tables name each field of both bodies, with the status the code gives it."""
    rows = [line for line in API_DOC.read_text().splitlines() if line.startswith("| `")]
    documented: dict[str, str] = {}
    for row in rows:
        names_cell, status = row.strip("|").split("|")[:2]
        for name in re.findall(r"`([a-z_0-9]+)`", names_cell):
            documented.setdefault(name, status.strip())
    for name, status in {**GENERATE_FIELDS, **SAMPLING_FIELDS}.items():
        assert name in documented, f"{name} is not in docs/api.md"
        word = "default only" if status == DEFAULT_ONLY else status
        assert documented[name].startswith(word) or (name in ("routed_dp_rank", "data_parallel_rank",
                                                              "disagg_prefill_dp_rank") and "accepted" in
                                                     documented[name]), (name, documented[name])


def test_unknown_top_level_keys_are_ignored_and_each_name_logged_once(caplog: pytest.LogCaptureFixture,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """SGLang's contract ignores a top-level key it does not know (a field of another SGLang version); handoff
    ignores it too, and logs each name once so a misspelling shows. One inside ``sampling_params`` stays a 400.
    Before: every unknown top-level key was a 400 ``extra_forbidden``."""
    caplog.set_level(logging.WARNING, logger=ignored_fields.__name__)
    monkeypatch.setattr(ignored_fields, "_logged", set())
    name = "a_field_of_another_version_" + "x" * 200
    for _ in range(3):
        body = GenerateBody.model_validate({"text": "a", name: {"any": ["json"]}, "stream": None})
        assert body.model_dump() == GenerateBody.model_validate({"text": "a"}).model_dump()
        assert name not in body.model_dump() and not body.model_extra
    logged = [r.getMessage() for r in caplog.records if "a_field_of_another_version_" in r.getMessage()]
    assert len(logged) == 1 and name[:MAX_NAME_CHARS] in logged[0] and name not in logged[0]
    with pytest.raises(ValidationError, match="temprature"):
        GenerateBody.model_validate({"text": "a", "sampling_params": {"temprature": 1}})
