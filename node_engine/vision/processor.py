"""The Qwen2-VL image processor: resize to a multiple of the merged patch, rescale, normalize, patch.

The same arithmetic, in the same order, as transformers' PIL/numpy processor
(``Qwen2VLImageProcessorPil``), which Qwen2.5-VL shares, fed as SGLang feeds it: RGB (Pillow's
``convert("RGB")``: transparency dropped, as SGLang's loader does), a bicubic PIL resize to the size
:func:`smart_resize` picks, ``uint8 -> float64 x rescale -> float32``, ``(x - mean) / std`` in
float32, then patches ordered merge group by merge group. The parity tests
compare the two pixel for pixel.

The work is split in two so that a request keeps only the small part until
its image is encoded: :meth:`ImageProcessor.resize` (the resized ``uint8``
image, 1/8 of the pixel values' bytes) at request time, and
:meth:`ImageProcessor.pixel_values` right before the vision tower runs.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from node_engine.model.errors import ModelConfigError
from node_engine.vision.arch import VisionArch

OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
MAX_ASPECT_RATIO = 200  # the processor refuses images longer than this many times their width (or the reverse)
DEFAULT_MIN_PIXELS = 56 * 56
DEFAULT_MAX_PIXELS = 28 * 28 * 1280


class ImageShapeError(ValueError):
    """An image the processor cannot take (aspect ratio beyond 200, colours Pillow cannot convert to RGB)."""


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """The processor's target size: multiples of ``factor``, ``min_pixels..max_pixels`` pixels in most cases,
    the aspect ratio nearly kept (transformers' function, operation for operation).

    The pixel bounds are not a guarantee: an image far from square keeps at least ``factor`` pixels on its
    short side, and a tiny image is scaled up without looking at ``max_pixels``; ``clamp.py`` computes what
    that means for the token count.
    """
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise ImageShapeError(f"absolute aspect ratio must be smaller than {MAX_ASPECT_RATIO}, "
                              f"got {max(height, width) / min(height, width)}")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


@dataclass(frozen=True)
class ProcessorConfig:
    """The processor's settings (``preprocessor_config.json``); ``max_pixels`` may be clamped at start."""

    min_pixels: int = DEFAULT_MIN_PIXELS
    max_pixels: int = DEFAULT_MAX_PIXELS
    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    rescale_factor: float = 1 / 255
    image_mean: tuple[float, float, float] = OPENAI_CLIP_MEAN
    image_std: tuple[float, float, float] = OPENAI_CLIP_STD

    def __post_init__(self) -> None:
        if not 1 <= self.min_pixels <= self.max_pixels:
            raise ModelConfigError(f"the image processor needs 1 <= min_pixels <= max_pixels, got "
                                   f"{self.min_pixels} and {self.max_pixels}")

    @property
    def factor(self) -> int:
        """Side of one language-model token, in pixels."""
        return self.patch_size * self.merge_size

    def num_tokens(self, height: int, width: int) -> int:
        """Language-model tokens of an image of ``height`` x ``width`` pixels, after resizing and merging."""
        h_bar, w_bar = smart_resize(height, width, self.factor, self.min_pixels, self.max_pixels)
        return (h_bar // self.factor) * (w_bar // self.factor)

    def with_pixels(self, min_pixels: int, max_pixels: int) -> "ProcessorConfig":
        return replace(self, min_pixels=min_pixels, max_pixels=max_pixels)

    @classmethod
    def for_model(cls, vision: VisionArch, folder: Path | None) -> "ProcessorConfig":
        """From ``folder/preprocessor_config.json`` when there is one, else the processor's defaults."""
        defaults = cls(patch_size=vision.patch_size, temporal_patch_size=vision.temporal_patch_size,
                       merge_size=vision.spatial_merge_size)
        path = folder / "preprocessor_config.json" if folder is not None else None
        if path is None or not path.is_file():
            return defaults
        try:
            raw = json.loads(path.read_text())
        except ValueError as exc:
            raise ModelConfigError(f"{path} is not valid JSON: {exc}") from exc
        return _from_preprocessor_config(raw, defaults, path, reads_size=vision.is_qwen2_5)

    def to_json(self) -> dict[str, Any]:
        """``preprocessor_config.json`` for this processor (what transformers' processor reads)."""
        return {"image_processor_type": "Qwen2VLImageProcessor", "min_pixels": self.min_pixels,
                "max_pixels": self.max_pixels, "size": {"shortest_edge": self.min_pixels,
                                                        "longest_edge": self.max_pixels},
                "patch_size": self.patch_size, "temporal_patch_size": self.temporal_patch_size,
                "merge_size": self.merge_size, "rescale_factor": self.rescale_factor,
                "image_mean": list(self.image_mean), "image_std": list(self.image_std),
                "do_resize": True, "do_rescale": True, "do_normalize": True, "do_convert_rgb": True,
                "resample": 3}


def _from_preprocessor_config(raw: dict[str, Any], defaults: ProcessorConfig, path: Path, *,
                              reads_size: bool) -> ProcessorConfig:
    """The settings as SGLang 0.5.23 loads them: ``min_pixels``/``max_pixels`` first (a null one is absent, as in
    transformers), then ``size``, which SGLang replaces for a Qwen2-VL model (``reads_size`` false) by the
    defaults, 56 x 56 to 28 x 28 x 1280 (``get_processor``, for ``model_type`` ``qwen2_vl``): a Qwen2-VL
    checkpoint re-saved by transformers 5, which writes its bounds only in ``size``, gets those."""
    size = raw.get("size") if reads_size and isinstance(raw.get("size"), dict) else {}
    for flag in ("do_resize", "do_rescale", "do_normalize", "do_convert_rgb"):
        if raw.get(flag) is False:
            raise ModelConfigError(f"{path.name}: {flag}=false is not supported")
    if raw.get("resample", 3) != 3:
        raise ModelConfigError(f"{path.name}: only bicubic resampling (resample=3) is supported")
    try:
        return ProcessorConfig(
            min_pixels=int(_given(raw, "min_pixels", size.get("shortest_edge", defaults.min_pixels))),
            max_pixels=int(_given(raw, "max_pixels", size.get("longest_edge", defaults.max_pixels))),
            patch_size=int(raw.get("patch_size", defaults.patch_size)),
            temporal_patch_size=int(raw.get("temporal_patch_size", defaults.temporal_patch_size)),
            merge_size=int(raw.get("merge_size", defaults.merge_size)),
            rescale_factor=float(raw.get("rescale_factor", defaults.rescale_factor)),
            image_mean=_triple(raw.get("image_mean", defaults.image_mean), "image_mean", path),
            image_std=_triple(raw.get("image_std", defaults.image_std), "image_std", path))
    except (TypeError, ValueError) as exc:
        if isinstance(exc, ModelConfigError):
            raise
        raise ModelConfigError(f"{path.name} has a field of the wrong type: {exc}") from exc


def _given(raw: dict[str, Any], key: str, otherwise: Any) -> Any:
    value = raw.get(key)
    return otherwise if value is None else value


def _triple(value: Any, name: str, path: Path) -> tuple[float, float, float]:
    if not isinstance(value, (list, tuple)) or len(value) != 3:
        raise ModelConfigError(f"{path.name}: {name} must be three numbers")
    return (float(value[0]), float(value[1]), float(value[2]))


@dataclass(frozen=True)
class ResizedImage:
    """An image at the size the processor picked: ``uint8`` [3, H, W], H and W multiples of the token side."""

    pixels: np.ndarray

    @property
    def height(self) -> int:
        return self.pixels.shape[1]

    @property
    def width(self) -> int:
        return self.pixels.shape[2]


class ImageProcessor:
    def __init__(self, config: ProcessorConfig) -> None:
        self.config = config

    def resize(self, image: Image.Image) -> ResizedImage:
        """The RGB image at its target size (raises :class:`ImageShapeError` for a too long or too thin one, or
        one Pillow cannot convert to RGB)."""
        cfg = self.config
        try:
            rgb = to_rgb(image)
        except (ValueError, OSError) as exc:  # a palette or transparency that decodes but does not convert
            raise ImageShapeError(f"the image cannot be converted to RGB (a corrupt palette or transparency?): "
                                  f"{exc}") from exc
        height, width = rgb.height, rgb.width
        h_bar, w_bar = smart_resize(height, width, cfg.factor, cfg.min_pixels, cfg.max_pixels)
        resized = rgb.resize((w_bar, h_bar), resample=Image.Resampling.BICUBIC)
        return ResizedImage(np.ascontiguousarray(np.asarray(resized).transpose(2, 0, 1)))

    def grid(self, resized: ResizedImage) -> tuple[int, int, int]:
        """Patches (temporal, height, width) of a resized image."""
        p = self.config.patch_size
        return 1, resized.height // p, resized.width // p

    def num_tokens(self, resized: ResizedImage) -> int:
        f = self.config.factor
        return (resized.height // f) * (resized.width // f)

    def pixel_values(self, resized: ResizedImage) -> torch.Tensor:
        """float32 patches [grid_h * grid_w, channels * temporal * patch * patch], merge group by merge group."""
        cfg = self.config
        image = (resized.pixels.astype(np.float64) * cfg.rescale_factor).astype(np.float32)
        mean = np.array(cfg.image_mean, dtype=np.float32)[:, None, None]
        std = np.array(cfg.image_std, dtype=np.float32)[:, None, None]
        image = (image - mean) / std
        return torch.from_numpy(patchify(image, cfg.patch_size, cfg.merge_size, cfg.temporal_patch_size))


def to_rgb(image: Image.Image) -> Image.Image:
    """RGB as SGLang 0.5.23's loader makes it for a Qwen-VL model: Pillow's ``convert("RGB")`` of any image that is
    not RGB (``_load_single_item``), so transparency is dropped, not composited (a transparent pixel shows the
    colour it stores), and transformers' own ``convert_to_rgb`` then has nothing to do."""
    return image if image.mode == "RGB" else image.convert("RGB")


def patchify(image: np.ndarray, patch_size: int, merge_size: int, temporal_patch_size: int) -> np.ndarray:
    """[C, H, W] float32 -> [grid_h * grid_w, C * T * p * p], the still image repeated over the T frames."""
    channels, height, width = image.shape
    grid_h, grid_w = height // patch_size, width // patch_size
    patches = image.reshape(channels, grid_h // merge_size, merge_size, patch_size,
                            grid_w // merge_size, merge_size, patch_size)
    patches = patches.transpose(1, 4, 2, 5, 0, 3, 6)  # (gh, gw, mh, mw, C, ph, pw)
    patches = np.broadcast_to(patches[:, :, :, :, :, None], (*patches.shape[:5], temporal_patch_size,
                                                             *patches.shape[5:]))
    return patches.reshape(grid_h * grid_w, channels * temporal_patch_size * patch_size * patch_size)
