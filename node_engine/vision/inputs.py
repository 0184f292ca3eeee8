"""The images of one request, and their features while the prefill needs them.

A request keeps, per image, the resized ``uint8`` image (its *source*) until
it ends: a preempted request recomputes its KV, images included. Everything
derived from it lives only as long as the prefill needs it:

- pixel values are made right before the vision tower runs and dropped after
  it (``encoder.py``);
- an image's embeddings exist from the step that encodes it until the step
  whose chunk computes its last token (:meth:`MultimodalPrompt.release_consumed`);
- the prompt's M-RoPE positions exist until its last prompt token is computed
  (:meth:`MultimodalPrompt.drop_positions`), and are recomputed if needed again.

CPU bookkeeping: the scheduler reads which images a chunk needs; only the
runner fills and reads the tensors.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from node_engine.vision.mrope import prompt_positions
from node_engine.vision.processor import ResizedImage

Grid = tuple[int, int, int]


@dataclass(eq=False)
class ImageInput:
    offset: int               # index in the prompt of the image's first token
    num_tokens: int           # its tokens, after the merge
    grid: Grid                # its patches: temporal, height, width
    source: ResizedImage      # what it is encoded from
    cache_key: int            # stands for each of its tokens in the prefix cache (from the image's content)
    embeddings: torch.Tensor | None = None  # [num_tokens, hidden] between its encode and its last token's prefill

    @property
    def end(self) -> int:
        return self.offset + self.num_tokens


@dataclass(eq=False)
class MultimodalPrompt:
    images: list[ImageInput]
    num_prompt_tokens: int
    merge_size: int
    rope_delta: int = 0
    _positions: torch.Tensor | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        positions = self.positions()
        self.rope_delta = int(positions.max().item()) + 1 - self.num_prompt_tokens if positions.numel() else 0

    @property
    def num_image_tokens(self) -> int:
        return sum(image.num_tokens for image in self.images)

    def positions(self) -> torch.Tensor:
        """[3, prompt tokens] M-RoPE positions (kept until :meth:`drop_positions`)."""
        if self._positions is None:
            self._positions, _ = prompt_positions(self.num_prompt_tokens,
                                                  [(image.offset, image.grid) for image in self.images],
                                                  self.merge_size)
        return self._positions

    def rope_positions(self, start: int, end: int) -> torch.Tensor:
        """[3, end - start] positions of tokens ``start..end``; past the prompt, index + delta on all three."""
        prompt_end = min(end, self.num_prompt_tokens)
        parts = []
        if start < prompt_end:
            parts.append(self.positions()[:, start:prompt_end])
        if end > prompt_end:
            first = max(start, prompt_end)
            parts.append(torch.arange(first + self.rope_delta, end + self.rope_delta).expand(3, -1))
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)

    def drop_positions(self) -> None:
        self._positions = None

    def needing_encode(self, start: int, end: int) -> list[ImageInput]:
        """Images with a token in ``start..end`` and no embeddings yet, in prompt order."""
        return [image for image in self.images
                if image.embeddings is None and image.offset < end and image.end > start]

    def release_consumed(self, end: int) -> None:
        """Drop the embeddings of every image whose tokens are all before ``end`` (computed)."""
        for image in self.images:
            if image.end <= end:
                image.embeddings = None

    def forget_features(self) -> None:
        """A preempted or finished request: nothing derived from the images stays."""
        for image in self.images:
            image.embeddings = None
        self._positions = None

    def fresh(self) -> "MultimodalPrompt":
        """The same images for another request (each request owns its features: one's prefill must not drop
        what another still needs); the sources are shared, they are never written."""
        images = [ImageInput(offset=i.offset, num_tokens=i.num_tokens, grid=i.grid, source=i.source,
                             cache_key=i.cache_key) for i in self.images]
        return MultimodalPrompt(images=images, num_prompt_tokens=self.num_prompt_tokens, merge_size=self.merge_size)

    def cache_keys(self, prompt_ids: list[int]) -> list[int]:
        """The prompt as the prefix cache sees it: each image token replaced by its image's key, so the KV
        of one image is never reused for another."""
        keys = list(prompt_ids)
        for image in self.images:
            keys[image.offset:image.end] = [image.cache_key] * image.num_tokens
        return keys
