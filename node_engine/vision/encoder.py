"""The runner's side of images: encode a step's images, put them into a chunk, free what was consumed.

A prefill chunk is a run ``start..end`` of one request's tokens. Its image
tokens take the rows of their image's embeddings, and every token rotates by
its three M-RoPE positions (text tokens by three equal ones: the same as the
plain rotary table). After the step, the embeddings of images whose last
token was computed and the positions of prompts fully computed are dropped.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Callable

import torch
import torch.nn.functional as F

from node_engine.model.rotary import RotaryTable
from node_engine.vision.inputs import ImageInput, MultimodalPrompt
from node_engine.vision.mrope import MropeTable
from node_engine.vision.processor import ImageProcessor
from node_engine.vision.tower import VisionTower

# One chunk of a prefill: the request's images (None for a text request), and the tokens start..end computed.
Chunk = tuple[MultimodalPrompt | None, int, int]


class VisionEncoder:
    def __init__(self, tower: VisionTower, processor: ImageProcessor, rotary: RotaryTable,
                 mrope_section: tuple[int, int, int]) -> None:
        self.tower = tower
        self.processor = processor
        self.mrope = MropeTable(rotary, mrope_section)
        self.device = rotary.cos.device
        # Entered around every tower call; the start-up reservation replaces it with "lend me your memory".
        self.encode_context: Callable[[], AbstractContextManager] = nullcontext

    def encode(self, images: Sequence[ImageInput]) -> None:
        """Run the tower once over ``images``; each gets its own embeddings (pixel values are dropped here)."""
        if not images:
            return
        with self.encode_context():
            pixel_values = torch.cat([self.processor.pixel_values(image.source) for image in images])
            merged = self.tower(pixel_values, [image.grid for image in images])
            del pixel_values
        # Copies made outside the encode context: an image cut by its chunk's end keeps its embeddings into the
        # next step, and on CUDA they would otherwise hold part of the reservation's pool the next encode needs.
        if len(images) == 1:
            images[0].embeddings = merged.clone()
            return
        # One copy each, so that one request's finished image does not keep the whole step's output alive.
        for image, part in zip(images, merged.split([image.num_tokens for image in images]), strict=True):
            image.embeddings = part.clone()

    def embed(self, chunks: Sequence[Chunk], input_ids: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        """Token embeddings [T, hidden] of the chunks' tokens, image tokens replaced by their image's rows."""
        x = F.embedding(input_ids, table)
        base = 0
        for mm, start, end in chunks:
            if mm is not None:
                for image in mm.images:
                    low, high = max(image.offset, start), min(image.end, end)
                    if low >= high:
                        continue
                    if image.embeddings is None:
                        raise RuntimeError(f"image at token {image.offset} was not encoded before its chunk")
                    x[base + low - start:base + high - start] = image.embeddings[low - image.offset:high - image.offset]
            base += end - start
        return x

    def rope(self, chunks: Sequence[Chunk]) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin [T, 1, head_dim] of the chunks' tokens from their M-RoPE positions."""
        parts = [mm.rope_positions(start, end) if mm is not None else torch.arange(start, end).expand(3, -1)
                 for mm, start, end in chunks]
        positions = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
        return self.mrope.lookup(positions.to(self.device))

    @staticmethod
    def release_consumed(chunks: Sequence[Chunk]) -> None:
        """After the step: drop the embeddings (and positions) the computed tokens no longer need."""
        for mm, _, end in chunks:
            if mm is None:
                continue
            mm.release_consumed(end)
            if end >= mm.num_prompt_tokens:
                mm.drop_positions()
