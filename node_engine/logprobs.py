"""Logprobs as SGLang 0.5.23 returns them, computed in float32 on the device.

Which distribution (``layers/sampler.py``, ``layers/logprob_processor.py``):

- **output tokens**: ``log_softmax(logits / temperature)`` of the logits after
  penalties and ``logit_bias`` (:mod:`node_engine.logits`) and *before* top-k,
  top-p and min-p filtering; a greedy request (temperature below 1e-6, or
  ``top_k`` 1) uses temperature 1. A request with ``max_new_tokens`` 0 that asks for
  ``top_logprobs_num`` or ``token_ids_logprob`` gets one such row, of the distribution after the prompt,
  without the temperature (SGLang's ``compute_logprobs_only``). The engine flag ``--return-original-logprob``
  (SGLang's ``SGLANG_RETURN_ORIGINAL_LOGPROB``) drops the temperature for every
  request. The top logprobs and ``token_ids_logprob`` of an output position come
  from the same distribution.
- **prompt tokens** (``logprob_start_len`` >= 0): ``log_softmax`` of the raw
  logits, no temperature, no penalties. The first entry (the token at
  ``logprob_start_len``) has no logprob, as in SGLang.

Values are clamped to float32's lowest finite value (``-inf`` is not JSON); tempered logits that overflow
to ``inf`` are the largest float, as for sampling (NaN is not JSON either).
Prompt logprobs are computed chunk by chunk as the prefill goes, at most
:data:`ROWS_PER_PASS` positions at a time, so a long prompt never holds a
whole ``[prompt, vocab]`` logits matrix.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Sequence

import torch

from handoff.protocol.generate_sequences import LogprobOptions
from node_engine.sampling import SamplingParams

if TYPE_CHECKING:
    from node_engine.step import StepEntry

ROWS_PER_PASS = 256
_LOWEST = torch.finfo(torch.float32).min


@dataclass
class TokenLogprobs:
    """The logprobs of one output token."""

    logprob: float
    top: tuple[list[float], list[int]] | None = None   # top_logprobs_num best: values, ids
    token_ids: list[float] | None = None               # the logprobs of token_ids_logprob, in its order


@dataclass
class PromptLogprobs:
    """Prompt logprobs of consecutive positions: ``values[i]`` is the logprob of the prompt token that follows
    position ``first + i`` (the same layout for ``top`` and ``token_ids``)."""

    first: int
    values: list[float] = field(default_factory=list)
    top: list[tuple[list[float], list[int]]] | None = None
    token_ids: list[list[float]] | None = None

    def extend(self, other: PromptLogprobs) -> None:
        self.values.extend(other.values)
        if self.top is not None and other.top is not None:
            self.top.extend(other.top)
        if self.token_ids is not None and other.token_ids is not None:
            self.token_ids.extend(other.token_ids)


@dataclass
class InputLogprobs:
    """A request's prompt logprobs as its answer lists them: one entry per prompt token from
    ``logprob_start_len`` on, the first without a value (``None``)."""

    token_ids: list[int]
    values: list[float | None]
    top: list[tuple[list[float], list[int]] | None] | None = None
    token_ids_logprobs: list[list[float] | None] | None = None

    @classmethod
    def of(cls, prompt_ids: list[int], computed: PromptLogprobs | None, options: LogprobOptions) -> InputLogprobs:
        start = len(prompt_ids) if options.start_len < 0 else options.start_len
        ids = prompt_ids[start:]
        top_wanted, ids_wanted = options.top_logprobs_num > 0, options.token_ids is not None
        if not ids:
            return cls([], [], [] if top_wanted else None, [] if ids_wanted else None)
        values = computed.values if computed is not None else []
        return cls(ids, [None, *values],
                   [None, *(computed.top or [])] if top_wanted and computed is not None else
                   ([None] if top_wanted else None),
                   [None, *(computed.token_ids or [])] if ids_wanted and computed is not None else
                   ([None] if ids_wanted else None))


def _per_row(logprobs: torch.Tensor, options: Sequence[LogprobOptions]) -> tuple[list, list]:
    """Top-k and token-id logprobs of each row (``None`` where a row's options do not ask)."""
    tops: list[tuple[list[float], list[int]] | None] = [None] * len(options)
    picked: list[list[float] | None] = [None] * len(options)
    max_k = max((o.top_logprobs_num for o in options), default=0)
    if max_k:
        values, ids = logprobs.topk(min(max_k, logprobs.shape[-1]), dim=-1)
        values, ids = values.tolist(), ids.tolist()
        for i, o in enumerate(options):
            if o.top_logprobs_num:
                tops[i] = (values[i][:o.top_logprobs_num], ids[i][:o.top_logprobs_num])
    for i, o in enumerate(options):
        if o.token_ids is not None:
            picked[i] = logprobs[i, torch.tensor(o.token_ids, device=logprobs.device)].tolist()
    return tops, picked


def output_logprobs(logits: torch.Tensor, params: Sequence[SamplingParams], options: Sequence[LogprobOptions | None],
                    tokens: Sequence[int], *, original: bool = False,
                    untempered: Sequence[bool] | None = None) -> list[TokenLogprobs | None]:
    """Logprobs of the sampled ``tokens`` for the rows of ``logits`` [B, V] whose ``options`` ask for them;
    ``untempered`` rows leave the temperature out (a ``max_new_tokens`` 0 request's row after the prompt, as
    SGLang's ``compute_logprobs_only``)."""
    rows = [i for i, o in enumerate(options) if o is not None]
    result: list[TokenLogprobs | None] = [None] * len(options)
    if not rows:
        return result
    index = torch.tensor(rows, device=logits.device)
    temperatures = torch.tensor([1.0 if original or params[i].is_greedy or (untempered and untempered[i])
                                 else params[i].temperature for i in rows],
                                dtype=torch.float32, device=logits.device)
    scaled = logits.index_select(0, index) / temperatures.unsqueeze(1)
    # a large logit (a valid logit_bias) over a small temperature overflows: the largest float keeps log_softmax
    # free of NaN, as the sampler does for its own copy (``sampling._sample_row``)
    scaled.nan_to_num_(nan=float("-inf"), posinf=torch.finfo(scaled.dtype).max)
    logprobs = torch.log_softmax(scaled, dim=-1)
    logprobs.clamp_(min=_LOWEST)
    chosen = logprobs.gather(1, torch.tensor([tokens[i] for i in rows], device=logits.device).unsqueeze(1))
    asked = [options[i] for i in rows]
    tops, picked = _per_row(logprobs, asked)  # type: ignore[arg-type]
    for n, (i, value) in enumerate(zip(rows, chosen.view(-1).tolist(), strict=True)):
        result[i] = TokenLogprobs(value, tops[n], picked[n])
    return result


def prompt_logprobs(hidden: torch.Tensor, targets: Sequence[int], first: int, options: LogprobOptions,
                    compute_logits: Callable[[torch.Tensor], torch.Tensor]) -> PromptLogprobs:
    """Prompt logprobs of the positions whose hidden states are ``hidden`` [T, H]: row ``i`` predicts
    ``targets[i]``; ``first`` is the position of row 0."""
    out = PromptLogprobs(first, top=[] if options.top_logprobs_num else None,
                         token_ids=[] if options.token_ids is not None else None)
    for start in range(0, len(targets), ROWS_PER_PASS):
        rows = hidden[start:start + ROWS_PER_PASS]
        logprobs = torch.log_softmax(compute_logits(rows), dim=-1).clamp_(min=_LOWEST)
        wanted = torch.tensor(targets[start:start + ROWS_PER_PASS], device=logprobs.device).unsqueeze(1)
        out.values.extend(logprobs.gather(1, wanted).view(-1).tolist())
        tops, picked = _per_row(logprobs, [options] * rows.shape[0])
        if out.top is not None:
            out.top.extend(tops)  # type: ignore[arg-type]
        if out.token_ids is not None:
            out.token_ids.extend(picked)  # type: ignore[arg-type]
    return out


def step_prompt_logprobs(entries: Sequence[StepEntry], hidden: torch.Tensor,
                         compute_logits: Callable[[torch.Tensor], torch.Tensor]) -> dict[int, PromptLogprobs]:
    """Prompt logprobs, by entry index, of the positions a prefill step computed (``hidden``: every token of
    ``entries`` in order) that a request still needs."""
    result: dict[int, PromptLogprobs] = {}
    offset = 0
    for index, e in enumerate(entries):
        request = e.request
        first = request.prompt_logprob_next
        if first is not None and request.logprobs is not None:
            first = max(first, e.start)
            end = min(e.end, len(request.prompt_ids) - 1)  # the last prompt position predicts no prompt token
            if first < end:
                rows = hidden[offset + first - e.start:offset + end - e.start]
                result[index] = prompt_logprobs(rows, request.prompt_ids[first + 1:end + 1], first,
                                                request.logprobs, compute_logits)
        offset += e.end - e.start
    return result
