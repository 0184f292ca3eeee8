"""What the weight tests share: greedy answers to compare engines by, and new weights saved as a checkpoint."""

from __future__ import annotations

from pathlib import Path

import httpx
import torch

from node_engine.model.builtin import builtin_arch, builtin_weights, save_checkpoint

PROMPTS = ["The first probe", "Another probe, longer"]
GREEDY = {"temperature": 0, "ignore_eos": True, "max_new_tokens": 8}


def greedy(url: str) -> list[list[int]]:
    """The greedy tokens ``url`` (an engine, a sidecar or the LB) answers the probes with."""
    r = httpx.post(url + "/generate", json={"text": PROMPTS, "sampling_params": GREEDY}, timeout=60)
    assert r.status_code == 200, r.text
    return [item["output_ids"] for item in r.json()]


def tiny_weights(seed: int) -> dict[str, torch.Tensor]:
    """``builtin:tiny``'s weights for ``seed`` (the engines start with seed 0)."""
    return builtin_weights(builtin_arch("builtin:tiny", {}), seed=seed)


def save_tiny(folder: Path, weights: dict[str, torch.Tensor]) -> Path:
    save_checkpoint(folder, builtin_arch("builtin:tiny", {}), weights)
    return folder
