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


_SAFETENSORS_NAMES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.int8: "I8", torch.float64: "F64",
                      torch.bool: "BOOL", torch.int64: "I64"}


def save_packed_safetensors(path: Path, tensors: dict[str, torch.Tensor]) -> Path:
    """``tensors`` written back to back in the given order with no padding (the ``safetensors`` library sorts
    them so every one is aligned; this file may hold a float32 tensor at an odd offset, which the format allows)."""
    import json
    import struct

    header: dict[str, dict] = {}
    data = bytearray()
    for name, tensor in tensors.items():
        raw = tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() if tensor.numel() else b""
        header[name] = {"dtype": _SAFETENSORS_NAMES[tensor.dtype], "shape": list(tensor.shape),
                        "data_offsets": [len(data), len(data) + len(raw)]}
        data += raw
    encoded = json.dumps(header).encode()
    encoded += b" " * (-len(encoded) % 8)
    path.write_bytes(struct.pack("<Q", len(encoded)) + encoded + bytes(data))
    return path


def packed_sample() -> dict[str, torch.Tensor]:
    """Tensors of every kind a run read must split: odd offsets, an empty tensor, a scalar, bools."""
    gen = torch.Generator().manual_seed(3)
    return {"half": torch.randn(3, generator=gen).bfloat16(), "odd_f32": torch.randn(5, 2, generator=gen),
            "bytes": torch.randint(-100, 100, (7,), dtype=torch.int8, generator=gen),
            "odd_f64": torch.randn(2, generator=gen, dtype=torch.float64), "empty": torch.zeros(0, 4),
            "flags": torch.tensor([True, False, True]), "scalar": torch.tensor(7, dtype=torch.int64),
            "tail": torch.randn(9, 3, generator=gen)}
