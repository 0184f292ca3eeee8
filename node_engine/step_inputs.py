"""The tensors one step's forward reads, built from the scheduler's step in one pass.

Both builders also record the step's new KV slots in the request-to-slot table
(``req_to_token``, the runner's ``workspace`` tensor), where attention finds
every earlier key of a sequence.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from node_engine.step import Step


@dataclass(frozen=True)
class DecodeInputs:
    """Per-sequence tensors of one decode step (on the device), and what the attention batch needs to know."""

    input_ids: torch.Tensor     # [B] the token each sequence computes
    positions: torch.Tensor     # [B] its position
    rope_positions: torch.Tensor  # [B] the position it rotates by (M-RoPE: position + the prompt's delta)
    rows: torch.Tensor          # [B] the sequence's row of the request-to-slot table
    slot_mapping: torch.Tensor  # [B] the slot its KV goes to
    max_len: int                # keys of the longest sequence
    is_ragged: bool             # sequences differ in length (the attention needs a mask)


@dataclass(frozen=True)
class PrefillInputs:
    """Every token a prefill step computes, in entry order."""

    input_ids: torch.Tensor     # [T]
    positions: torch.Tensor     # [T]
    slot_mapping: torch.Tensor  # [T] on the device
    sampling_rows: list[int]    # the row of each sampling entry's last token


def decode_inputs(step: Step, req_to_token: torch.Tensor) -> DecodeInputs:
    """One token per sequence: the last one it has, at its position."""
    device = req_to_token.device
    tokens: list[int] = []
    positions: list[int] = []
    rows: list[int] = []
    rope: list[int] = []  # the same as positions unless a prompt had images (M-RoPE's delta)
    for e in step.entries:
        request = e.request
        num_prompt = len(request.prompt_ids)
        tokens.append(request.prompt_ids[e.start] if e.start < num_prompt
                      else request.output_ids[e.start - num_prompt])
        positions.append(e.start)
        rows.append(request.row)
        # A decoded token is text after the prompt's last image (a prompt never ends with an image token).
        rope.append(e.start if request.mm is None else e.start + request.mm.rope_delta)
    input_ids, position_t, rows_t, rope_t = torch.tensor([tokens, positions, rows, rope], device=device).unbind(0)
    # A copy even on CPU: made here, under inference mode, like the other inputs. A compiled decode
    # graph is specialized on that (the scheduler's tensor is an ordinary one).
    slot_mapping = step.slot_mapping.to(device, copy=True)
    req_to_token[rows_t, position_t] = slot_mapping.to(torch.int32)
    max_position = max(positions)
    return DecodeInputs(input_ids=input_ids, positions=position_t, rope_positions=rope_t, rows=rows_t,
                        slot_mapping=slot_mapping, max_len=max_position + 1, is_ragged=min(positions) != max_position)


def prefill_inputs(step: Step, req_to_token: torch.Tensor) -> PrefillInputs:
    """Each entry's chunk of new tokens; a reused cached prefix's slots open its request's row."""
    device = req_to_token.device
    slot_mapping = step.slot_mapping.to(device)
    tokens: list[int] = []
    positions: list[int] = []
    sampling_rows: list[int] = []
    for e in step.entries:
        num = e.end - e.start
        if e.prefix is not None:
            req_to_token[e.request.row, :e.start] = e.prefix.to(device=device, dtype=torch.int32)
        req_to_token[e.request.row, e.start:e.end] = slot_mapping[len(tokens):len(tokens) + num]
        tokens.extend(e.request.token_slice(e.start, e.end))
        positions.extend(range(e.start, e.end))
        if e.samples:
            sampling_rows.append(len(tokens) - 1)
    return PrefillInputs(input_ids=torch.tensor(tokens, dtype=torch.int64, device=device),
                         positions=torch.tensor(positions, dtype=torch.int64, device=device),
                         slot_mapping=slot_mapping, sampling_rows=sampling_rows)
