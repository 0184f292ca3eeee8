"""What a request's history does to its next-token logits, before sampling (SGLang's penaltylib).

Applied in place to the float32 logits of the rows that sample, in SGLang's
order: the additive penalties (``frequency_penalty`` times each output token's
count, ``presence_penalty`` once per output token seen, ``-inf`` on the stop
tokens while fewer than ``min_new_tokens`` were generated), then the scaling
one (``repetition_penalty``: a logit of an output token seen before is divided
by it when positive, multiplied when negative), then ``logit_bias``. Only
output tokens count, as in SGLang. The logprobs a request returns are computed
from these logits.
"""

from __future__ import annotations

from typing import Sequence

import torch

from node_engine.sampling import SamplingParams


def apply_penalties(logits: torch.Tensor, histories: Sequence[tuple[SamplingParams, list[int]]],
                    eos_token_ids: Sequence[int]) -> None:
    """Penalize row ``i`` of ``logits`` [B, V] by ``histories[i]``: its parameters and its output ids."""
    for row, (params, output_ids) in zip(logits, histories, strict=True):
        if params.has_penalties:
            _penalize_row(row, params, output_ids, eos_token_ids)


def _penalize_row(row: torch.Tensor, p: SamplingParams, output_ids: list[int], eos_token_ids: Sequence[int]) -> None:
    seen = counts = None
    if output_ids and (p.frequency_penalty or p.presence_penalty or p.repetition_penalty != 1):
        seen, counts = torch.tensor(output_ids, device=row.device).unique(return_counts=True)
    if seen is not None and p.frequency_penalty:
        row.index_add_(0, seen, counts.to(row.dtype) * -p.frequency_penalty)
    if seen is not None and p.presence_penalty:
        row.index_add_(0, seen, torch.full(seen.shape, -p.presence_penalty, dtype=row.dtype, device=row.device))
    if len(output_ids) < p.min_new_tokens:
        stops = sorted(set(eos_token_ids) | set(p.stop_token_ids))
        if stops:
            row[torch.tensor(stops, device=row.device)] = float("-inf")
    if seen is not None and p.repetition_penalty != 1:
        values = row[seen]
        row[seen] = torch.where(values < 0, values * p.repetition_penalty, values / p.repetition_penalty)
    if p.logit_bias:
        ids, biases = p.logit_bias_tensors
        row.index_add_(0, ids.to(row.device), biases.to(device=row.device, dtype=row.dtype))
    # a bias near the largest float on top of a logit, or a logit over a tiny penalty, overflows: the largest
    # float keeps softmax (and the logprobs) free of NaN, for this request and the others of its step
    row.nan_to_num_(nan=float("-inf"), posinf=torch.finfo(row.dtype).max)
