"""A ``/generate`` body's batch and ``n`` normalization: SGLang 0.5.23's and handoff's (a differential test).

:func:`sglang_sequences` is SGLang's pure-Python normalization, copied from ``sglang/srt/managers/io_struct.py``
(``GenerateReqInput.normalize_batch_and_arguments`` and the ``_normalize_*`` it calls, ``__getitem__``) and the
order ``sglang/srt/managers/tokenizer_manager.py`` (``_handle_batch_request``) sends and answers the sequences in.
:func:`handoff.protocol.generate_sequences.normalize` (what the engine runs) must refuse what SGLang refuses and
serve what it takes, in the same order, with the same ids, logprob switches and cache keys. Left out: what
``docs/api.md`` documents as different (the ids of ``n`` > 1 samples: SGLang draws fresh uuids, handoff names
them ``<rid>_<k>``), an empty batch, and lists on a single ``n`` = 1 prompt (SGLang keeps them unnormalized and
fails later, outside normalization).
"""

from __future__ import annotations

import uuid
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from handoff.protocol.generate_request import GenerateBody, GenerateFieldError
from handoff.protocol.generate_sequences import normalize

LOGPROB_FIELDS = {"return_logprob": st.booleans(), "logprob_start_len": st.integers(-1, 0),
                  "top_logprobs_num": st.integers(0, 2)}
SALT_FIELDS = ("extra_key", "cache_salt")


def sglang_sequences(body: dict[str, Any]) -> tuple[bool, list[tuple[int, str | None, bool, bool]]] | None:
    """``(answers a list, [(prompt, rid, return_logprob, shares the cache) per sequence])``, or None when SGLang
    raises ``ValueError`` (400). The rid is None where SGLang draws a fresh uuid."""
    text, input_ids = body.get("text"), body.get("input_ids")
    # _determine_batch_size (io_struct.py:479-515)
    prompts = text if text is not None else input_ids
    single = isinstance(prompts, str) or isinstance(prompts[0], int)
    batch_size = 1 if single else len(prompts)
    # _handle_parallel_sampling (io_struct.py:531-557)
    params = body.get("sampling_params")
    if params is None:
        n = 1
    elif isinstance(params, dict):
        n = params.get("n", 1)
    else:
        n = params[0].get("n", 1)
        if any(p.get("n", 1) != n for p in params):
            return None
    if n > 1:
        single = False
    rid = body.get("rid")
    if single:  # _normalize_single_inputs (io_struct.py:559-587)
        for name in SALT_FIELDS:
            if body.get(name) is not None and not isinstance(body[name], str):
                return None
        salted = any(body.get(name) for name in SALT_FIELDS)
        return False, [(0, rid, bool(body.get("return_logprob")), not salted)]
    num = batch_size * n
    # _normalize_rid (io_struct.py:759-774)
    if rid is None:
        rids: list[str | None] = [None] * num
    elif isinstance(rid, str):
        rids = [f"{rid}_{i}" for i in range(num)]
    else:
        if len(rid) != batch_size:
            return None
        rids = list(rid)
    # _normalize_logprob_params (io_struct.py:776-821): a list per prompt is refused with n > 1
    per_prompt: dict[str, list[Any]] = {}
    for name in LOGPROB_FIELDS:
        value = body.get(name)
        if isinstance(value, list) and n > 1:
            return None
        per_prompt[name] = value if isinstance(value, list) else [value] * num
    ids_logprob = body.get("token_ids_logprob")
    if ids_logprob and isinstance(ids_logprob[0], list) and n > 1:
        return None
    # _normalize_extra_key, _normalize_cache_salt (io_struct.py:850-886): a list per prompt, repeated for n
    for name in SALT_FIELDS:
        value = body.get(name)
        if isinstance(value, list):
            if len(value) != batch_size:
                return None
            per_prompt[name] = [v or None for v in value] * n
        else:
            per_prompt[name] = [value or None] * num
    # _validate_rid_uniqueness (io_struct.py:390-397)
    if isinstance(rid, list) and len(set(rid)) != len(rid):
        return None
    # tokenizer_manager.py:2084-2186: prompt by prompt (obj[i], io_struct.py:959), its n samples next to each other
    # under fresh ids (regenerate_rid, io_struct.py:382-388)
    sequences = []
    for i in range(batch_size):
        salted = any(per_prompt[name][i] for name in SALT_FIELDS)
        for _ in range(n):
            sequences.append((i, rids[i] if n == 1 else None, bool(per_prompt["return_logprob"][i]), not salted))
    return True, sequences


def handoff_sequences(body: dict[str, Any]) -> tuple[bool, list[tuple[int, str, bool, bool]]] | None:
    try:
        request = normalize(GenerateBody.model_validate(body))
    except GenerateFieldError:
        return None
    return request.is_batch, [(s.prompt_index, s.rid, s.logprobs is not None, s.use_prefix_cache)
                              for s in request.sequences]


@st.composite
def bodies(draw: st.DrawFn) -> dict[str, Any]:
    n = draw(st.sampled_from([1, 1, 2, 3]))
    single = draw(st.booleans())
    num_prompts = 1 if single else draw(st.integers(1, 3))
    as_text = draw(st.booleans())
    prompts = [f"p{i}" if as_text else [256, i + 1] for i in range(num_prompts)]
    body: dict[str, Any] = {("text" if as_text else "input_ids"): prompts[0] if single else prompts}
    lists_allowed = not single or n > 1  # SGLang normalizes a single prompt with n > 1 as a batch of one

    def one_or_list(values: st.SearchStrategy[Any], *, length: int = num_prompts) -> Any:
        if lists_allowed and draw(st.booleans()):
            return draw(st.lists(values, min_size=length, max_size=length))
        return draw(values)

    kind = draw(st.sampled_from((["none"] if n == 1 else []) + ["dict"] + (["list"] if lists_allowed else [])))
    if kind == "dict":
        body["sampling_params"] = {"n": n} if n > 1 or draw(st.booleans()) else {}
    elif kind == "list":
        ns = [n] * num_prompts
        if num_prompts > 1 and draw(st.integers(0, 4)) == 0:
            ns[-1] = n + 1  # n must be the same for every prompt
        body["sampling_params"] = [{"n": k} for k in ns]
    rid_kind = draw(st.sampled_from(["none", "str", "list", "list_wrong_length", "list_duplicate"]
                                    if lists_allowed else ["none", "str"]))
    if rid_kind == "str":
        body["rid"] = uuid.uuid4().hex[:6]
    elif rid_kind.startswith("list"):
        rids = [f"r{i}" for i in range(num_prompts)]
        if rid_kind == "list_wrong_length":
            rids.append("extra")
        elif rid_kind == "list_duplicate" and num_prompts > 1:
            rids[-1] = rids[0]
        body["rid"] = rids
    for name, values in LOGPROB_FIELDS.items():
        if draw(st.booleans()):
            body[name] = one_or_list(values)
    ids_kind = draw(st.sampled_from(["none", "empty", "flat", "nested"] if lists_allowed else ["none", "flat"]))
    if ids_kind != "none":
        body["token_ids_logprob"] = {"empty": [], "flat": [5, 6],
                                     "nested": [[5]] * num_prompts}[ids_kind]
    for name in SALT_FIELDS:
        if draw(st.booleans()):
            salts = st.sampled_from(["", "tenant"])
            if lists_allowed and draw(st.integers(0, 5)) == 0:
                body[name] = draw(st.lists(salts, min_size=num_prompts + 1, max_size=num_prompts + 1))
            else:
                body[name] = one_or_list(salts)
    return body


@settings(max_examples=400, deadline=None, derandomize=True)
@given(bodies())
def test_batch_and_n_normalization_matches_sglang(body: dict[str, Any]) -> None:
    expected, got = sglang_sequences(body), handoff_sequences(body)
    if expected is None or got is None:
        assert expected is None and got is None, (body, expected, got)
        return
    (is_list, sequences), (sglang_is_list, sglang) = got, expected
    assert is_list == sglang_is_list, body  # a list answers a batch, or n > 1
    assert [s[0] for s in sequences] == [s[0] for s in sglang], body  # prompt by prompt, samples together
    assert [s[2:] for s in sequences] == [s[2:] for s in sglang], body  # return_logprob, the cache shared or not
    for (_, rid, _, _), (_, sglang_rid, _, _) in zip(sequences, sglang, strict=True):
        assert rid == sglang_rid or sglang_rid is None and len(rid) > 0, body
    assert len({s[1] for s in sequences}) == len(sequences), body
