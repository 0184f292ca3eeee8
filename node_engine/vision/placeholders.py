"""Image placeholders in a prompt, expanded to each image's token count.

A placeholder is a run of one or more image tokens (``<|image_pad|>``), as
Qwen2-VL's chat template writes it between ``<|vision_start|>`` and
``<|vision_end|>``, collapsed or already expanded; in text, ``<image>`` is
accepted too and stands for the whole ``<|vision_start|><|image_pad|>
<|vision_end|>``. The n-th placeholder takes the n-th image. The prompt must
hold exactly one placeholder per image and must not end inside one (the token
after the prompt rotates as text).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

from node_engine.vision.arch import VisionArch
from node_engine.vision.inputs import ImageInput, MultimodalPrompt
from node_engine.vision.processor import ImageProcessor, ResizedImage

GENERIC_TEXT_PLACEHOLDER = "<image>"


class PlaceholderError(ValueError):
    """The prompt and its images do not match; the message says how."""


def native_placeholder(vision: VisionArch, decode) -> str:
    """The model's own spelling of one image placeholder (``decode``: ids -> text, special tokens kept)."""
    return decode([vision.vision_start_token_id, vision.image_token_id, vision.vision_end_token_id])


def normalize_text(text: str, native: str) -> str:
    return text.replace(GENERIC_TEXT_PLACEHOLDER, native)


def placeholder_runs(prompt_ids: Sequence[int], image_token_id: int) -> list[tuple[int, int]]:
    """(start, end) of every run of image tokens."""
    runs = []
    start = None
    for i, token in enumerate(prompt_ids):
        if token == image_token_id:
            if start is None:
                start = i
        elif start is not None:
            runs.append((start, i))
            start = None
    if start is not None:
        runs.append((start, len(prompt_ids)))
    return runs


def content_key(image: ResizedImage) -> int:
    """A negative number (never a token id) that stands for the image's pixels in the prefix cache."""
    hasher = hashlib.blake2b(digest_size=8, person=b"handoff-image")
    hasher.update(f"{image.height}x{image.width}:".encode())
    hasher.update(image.pixels.tobytes())
    return -1 - (int.from_bytes(hasher.digest(), "little") >> 1)


def check_placeholders(prompt_ids: Sequence[int], num_images: int, vision: VisionArch) -> list[tuple[int, int]]:
    """The placeholder runs of a prompt that holds one per image and does not end inside one (else
    :class:`PlaceholderError`): what :func:`expand` needs, checked before any image is decoded."""
    runs = placeholder_runs(prompt_ids, vision.image_token_id)
    if len(runs) != num_images:
        raise PlaceholderError(f"the prompt has {len(runs)} image placeholder(s) for {num_images} image(s); "
                               "put one <|vision_start|><|image_pad|><|vision_end|> (or <image>) per image")
    if runs and runs[-1][1] == len(prompt_ids):
        raise PlaceholderError("the prompt ends with an image; close it (<|vision_end|>) and put the question after")
    return runs


def expand(prompt_ids: Sequence[int], images: Sequence[ResizedImage], vision: VisionArch,
           processor: ImageProcessor, keys: Sequence[int] | None = None) -> tuple[list[int], MultimodalPrompt]:
    """The prompt with each placeholder expanded to its image's tokens, and the images' bookkeeping. ``keys``:
    each image's :func:`content_key`, computed already (a server hashes the pixels off its event loop: 64
    images at Qwen2-VL's default pixel limit are about 190 MB); without them, they are computed here."""
    runs = check_placeholders(prompt_ids, len(images), vision)
    if keys is None:
        keys = [content_key(image) for image in images]
    ids: list[int] = []
    inputs: list[ImageInput] = []
    previous_end = 0
    for (start, end), image, key in zip(runs, images, keys, strict=True):
        ids.extend(prompt_ids[previous_end:start])
        num_tokens = processor.num_tokens(image)
        inputs.append(ImageInput(offset=len(ids), num_tokens=num_tokens, grid=processor.grid(image), source=image,
                                 cache_key=key))
        ids.extend([vision.image_token_id] * num_tokens)
        previous_end = end
    ids.extend(prompt_ids[previous_end:])
    return ids, MultimodalPrompt(images=inputs, num_prompt_tokens=len(ids), merge_size=vision.spatial_merge_size)
