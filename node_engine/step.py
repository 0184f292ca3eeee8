"""A step: what the scheduler hands the runner (which tokens of which requests to compute, in which slots)
and what the runner gives back (:class:`StepResult`). Plain data, CPU only; the slot tensors live on the CPU."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from node_engine.logprobs import PromptLogprobs, TokenLogprobs

if TYPE_CHECKING:
    from node_engine.request import Request
    from node_engine.vision.inputs import ImageInput

__all__ = ["Step", "StepEntry", "StepKind", "StepResult"]


class StepKind(enum.Enum):
    PREFILL = "prefill"
    DECODE = "decode"


@dataclass(slots=True)
class StepEntry:
    request: Request
    start: int             # index into all_ids of the first token computed
    end: int               # one past the last
    slots: torch.Tensor | None  # prefill: new slots for tokens start..end (decode: see Step.slot_mapping)
    prefix: torch.Tensor | None = None  # on admission: slots of a reused cached prefix (tokens 0..start)

    @property
    def samples(self) -> bool:
        return self.end == self.request.num_tokens


@dataclass
class Step:
    kind: StepKind
    entries: list[StepEntry]
    slot_mapping: torch.Tensor  # every entry's new slots, flat, in entry order (CPU)
    images: list[ImageInput] = field(default_factory=list)  # prefill: to encode before the chunks, in order

    @property
    def num_tokens(self) -> int:
        return sum(e.end - e.start for e in self.entries)


@dataclass
class StepResult:
    """What the runner computed for a step."""

    tokens: list[int]                                   # one per entry that samples, in entry order
    logprobs: list[TokenLogprobs | None] | None = None  # the same order; None: no request asked
    prompt_logprobs: dict[int, PromptLogprobs] = field(default_factory=dict)  # entry index -> computed
