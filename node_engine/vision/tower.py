"""The vision transformer of Qwen2-VL / Qwen2.5-VL and its patch merger.

Patches (``[N, channels x temporal x patch x patch]``, from ``processor.py``)
are embedded by one projection (the checkpoint's Conv3d, whose stride equals
its kernel), run through ``depth`` pre-norm blocks with 2-D rotary attention
inside each image, and every ``spatial_merge_size^2`` neighbouring patches are
merged into one language-model token. Qwen2.5-VL differs in three places:
RMSNorm instead of LayerNorm, a gated MLP, and window attention in every
block but ``fullatt_block_indexes`` (patches are reordered window by window
before the blocks and put back after the merger).

Parameter names are the checkpoint's keys without the ``visual.`` prefix, so
the loader maps them one to one. Parameters are created empty: the loader
fills them, inside the ``weights`` memory region.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from node_engine.model.layers import rms_norm
from node_engine.model.projection import Linear, _param
from node_engine.vision.arch import VisionArch

Grid = tuple[int, int, int]  # patches: temporal, height, width
NORM_EPS = 1e-6


def _activation(name: str):
    if name == "quick_gelu":
        return lambda x: x * torch.sigmoid(1.702 * x)
    if name == "gelu":
        return F.gelu
    if name == "gelu_pytorch_tanh":
        return lambda x: F.gelu(x, approximate="tanh")
    return F.silu


class _Norm(nn.Module):
    """LayerNorm with bias (Qwen2-VL) or RMSNorm (Qwen2.5-VL), eps 1e-6."""

    def __init__(self, size: int, *, is_rms: bool, device: torch.device, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = _param(size, device=device, dtype=dtype)
        self.bias = None if is_rms else _param(size, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.bias is None:
            return rms_norm(x, self.weight, NORM_EPS)
        return F.layer_norm(x, (x.shape[-1],), self.weight, self.bias, NORM_EPS)


class _Attention(nn.Module):
    def __init__(self, arch: VisionArch, *, device: torch.device, dtype: torch.dtype) -> None:
        super().__init__()
        self.num_heads = arch.num_heads
        self.head_dim = arch.head_dim
        self.qkv = Linear(arch.hidden_size, 3 * arch.hidden_size, bias=True, device=device, dtype=dtype)
        self.proj = Linear(arch.hidden_size, arch.hidden_size, bias=True, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, segments: "Segments") -> torch.Tensor:
        num = x.shape[0]
        q, k, v = self.qkv(x).view(num, 3, self.num_heads, self.head_dim).unbind(1)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        return self.proj(segments.attend(q, k, v).reshape(num, -1))


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """transformers' ``apply_rotary_pos_emb_vision`` for one tensor: in float32, back to ``x``'s dtype."""
    h = x.float()
    half = h.shape[-1] // 2
    rotated = torch.cat((-h[..., half:], h[..., :half]), dim=-1)
    return (h * cos + rotated * sin).to(x.dtype)


class _MLP(nn.Module):
    def __init__(self, arch: VisionArch, *, device: torch.device, dtype: torch.dtype) -> None:
        super().__init__()
        h, i = arch.hidden_size, arch.intermediate_size
        self.act = _activation(arch.hidden_act)
        self.is_gated = arch.is_qwen2_5
        if self.is_gated:
            self.gate_proj = Linear(h, i, bias=True, device=device, dtype=dtype)
            self.up_proj = Linear(h, i, bias=True, device=device, dtype=dtype)
            self.down_proj = Linear(i, h, bias=True, device=device, dtype=dtype)
        else:
            self.fc1 = Linear(h, i, bias=True, device=device, dtype=dtype)
            self.fc2 = Linear(i, h, bias=True, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.is_gated:
            return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))
        return self.fc2(self.act(self.fc1(x)))


class _Block(nn.Module):
    def __init__(self, arch: VisionArch, *, device: torch.device, dtype: torch.dtype) -> None:
        super().__init__()
        is_rms = arch.is_qwen2_5
        self.norm1 = _Norm(arch.hidden_size, is_rms=is_rms, device=device, dtype=dtype)
        self.norm2 = _Norm(arch.hidden_size, is_rms=is_rms, device=device, dtype=dtype)
        self.attn = _Attention(arch, device=device, dtype=dtype)
        self.mlp = _MLP(arch, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, segments: "Segments") -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, segments)
        return x + self.mlp(self.norm2(x))


class _Merger(nn.Module):
    def __init__(self, arch: VisionArch, *, device: torch.device, dtype: torch.dtype) -> None:
        super().__init__()
        self.merged_size = arch.hidden_size * arch.merge_unit
        self.ln_q = _Norm(arch.hidden_size, is_rms=arch.is_qwen2_5, device=device, dtype=dtype)
        self.mlp = nn.ModuleDict({
            "0": Linear(self.merged_size, self.merged_size, bias=True, device=device, dtype=dtype),
            "2": Linear(self.merged_size, arch.out_hidden_size, bias=True, device=device, dtype=dtype),
        })

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.ln_q(x).view(-1, self.merged_size)
        return self.mlp["2"](F.gelu(self.mlp["0"](x)))


class Segments:
    """Which patches attend to which: consecutive runs of the (reordered) patch sequence.

    Runs of equal length go through one batched attention call; runs of
    different lengths through one padded, masked call when padding costs at
    most as much as the real work (the windows of Qwen2.5-VL), else one call
    per run (whole images).
    """

    def __init__(self, lengths: Sequence[int], device: torch.device) -> None:
        self.lengths = [n for n in lengths if n > 0]
        self.total = sum(self.lengths)
        self.longest = max(self.lengths)
        self.is_uniform = len(set(self.lengths)) == 1
        self.pad_index: torch.Tensor | None = None
        if not self.is_uniform and self.longest * len(self.lengths) <= 2 * self.total:
            starts = torch.tensor([0] + self.lengths[:-1], device=device).cumsum(0)
            lens = torch.tensor(self.lengths, device=device)
            offsets = torch.arange(self.longest, device=device)
            self.is_real = offsets[None, :] < lens[:, None]                       # [S, L]
            self.pad_index = torch.where(self.is_real, starts[:, None] + offsets[None, :], self.total).reshape(-1)
            self.mask = self.is_real.view(len(self.lengths), 1, 1, self.longest)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Non-causal attention within each run; q, k, v and the result are [N, heads, head_dim]."""
        num_runs = len(self.lengths)
        if self.is_uniform:
            shape = (num_runs, self.longest, q.shape[1], q.shape[2])
            out = F.scaled_dot_product_attention(*(t.view(shape).transpose(1, 2) for t in (q, k, v)))
            return out.transpose(1, 2).reshape(q.shape)
        if self.pad_index is not None:
            shape = (num_runs, self.longest, q.shape[1], q.shape[2])
            padded = [torch.cat((t, t.new_zeros(1, *t.shape[1:]))).index_select(0, self.pad_index).view(shape)
                      .transpose(1, 2) for t in (q, k, v)]
            out = F.scaled_dot_product_attention(*padded, attn_mask=self.mask)
            return out.transpose(1, 2).reshape(-1, *q.shape[1:])[self.is_real.reshape(-1)]
        outs = []
        start = 0
        for n in self.lengths:
            part = [t[start:start + n].transpose(0, 1).unsqueeze(0) for t in (q, k, v)]
            outs.append(F.scaled_dot_product_attention(*part).squeeze(0).transpose(0, 1))
            start += n
        return torch.cat(outs)


class VisionTower(nn.Module):
    def __init__(self, arch: VisionArch, *, device: torch.device, dtype: torch.dtype) -> None:
        super().__init__()
        self.arch = arch
        self.device = device
        self.dtype = dtype
        self.patch_embed = nn.Module()
        self.patch_embed.proj = nn.Module()
        self.patch_embed.proj.weight = _param(arch.hidden_size, arch.in_channels, arch.temporal_patch_size,
                                              arch.patch_size, arch.patch_size, device=device, dtype=dtype)
        self.blocks = nn.ModuleList(_Block(arch, device=device, dtype=dtype) for _ in range(arch.depth))
        self.merger = _Merger(arch, device=device, dtype=dtype)
        spatial = arch.head_dim // 2
        self.inv_freq = 1.0 / (arch.rope_theta ** (torch.arange(0, spatial, 2, dtype=torch.float) / spatial))

    def forward(self, pixel_values: torch.Tensor, grids: Sequence[Grid]) -> torch.Tensor:
        """Merged tokens [N / merge_unit, out_hidden_size] of the images ``grids`` whose patches are stacked."""
        arch = self.arch
        weight = self.patch_embed.proj.weight
        x = F.linear(pixel_values.to(device=self.device, dtype=self.dtype), weight.view(weight.shape[0], -1))
        cos, sin = self._rotary(grids)
        full = Segments([h * w for t, h, w in grids for _ in range(t)], self.device)
        windows = None
        if arch.is_qwen2_5:
            order, window_lengths = window_order(grids, arch)
            order = order.to(self.device)
            x, cos, sin = (_by_merge_group(t, order, arch.merge_unit) for t in (x, cos, sin))
            windows = Segments(window_lengths, self.device)
        for i, block in enumerate(self.blocks):
            is_full = windows is None or i in arch.fullatt_block_indexes
            x = block(x, cos, sin, full if is_full else windows)
        merged = self.merger(x)
        if arch.is_qwen2_5:
            merged = merged[torch.argsort(order)]
        return merged

    def _rotary(self, grids: Sequence[Grid]) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [N, 1, head_dim] (float32) of every patch's (row, column), merge group by merge group."""
        m = self.arch.spatial_merge_size
        positions = []
        for t, h, w in grids:
            rows = torch.arange(h).view(h // m, m, 1, 1).expand(h // m, m, w // m, m).transpose(1, 2).reshape(-1)
            cols = torch.arange(w).view(1, 1, w // m, m).expand(h // m, m, w // m, m).transpose(1, 2).reshape(-1)
            positions.append(torch.stack((rows, cols), dim=-1).repeat(t, 1))
        freqs = torch.cat(positions)[..., None].float() * self.inv_freq        # [N, 2, head_dim / 4]
        freqs = torch.cat((freqs[:, 0], freqs[:, 1]), dim=-1)
        emb = torch.cat((freqs, freqs), dim=-1).to(self.device)
        return emb.cos().unsqueeze(1), emb.sin().unsqueeze(1)


def _by_merge_group(x: torch.Tensor, order: torch.Tensor, merge_unit: int) -> torch.Tensor:
    num = x.shape[0]
    return x.reshape(num // merge_unit, merge_unit, *x.shape[1:])[order].reshape(num, *x.shape[1:])


def window_order(grids: Sequence[Grid], arch: VisionArch) -> tuple[torch.Tensor, list[int]]:
    """Qwen2.5-VL: merge groups reordered window by window, and each window's length in patches."""
    merge = arch.spatial_merge_size
    side = arch.window_size // merge // arch.patch_size  # window side, in merge groups
    order: list[torch.Tensor] = []
    lengths: list[int] = []
    first = 0
    for t, h, w in grids:
        gh, gw = h // merge, w // merge
        index = torch.arange(t * gh * gw).reshape(t, gh, gw)
        pad_h, pad_w = side - gh % side, side - gw % side
        padded = F.pad(index, (0, pad_w, 0, pad_h), "constant", -100)
        nh, nw = (gh + pad_h) // side, (gw + pad_w) // side
        padded = padded.reshape(t, nh, side, nw, side).permute(0, 1, 3, 2, 4).reshape(t, nh * nw, side * side)
        counts = (padded != -100).sum(-1).reshape(-1)
        flat = padded.reshape(-1)
        order.append(flat[flat != -100] + first)
        lengths.extend((counts * arch.merge_unit).tolist())
        first += t * gh * gw
    return torch.cat(order), lengths
