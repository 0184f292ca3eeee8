"""Multimodal rotary positions (M-RoPE) of Qwen2-VL / Qwen2.5-VL.

Every token has three positions (temporal, height, width). A text token has
the same value in all three, one more than the token before; the tokens of an
image start at the position after the text before it, and spread over rows
(height) and columns (width) of its merged grid. The text after an image
continues after the image's largest position, so a prompt with images has
fewer positions than tokens: ``delta = last position + 1 - number of tokens``
(zero or negative), and every token after the prompt (all text) sits at its
index plus ``delta``.

Rotating by three positions: the ``head_dim / 2`` frequencies are split in
three sections (``mrope_section``); section ``i`` rotates by position ``i``.
Both halves of the head dimension use the same split, as transformers does.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from node_engine.model.rotary import RotaryTable


def image_positions(start: int, grid: tuple[int, int, int], merge: int) -> torch.Tensor:
    """[3, tokens] positions of one image whose first token sits at ``start``."""
    t, h, w = grid[0], grid[1] // merge, grid[2] // merge
    temporal = torch.arange(t).view(t, 1, 1).expand(t, h, w)
    rows = torch.arange(h).view(1, h, 1).expand(t, h, w)
    cols = torch.arange(w).view(1, 1, w).expand(t, h, w)
    return torch.stack((temporal, rows, cols)).reshape(3, -1) + start


def prompt_positions(num_tokens: int, images: Sequence[tuple[int, tuple[int, int, int]]],
                     merge: int) -> tuple[torch.Tensor, int]:
    """[3, num_tokens] int64 positions of a prompt, and its ``delta``.

    ``images``: (index of the image's first token, its grid in patches), in prompt order.
    """
    parts: list[torch.Tensor] = []
    index = 0      # next token
    position = 0   # its position
    for offset, grid in images:
        if offset > index:
            parts.append(torch.arange(position, position + offset - index).expand(3, -1))
            position += offset - index
        image = image_positions(position, grid, merge)
        parts.append(image)
        index = offset + image.shape[1]
        position += max(grid[1], grid[2]) // merge
    if num_tokens > index:
        parts.append(torch.arange(position, position + num_tokens - index).expand(3, -1))
        position += num_tokens - index
    positions = torch.cat(parts, dim=1) if parts else torch.empty(3, 0, dtype=torch.int64)
    return positions, position - num_tokens


class MropeTable:
    """cos/sin of three positions per token, read from the text model's rotary table."""

    def __init__(self, rotary: RotaryTable, mrope_section: tuple[int, int, int]) -> None:
        self.rotary = rotary
        half = [i for i, n in enumerate(mrope_section) for _ in range(n)]
        self.section = torch.tensor(half + half, device=rotary.cos.device)  # [head_dim]: which position each uses

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin [T, 1, head_dim] of ``positions`` [3, T], laid out as ``RotaryTable.lookup``."""
        num = positions.shape[1]
        index = self.section.view(1, 1, -1).expand(1, num, -1)
        rows = positions.reshape(-1)
        cos = self.rotary.cos.index_select(0, rows).view(3, num, -1).gather(0, index)
        sin = self.rotary.sin.index_select(0, rows).view(3, num, -1).gather(0, index)
        return cos.view(num, 1, -1), sin.view(num, 1, -1)
