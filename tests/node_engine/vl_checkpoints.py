"""Tiny Qwen2-VL / Qwen2.5-VL checkpoints made with transformers, and test images."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from node_engine.model.builtin import IMAGE_PAD_ID, VIDEO_PAD_ID, VISION_END_ID, VISION_START_ID
from node_engine.tokenizer import write_byte_tokenizer
from node_engine.vision.processor import ProcessorConfig

VL_KINDS = ("qwen2-vl", "qwen2.5-vl")
# At most 48 tokens per image: small enough for fast tests, large enough that window attention pads.
PROCESSOR = ProcessorConfig(min_pixels=56 * 56, max_pixels=28 * 28 * 48)
PLACEHOLDER = [VISION_START_ID, IMAGE_PAD_ID, VISION_END_ID]


def make_vl_checkpoint(folder: Path, kind: str, *, seed: int = 0):
    """Save a random ``kind`` model with the byte tokenizer and ``PROCESSOR``; returns the transformers model."""
    from transformers import (Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2VLConfig,
                              Qwen2VLForConditionalGeneration)

    torch.manual_seed(seed)
    text = dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=2048, bos_token_id=256, eos_token_id=257,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]})
    ids = dict(image_token_id=IMAGE_PAD_ID, video_token_id=VIDEO_PAD_ID, vision_start_token_id=VISION_START_ID,
               vision_end_token_id=VISION_END_ID)
    if kind == "qwen2-vl":
        vision = dict(depth=2, embed_dim=32, hidden_size=64, num_heads=2, mlp_ratio=2)
        model = Qwen2VLForConditionalGeneration(Qwen2VLConfig(text_config=text, vision_config=vision, **ids))
    elif kind == "qwen2.5-vl":
        # Windows of 2 x 2 merged tokens; block 1 attends over the whole image.
        vision = dict(depth=2, hidden_size=32, out_hidden_size=64, intermediate_size=48, num_heads=2, window_size=56,
                      fullatt_block_indexes=[1])
        model = Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(text_config=text, vision_config=vision, **ids))
    else:
        raise ValueError(kind)
    model.eval()
    with torch.no_grad():  # weights large enough that images and positions move the logits
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.normal_(1.0 if ("norm" in name or "ln_q" in name) and name.endswith("weight") else 0.0, 0.1)
            else:
                p.normal_(0.0, 1.5 * p[0].numel() ** -0.5)
    model.save_pretrained(folder)
    write_byte_tokenizer(folder, vision=True)
    (folder / "preprocessor_config.json").write_text(json.dumps(PROCESSOR.to_json()))
    return model


def hf_processor(config: ProcessorConfig = PROCESSOR):
    """transformers' PIL/numpy image processor (the slow one: nothing here depends on torchvision)."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(min_pixels=config.min_pixels, max_pixels=config.max_pixels)


def random_image(height: int, width: int, *, seed: int = 0, mode: str = "RGB") -> Image.Image:
    rng = np.random.default_rng(seed)
    rgb = Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))
    if mode == "RGBA":
        alpha = Image.fromarray(rng.integers(0, 256, (height, width), dtype=np.uint8))
        rgba = rgb.convert("RGBA")
        rgba.putalpha(alpha)
        return rgba
    return rgb.convert(mode)


def encoded(image: Image.Image, fmt: str = "PNG") -> bytes:
    """The image as a file of ``fmt``, as a client would send it."""
    buffer = io.BytesIO()
    image.save(buffer, fmt)
    return buffer.getvalue()


def progressive_jpeg(extra_scans: int) -> bytes:
    """A 64 x 64 progressive JPEG with ``extra_scans`` more DC refinement scans of its first component before its EOI:
    each a dozen bytes, each a pass of the decoder over every block of the image."""
    buffer = io.BytesIO()
    Image.new("L", (64, 64), 128).save(buffer, "JPEG", progressive=True)
    sos = b"\xff\xda\x00\x08\x01\x01\x00\x00\x00\x10" + b"\x00"  # 1 component, Ss=Se=0, Ah=1 Al=0
    return buffer.getvalue()[:-2] + sos * extra_scans + b"\xff\xd9"


def text_ids(text: str) -> list[int]:
    return list(text.encode())


def prompt_with_images(*parts: str | None) -> list[int]:
    """``<bos>`` then the parts in order: a string is text, ``None`` one image placeholder."""
    ids = [256]
    for part in parts:
        ids += PLACEHOLDER if part is None else text_ids(part)
    return ids
