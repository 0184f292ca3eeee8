"""The per-step visual budget: how many image tokens the vision tower encodes in one step.

Rules (``--visual-batch-max-tokens``, 0 disables):
- an image is encoded by the step whose chunk first reaches one of its
  tokens, whole (the tower attends over the entire image), and counts against
  that step's budget with all of its tokens (after the merge);
- the first image of a step is always admitted, whatever its size: a budget
  smaller than one image never deadlocks;
- images are admitted in arrival order: once one is deferred, no later image
  is encoded in that step and no new request is admitted. The chunk that
  would have reached a deferred image stops right before it (text up to there
  is still computed), so the image is the first the next step looks at, never
  behind later arrivals.

CPU bookkeeping only, split in :meth:`VisualBudget.plan` (no side effect) and
:meth:`VisualBudget.commit`, like the slot allocators.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from node_engine.request import Request
    from node_engine.vision.inputs import ImageInput


@dataclass(frozen=True)
class ChunkPlan:
    num_tokens: int                                          # tokens the chunk may compute this step
    images: list[ImageInput] = field(default_factory=list)   # the images to encode for them, in order
    is_cut: bool = False                                     # an image was deferred: the chunk stops before it


class VisualBudget:
    def __init__(self, max_tokens: int) -> None:
        self.max_tokens = max_tokens          # 0: unlimited
        self.num_tokens = 0                   # image tokens admitted so far this step
        self.images: list[ImageInput] = []    # admitted this step, in order
        self.is_closed = False                # an image was deferred: no later image this step

    def plan(self, request: Request, start: int, num: int) -> ChunkPlan:
        """How many of the ``num`` tokens from ``start`` the request may compute this step, and the images that
        must be encoded for them (nothing recorded)."""
        mm = request.mm
        if mm is None:
            return ChunkPlan(num)
        admitted: list[ImageInput] = []
        total = self.num_tokens
        for image in mm.needing_encode(start, start + num):
            is_first = not self.images and not admitted
            fits = self.max_tokens == 0 or total + image.num_tokens <= self.max_tokens
            if self.is_closed or not (fits or is_first):
                return ChunkPlan(max(0, image.offset - start), admitted, is_cut=True)
            admitted.append(image)
            total += image.num_tokens
        return ChunkPlan(num, admitted)

    def commit(self, plan: ChunkPlan) -> None:
        """Record a chunk the scheduler took (or, with ``num_tokens == 0``, could not start)."""
        self.images.extend(plan.images)
        self.num_tokens += sum(image.num_tokens for image in plan.images)
        if plan.is_cut:
            self.is_closed = True

    def close(self) -> None:
        """A chunk that needed images could not be taken (no room): no later image is encoded this step."""
        self.is_closed = True
