"""Qwen2-VL / Qwen2.5-VL: the Qwen2 decoder of ``model/llama.py`` with a vision tower beside it.

The decoder is unchanged: images reach it as embeddings in place of their
placeholder tokens and M-RoPE reaches it as cos/sin (``CausalLM.forward``'s
``embeds`` and ``rope``). The tower's parameters are ordinary parameters of
the model, so they live in the ``weights`` region, are released, backed up,
resumed and reloaded with the rest.
"""

from __future__ import annotations

import torch

from node_engine.model.arch import ModelArch
from node_engine.model.llama import CausalLM, WeightTarget
from node_engine.vision.tower import VisionTower


class VisionLanguageLM(CausalLM):
    def __init__(self, arch: ModelArch, *, device: torch.device, dtype: torch.dtype) -> None:
        if arch.vision is None:
            raise ValueError("a vision-language model needs a vision architecture")
        super().__init__(arch, device=device, dtype=dtype)
        self.visual = VisionTower(arch.vision, device=device, dtype=dtype)

    def hf_weight_map(self) -> dict[str, WeightTarget]:
        mapping = super().hf_weight_map()
        for name, _ in self.visual.named_parameters():
            mapping[f"visual.{name}"] = WeightTarget(f"visual.{name}")
        return mapping


def build_model(arch: ModelArch, *, device: torch.device, dtype: torch.dtype) -> CausalLM:
    """The model class ``arch`` needs, with empty parameters."""
    if arch.vision is not None:
        return VisionLanguageLM(arch, device=device, dtype=dtype)
    return CausalLM(arch, device=device, dtype=dtype)


def vision_weight_shapes(arch: ModelArch) -> dict[str, tuple[int, ...]]:
    """Checkpoint key -> shape of every vision tower tensor (built on the meta device: no memory)."""
    if arch.vision is None:
        return {}
    tower = VisionTower(arch.vision, device=torch.device("meta"), dtype=torch.float32)
    return {f"visual.{name}": tuple(p.shape) for name, p in tower.named_parameters()}
