"""The attention batch of a prefill step: which keys each of its queries sees.

A prefill step holds chunks of several requests, each a run of new tokens
(``start..end``) after the request's earlier tokens, whose slots are already in
its row of the request-to-slot table. Queries are padded to the longest chunk
and keys to the longest context; the mask lets each query see its own
sequence's keys up to its own position.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from node_engine.model.layers import AttentionBatch
from node_engine.step import StepEntry


# Padding every chunk to the longest costs num_seqs x longest queries (and a mask of num_seqs x longest x keys);
# past this many times the real queries, each sequence attends on its own instead.
RAGGED_FACTOR = 2


def _per_sequence(entries: Sequence[StepEntry], slot_mapping: torch.Tensor, kv_indices: torch.Tensor, max_q: int,
                  key_pos: torch.Tensor) -> AttentionBatch:
    sequences = []
    first = 0
    for e in entries:
        num = e.end - e.start
        mask = None if e.start == 0 else key_pos[None, :e.end] <= (e.start + key_pos[:num])[:, None]
        sequences.append((first, num, e.end, mask))
        first += num
    return AttentionBatch(slot_mapping=slot_mapping, kv_indices=kv_indices, mask=None, num_seqs=len(entries),
                          max_query_len=max_q, sequences=sequences)


def prefill_batch(entries: Sequence[StepEntry], slot_mapping: torch.Tensor,
                  req_to_token: torch.Tensor) -> AttentionBatch:
    """The ``AttentionBatch`` of ``entries`` whose new tokens go to ``slot_mapping`` (flat, in entry order).

    ``req_to_token`` [rows, context] must already hold every entry's slots up to its ``end``.
    """
    dev = slot_mapping.device
    num_seqs = len(entries)
    if num_seqs == 1 and entries[0].start == 0:
        n = entries[0].end
        return AttentionBatch(slot_mapping=slot_mapping, kv_indices=slot_mapping.view(1, n), mask=None,
                              num_seqs=1, max_query_len=n, is_causal_self_only=True)
    rows = torch.tensor([e.request.row for e in entries], device=dev)
    ends = torch.tensor([e.end for e in entries], device=dev)
    max_len = max(e.end for e in entries)
    kv_indices = req_to_token[:, :max_len].index_select(0, rows)
    key_pos = torch.arange(max_len, device=dev)
    lengths = [e.end - e.start for e in entries]
    max_q = max(lengths)
    if num_seqs > 1 and num_seqs * max_q > RAGGED_FACTOR * sum(lengths):
        return _per_sequence(entries, slot_mapping, kv_indices, max_q, key_pos)
    starts = torch.tensor([e.start for e in entries], device=dev)
    lens_t = torch.tensor(lengths, device=dev)
    q_i = torch.arange(max_q, device=dev)
    is_real = q_i[None, :] < lens_t[:, None]                                   # [B, N]
    q_pos = torch.where(is_real, starts[:, None] + q_i[None, :], 0)            # padded rows see key 0
    mask = (key_pos[None, None, :] <= q_pos[:, :, None]) & (key_pos[None, None, :] < ends[:, None, None])
    if num_seqs == 1:
        return AttentionBatch(slot_mapping=slot_mapping, kv_indices=kv_indices, mask=mask.unsqueeze(1),
                              num_seqs=1, max_query_len=max_q)
    offsets = torch.cumsum(lens_t, 0) - lens_t
    q_pad_index = torch.where(is_real, offsets[:, None] + q_i[None, :], 0).reshape(-1)
    q_unpad_index = (torch.arange(num_seqs, device=dev)[:, None] * max_q + q_i[None, :])[is_real]
    return AttentionBatch(slot_mapping=slot_mapping, kv_indices=kv_indices, mask=mask.unsqueeze(1),
                          num_seqs=num_seqs, max_query_len=max_q, q_pad_index=q_pad_index,
                          q_unpad_index=q_unpad_index)
