"""A ``/generate`` body (:mod:`handoff.protocol.generate_request`) as the sequences an engine runs, torch-free.

:func:`normalize` gives one :class:`Sequence` per prompt and sample, in
SGLang's order: prompt by prompt, and the ``n`` samples of a prompt next to
each other (``tokenizer_manager.py``'s batch and parallel-sampling loops),
with each sequence's request id, sampling parameters, logprob options and
images.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

from handoff.protocol.generate_request import (
    MAX_IMAGES_PER_PROMPT,
    MAX_IMAGES_PER_REQUEST,
    MAX_SEQUENCES,
    MAX_TOKEN_IDS_LOGPROB,
    MAX_TOP_LOGPROBS,
    GenerateBody,
    GenerateFieldError,
    SamplingParamsBody,
    refuse_unsupported,
)


@dataclass(frozen=True)
class LogprobOptions:
    """What logprobs one sequence returns (``return_logprob`` was true)."""

    start_len: int                       # prompt position of the first input logprob; -1: output only
    top_logprobs_num: int = 0
    token_ids: tuple[int, ...] | None = None
    return_text: bool = False


@dataclass(frozen=True)
class Sequence:
    """One sequence the engine runs: prompt ``prompt_index``, sample ``sample_index`` of ``n``."""

    prompt_index: int
    sample_index: int
    rid: str
    text: str | None
    input_ids: list[int] | None
    sampling: SamplingParamsBody
    logprobs: LogprobOptions | None
    use_prefix_cache: bool = True        # false under extra_key / cache_salt: never shares KV
    images: tuple[Any, ...] = ()         # the prompt's image_data items, in placeholder order (not decoded)


@dataclass(frozen=True)
class NormalizedRequest:
    sequences: list[Sequence]
    num_prompts: int
    n: int
    is_batch: bool   # answer a list (a batch, or n > 1 as SGLang does)


def _per_prompt(name: str, value: Any, num_prompts: int, n: int, *, nested: bool = False) -> list[Any]:
    """A top-level value for every prompt: a list (one per prompt) or one value for all."""
    is_list = isinstance(value, list) and (not nested or (value and isinstance(value[0], list)))
    if not is_list:
        return [value] * num_prompts
    if n > 1:
        raise GenerateFieldError(f"{name}: a list per prompt cannot be combined with n > 1")
    if len(value) != num_prompts:
        raise GenerateFieldError(f"{name} has {len(value)} entries for {num_prompts} prompts")
    return list(value)


def _prompts(body: GenerateBody) -> tuple[list[str] | None, list[list[int]] | None, bool]:
    if (body.text is None) == (body.input_ids is None):
        raise GenerateFieldError("give exactly one of text or input_ids")
    if body.text is not None:
        texts = body.text if isinstance(body.text, list) else [body.text]
        if any(not t for t in texts):
            raise GenerateFieldError("text must not be empty")
        return texts, None, isinstance(body.text, list)
    ids = body.input_ids or []
    is_batch = bool(ids) and isinstance(ids[0], list)
    id_lists = ids if is_batch else [ids]
    if any(not p for p in id_lists):
        raise GenerateFieldError("input_ids must not be empty")
    return None, id_lists, is_batch  # type: ignore[return-value]


def _sample_count(params: list[SamplingParamsBody | None]) -> int:
    """``n``; an empty batch (``text: []``) has no sequences, whatever it says."""
    counts = {(p.n if p is not None and p.n is not None else 1) for p in params} or {1}
    if len(counts) > 1:
        raise GenerateFieldError("sampling_params.n must be the same for every prompt")
    n = counts.pop()
    if n < 1:
        raise GenerateFieldError(f"sampling_params.n must be >= 1, got {n}")
    return n


def _rids(body: GenerateBody, num_prompts: int, n: int, is_batch: bool) -> list[str]:
    """One id per sequence: a given id as is (a string on a batch or with n > 1: ``<rid>_<k>``)."""
    num = num_prompts * n
    if body.rid is None:
        return [uuid.uuid4().hex for _ in range(num)]
    if isinstance(body.rid, str):
        return [body.rid] if num == 1 and not is_batch else [f"{body.rid}_{k}" for k in range(num)]
    if len(body.rid) != num_prompts:
        raise GenerateFieldError(f"rid has {len(body.rid)} entries for {num_prompts} prompts")
    rids = [rid if n == 1 else f"{rid}_{j}" for rid in body.rid for j in range(n)]
    if len(set(rids)) != len(rids):
        raise GenerateFieldError("rid: request ids must be unique within a request")
    return rids


def _logprob_options(body: GenerateBody, num_prompts: int, n: int) -> list[LogprobOptions | None]:
    wants = _per_prompt("return_logprob", body.return_logprob, num_prompts, n)
    starts = _per_prompt("logprob_start_len", body.logprob_start_len, num_prompts, n)
    tops = _per_prompt("top_logprobs_num", body.top_logprobs_num, num_prompts, n)
    token_ids = _per_prompt("token_ids_logprob", body.token_ids_logprob, num_prompts, n, nested=True)
    options: list[LogprobOptions | None] = []
    for want, start, top, ids in zip(wants, starts, tops, token_ids, strict=True):
        start = -1 if start is None else start
        top = 0 if top is None else top
        if start < -1:
            raise GenerateFieldError(f"logprob_start_len must be >= -1, got {start}")
        if not 0 <= top <= MAX_TOP_LOGPROBS:
            raise GenerateFieldError(f"top_logprobs_num must be in [0, {MAX_TOP_LOGPROBS}], got {top}")
        if ids is not None and len(ids) > MAX_TOKEN_IDS_LOGPROB:
            raise GenerateFieldError(f"token_ids_logprob takes at most {MAX_TOKEN_IDS_LOGPROB} ids")
        options.append(LogprobOptions(start, top, tuple(ids) if ids else None, body.return_text_in_logprobs)
                       if want else None)
    return options


def _image_lists(value: Any, num_prompts: int, is_batch: bool) -> list[tuple[Any, ...]]:
    """Each prompt's ``image_data`` items, by SGLang's rules (``GenerateReqInput._normalize_image_data``): one
    item is every prompt's image; on a batch, a list holds one item (or one list) per prompt; on one prompt,
    a list holds that prompt's images. ``null`` (or ``[None]``) for a prompt: no image."""
    def items(entry: Any) -> tuple[Any, ...]:
        if entry is None:
            return ()
        found = tuple(entry) if isinstance(entry, list) else (entry,)
        return () if found == (None,) else found

    if value is None or value == []:
        lists: list[tuple[Any, ...]] = [()] * num_prompts
    elif not isinstance(value, list):
        lists = [(value,)] * num_prompts
    elif not is_batch:
        nested = len(value) == 1 and isinstance(value[0], list)
        lists = [items(value[0] if nested else value)]
    elif len(value) != num_prompts:
        raise GenerateFieldError(f"image_data has {len(value)} entries for {num_prompts} prompts")
    else:
        lists = [items(entry) for entry in value]
    for i, found in enumerate(lists):
        if len(found) > MAX_IMAGES_PER_PROMPT:
            raise GenerateFieldError(f"image_data: at most {MAX_IMAGES_PER_PROMPT} images per prompt, "
                                     f"prompt {i} has {len(found)}")
    if sum(map(len, lists)) > MAX_IMAGES_PER_REQUEST:
        raise GenerateFieldError(f"image_data: at most {MAX_IMAGES_PER_REQUEST} images per request, "
                                 f"got {sum(map(len, lists))}")
    return lists


def normalize(body: GenerateBody, *, max_sequences: int = MAX_SEQUENCES) -> NormalizedRequest:
    """The sequences of ``body`` in SGLang's order (none for ``text: []``, which SGLang answers with ``[]``);
    raises :class:`GenerateFieldError`."""
    refuse_unsupported(body)
    texts, id_lists, is_batch = _prompts(body)
    num_prompts = len(texts if texts is not None else id_lists)  # type: ignore[arg-type]
    if num_prompts > max_sequences:
        raise GenerateFieldError(f"a batch holds at most {max_sequences} prompts, got {num_prompts}")
    params = _per_prompt("sampling_params", body.sampling_params, num_prompts, 1)
    n = _sample_count(params)
    if num_prompts * n > max_sequences:
        raise GenerateFieldError(f"prompts x n must be at most {max_sequences}, got {num_prompts} x {n}")
    rids = _rids(body, num_prompts, n, is_batch)
    logprobs = _logprob_options(body, num_prompts, n)
    # a list per prompt goes with n > 1 here, as in SGLang (io_struct.py:850-886 repeat it for the samples)
    salts = [_per_prompt(name, getattr(body, name), num_prompts, 1) for name in ("extra_key", "cache_salt")]
    images = _image_lists(body.image_data, num_prompts, is_batch)
    sequences = []
    for i in range(num_prompts):
        sampling = params[i] or SamplingParamsBody()
        for j in range(n):
            sequences.append(Sequence(
                prompt_index=i, sample_index=j, rid=rids[i * n + j],
                text=texts[i] if texts is not None else None,
                input_ids=id_lists[i] if id_lists is not None else None,  # shared by its n samples, never copied
                sampling=sampling, logprobs=logprobs[i],
                use_prefix_cache=not (salts[0][i] or salts[1][i]), images=images[i]))
    return NormalizedRequest(sequences, num_prompts, n, is_batch or n > 1)
