"""The image path against transformers' Qwen2-VL image processor, loaded as SGLang 0.5.23 loads it.

For generated images (1 x 1 to about a megapixel, aspect ratios up to 200 and past it, RGB, RGBA, L, LA, P with
and without a transparent colour, CMYK, I;16, 1) and the ``preprocessor_config.json`` of real checkpoints
(Qwen2-VL-7B's and Qwen2.5-VL-7B's, the same re-saved by transformers 5, which writes only ``size``), the
built-in ``tiny-vl``'s and odd ones: the resized size and ``image_grid_thw``, the placeholder tokens each image
becomes in the prompt, and the pixel values.

The reference is SGLang's processor: ``AutoImageProcessor`` on the checkpoint folder, with the ``size`` that
SGLang's ``get_processor`` forces on a ``qwen2_vl`` model (``utils/hf_transformers/processor.py``: 3136 to
1003520 pixels unless the file has ``min_pixels``/``max_pixels``), and its Pillow backend.

Tolerance: none, the pixel values are compared exactly. The Pillow backend runs the engine's filter (Pillow's
bicubic) and the same float32 operations. The torchvision backend, which SGLang picks when torchvision is
installed, resamples with its own bicubic on ``uint8``: measured against this one (transformers 5.24,
torchvision 0.28, 108 random images), at most 2 of 255 levels (mean 0.01) where both sides are scaled the same
way, up to 23 levels (mean 0.45) where one side is enlarged and the other shrunk (an image of 901 x 5: its
separable passes round and clamp in another order). The grid and token counts do not depend on the filter.

Transparency is SGLang 0.5.23's: its loader for Qwen-VL converts any image that is not RGB with Pillow's
``convert("RGB")`` before the processor sees it (``multimodal/processors/base_processor.py``,
``_load_single_item``, ``discard_alpha_channel``), dropping the alpha (a transparent pixel shows the colour it
stores). The transformers SGLang 0.5.23 pins (5.19.0) then leaves an RGB image as it is (its ``convert_to_rgb``
converts only other modes), so a colour marked transparent (a palette's, kept by Pillow as the RGB image's
``transparency``, or an RGB PNG's ``tRNS``) stays that colour; later transformers (5.24, installed here) composite
such an image onto white. The reference here is fed the pixels SGLang's loader hands over, as an array. EXIF
orientation is applied by none of the three (SGLang transposes only with ``smart_rgb_conversion``, which GLM-4V's
processor sets).
"""

from __future__ import annotations

import io
import json
import types
import warnings
from dataclasses import replace
from functools import lru_cache
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from PIL import Image

from node_engine.model.builtin import BUILTIN_PROCESSOR, IMAGE_PAD_ID, builtin_arch
from node_engine.vision.arch import QWEN2_5_VL, QWEN2_VL, VisionArch
from node_engine.vision.decode import ImagePolicy, decode_image
from node_engine.vision.placeholders import expand
from node_engine.vision.processor import ImageProcessor, ImageShapeError, ProcessorConfig
from tests.node_engine.vl_checkpoints import PLACEHOLDER, encoded, text_ids

pytest.importorskip("transformers")

CLIP = {"image_mean": [0.48145466, 0.4578275, 0.40821073], "image_std": [0.26862954, 0.26130258, 0.27577711]}
QWEN2_VL_7B = {"min_pixels": 3136, "max_pixels": 12845056, "patch_size": 14, "temporal_patch_size": 2,
               "merge_size": 2, **CLIP, "image_processor_type": "Qwen2VLImageProcessor",
               "processor_class": "Qwen2VLProcessor"}
QWEN2_5_VL_7B = {**QWEN2_VL_7B, "processor_class": "Qwen2_5_VLProcessor"}
# What transformers 5's save_pretrained writes for either: the bounds in ``size`` only.
RESAVED = {key: value for key, value in QWEN2_VL_7B.items() if key not in ("min_pixels", "max_pixels")}
RESAVED["size"] = {"shortest_edge": 3136, "longest_edge": 12845056}
SMALL = {**RESAVED, "size": {"shortest_edge": 1000, "longest_edge": 28 * 28 * 40}}
ODD = {**QWEN2_VL_7B, "min_pixels": None, "max_pixels": 50000, "image_mean": [0.5] * 3, "image_std": [0.5] * 3}
SGLANG_QWEN2_VL_SIZE = {"shortest_edge": 3136, "longest_edge": 1003520}
CONFIGS = {
    "qwen2-vl-7b": (QWEN2_VL, QWEN2_VL_7B),
    "qwen2.5-vl-7b": (QWEN2_5_VL, QWEN2_5_VL_7B),
    "qwen2-vl-resaved": (QWEN2_VL, RESAVED),
    "qwen2.5-vl-resaved": (QWEN2_5_VL, RESAVED),
    "qwen2-vl-small": (QWEN2_VL, SMALL),
    "qwen2.5-vl-small": (QWEN2_5_VL, SMALL),
    "qwen2.5-vl-odd": (QWEN2_5_VL, ODD),
    "tiny-vl": (QWEN2_VL, BUILTIN_PROCESSOR.to_json()),
}
MODES = ("RGB", "RGBA", "L", "LA", "P", "PT", "CMYK", "I;16", "1")
TINY_VISION = builtin_arch("builtin:tiny-vl").vision


def _vision(architecture: str) -> VisionArch:
    return replace(TINY_VISION, architecture=architecture, window_size=112)


def _folder(tmp: Path, name: str) -> Path:
    folder = tmp / name
    if not folder.exists():
        folder.mkdir()
        (folder / "preprocessor_config.json").write_text(json.dumps(CONFIGS[name][1]))
    return folder


@lru_cache(maxsize=None)
def _processors(tmp: Path, name: str):
    """(the engine's processor, SGLang's reference) for a checkpoint folder."""
    from transformers import AutoImageProcessor

    architecture, _ = CONFIGS[name]
    folder = _folder(tmp, name)
    forced = {"size": dict(SGLANG_QWEN2_VL_SIZE)} if architecture == QWEN2_VL else {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        reference = AutoImageProcessor.from_pretrained(folder, backend="pil", **forced)
    return ImageProcessor(ProcessorConfig.for_model(_vision(architecture), folder)), reference


def _image(height: int, width: int, mode: str, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    rgba = Image.fromarray(rng.integers(0, 256, (height, width, 4), dtype=np.uint8), "RGBA")
    if mode in ("RGBA", "LA"):
        return rgba.convert(mode)
    if mode in ("P", "PT"):
        image = rgba.convert("RGB").convert("P", palette=Image.Palette.ADAPTIVE, colors=64)
        if mode == "PT":
            image.info["transparency"] = 5
        return image
    if mode == "I;16":
        return Image.fromarray(rng.integers(0, 65536, (height, width), dtype=np.uint16))
    return rgba.convert("RGB").convert(mode)


def sglang_loaded(image: Image.Image) -> Image.Image:
    """The image as SGLang 0.5.23's ``_load_single_item`` hands it to a Qwen-VL processor (``discard_alpha_channel``,
    no ``smart_rgb_conversion``): converted to RGB unless it is RGB already."""
    return image.convert("RGB") if image.mode != "RGB" else image


def _sglang_input(image: Image.Image) -> np.ndarray:
    """What the processor of SGLang's pinned transformers (5.19.0) works on: the RGB pixels as they are."""
    return np.asarray(sglang_loaded(image))


def _compare(processor: ImageProcessor, reference, image: Image.Image) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            theirs = reference(images=[_sglang_input(image)], return_tensors="pt",
                               input_data_format="channels_last")
        except ValueError as exc:  # an aspect ratio past 200: refused by both
            with pytest.raises(ImageShapeError):
                processor.resize(image)
            assert "aspect ratio" in str(exc)
            return
    resized = processor.resize(image)
    grid = theirs["image_grid_thw"][0].tolist()
    assert list(processor.grid(resized)) == grid
    assert (resized.height, resized.width) == (grid[1] * 14, grid[2] * 14)
    merge = processor.config.merge_size
    assert processor.num_tokens(resized) == grid[0] * grid[1] * grid[2] // merge ** 2
    assert torch.equal(processor.pixel_values(resized), theirs["pixel_values"])


SIDES = st.integers(1, 800)


@settings(max_examples=50, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(name=st.sampled_from(sorted(CONFIGS)), height=SIDES, width=SIDES, mode=st.sampled_from(MODES),
       seed=st.integers(0, 2**16))
@example(name="qwen2-vl-resaved", height=900, width=1200, mode="RGB", seed=0)   # past 1003520 pixels
@example(name="qwen2.5-vl-odd", height=300, width=200, mode="RGB", seed=0)
@example(name="qwen2-vl-7b", height=1, width=1, mode="RGB", seed=0)
@example(name="qwen2-vl-7b", height=1, width=200, mode="L", seed=1)             # ratio 200: taken
@example(name="qwen2-vl-7b", height=3, width=601, mode="RGB", seed=2)           # past 200: refused by both
@example(name="tiny-vl", height=1100, width=6, mode="RGBA", seed=3)
@example(name="qwen2-vl-small", height=29, width=27, mode="PT", seed=4)
@example(name="qwen2.5-vl-small", height=57, width=55, mode="CMYK", seed=5)
def test_the_processor_matches_sglangs(tmp_path_factory: pytest.TempPathFactory, name: str, height: int,
                                       width: int, mode: str, seed: int) -> None:
    tmp = tmp_path_factory.getbasetemp()
    processor, reference = _processors(tmp, name)
    _compare(processor, reference, _image(height, width, mode, seed))


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_the_processor_bounds_match_sglangs(tmp_path: Path, name: str) -> None:
    processor, reference = _processors(tmp_path, name)
    assert (processor.config.min_pixels, processor.config.max_pixels) == (reference.size.shortest_edge,
                                                                          reference.size.longest_edge)
    assert processor.config.image_mean == pytest.approx(reference.image_mean)
    assert processor.config.image_std == pytest.approx(reference.image_std)


def test_exif_orientation_is_not_applied() -> None:
    """A JPEG 40 high and 90 wide marked "rotate 90": processed as stored, 40 x 90, as SGLang and transformers do."""
    buffer = io.BytesIO()
    exif = Image.Exif()
    exif[0x0112] = 6
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (40, 90, 3), dtype=np.uint8)).save(
        buffer, "JPEG", exif=exif)
    image = decode_image(buffer.getvalue(), ImagePolicy())
    assert image.getexif().get(0x0112) == 6
    processor = ImageProcessor(ProcessorConfig(min_pixels=3136, max_pixels=28 * 28 * 64))
    resized = processor.resize(image)
    assert (resized.height, resized.width) == (56, 84)
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    reference = Qwen2VLImageProcessorPil(min_pixels=3136, max_pixels=28 * 28 * 64)
    _compare(processor, reference, image)


def _transparent_pngs() -> dict[str, bytes]:
    """Seeded random PNGs with transparency, and 16-bit ones: each as a client would send it."""
    rng = np.random.default_rng(20240607)
    rgba = rng.integers(0, 256, (37, 53, 4), dtype=np.uint8)
    rgba[..., 3] = rng.choice(np.array([0, 1, 128, 254, 255], dtype=np.uint8), (37, 53))
    palette = Image.fromarray(rgba[..., :3], "RGB").convert("P", palette=Image.Palette.ADAPTIVE, colors=32)
    palette.info["transparency"] = 3
    la = Image.fromarray(rgba[..., [0, 3]], "LA")
    gray16 = Image.fromarray(rng.integers(0, 65536, (37, 53), dtype=np.uint16))
    rgb = Image.fromarray(rgba[..., :3] // 64 * 64, "RGB")  # few colours: the transparent one is frequent
    rgb.info["transparency"] = (64, 128, 192)
    return {"RGBA": encoded(Image.fromarray(rgba, "RGBA")), "LA": encoded(la), "P+transparency": encoded(palette),
            "RGB+tRNS": encoded(rgb), "I;16": encoded(gray16), "RGBA 16-bit": _rgba16_png(rng)}


def _rgba16_png(rng: np.random.Generator) -> bytes:
    """A 16-bit-per-channel RGBA PNG (Pillow cannot write one): written chunk by chunk."""
    import struct
    import zlib

    height, width = 19, 23
    values = rng.integers(0, 65536, (height, width, 4), dtype=np.uint16).astype(">u2")
    raw = b"".join(b"\x00" + values[row].tobytes() for row in range(height))

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", width, height, 16, 6, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b"")


@pytest.mark.parametrize("kind", sorted(_transparent_pngs()))
def test_transparency_is_dropped_as_sglang_drops_it(kind: str) -> None:
    """A transparent or 16-bit PNG gives the pixels SGLang 0.5.23 gives: Pillow's ``convert("RGB")`` of the decoded
    image (alpha dropped, a transparent pixel keeps the colour it stores), not a composite onto white."""
    data = _transparent_pngs()[kind]
    image = decode_image(data, ImagePolicy())
    theirs = Image.open(io.BytesIO(data))
    theirs.load()
    config = ProcessorConfig(min_pixels=56 * 56, max_pixels=28 * 28 * 64)
    processor = ImageProcessor(config)
    resized = processor.resize(image)
    expected = sglang_loaded(theirs).resize((resized.width, resized.height), resample=Image.Resampling.BICUBIC)
    assert np.array_equal(resized.pixels, np.asarray(expected).transpose(2, 0, 1))
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    _compare(processor, Qwen2VLImageProcessorPil(min_pixels=56 * 56, max_pixels=28 * 28 * 64), image)


def _reference_positions(architecture: str, ids: list[int], grids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """transformers' ``get_rope_index`` (the model's M-RoPE), on a stand-in for the model: only its config is read."""
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLModel
    from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VLModel

    model = Qwen2VLModel if architecture == QWEN2_VL else Qwen2_5_VLModel
    vision_config = types.SimpleNamespace(spatial_merge_size=2, tokens_per_second=2)
    stand_in = types.SimpleNamespace(config=types.SimpleNamespace(vision_config=vision_config))
    stand_in.get_vision_position_ids = lambda *args, **kwargs: model.get_vision_position_ids(stand_in, *args,
                                                                                              **kwargs)
    input_ids = torch.tensor([ids])
    positions, delta = model.get_rope_index(stand_in, input_ids, (input_ids == IMAGE_PAD_ID).int(),
                                            image_grid_thw=grids)
    return positions[:, 0], int(delta)


@pytest.mark.parametrize("architecture", [QWEN2_VL, QWEN2_5_VL])
@pytest.mark.parametrize("sizes", [[(60, 90)], [(60, 90), (17, 45), (400, 3), (200, 150)]], ids=["one", "four"])
def test_prompt_tokens_and_mrope_positions_match_transformers(architecture: str, sizes) -> None:
    processor = ImageProcessor(BUILTIN_PROCESSOR)
    images = [processor.resize(_image(h, w, "RGB", i)) for i, (h, w) in enumerate(sizes)]
    prompt = [256] + text_ids("look")
    for i in range(len(images)):
        prompt += PLACEHOLDER + text_ids(f" and {i}" if i < len(images) - 1 else "?")
    ids, mm = expand(prompt, images, _vision(architecture), processor)
    grids = torch.tensor([list(processor.grid(image)) for image in images])
    # <|vision_start|>, then grid_h * grid_w / merge^2 image tokens, then <|vision_end|>, per image
    expected = [256] + text_ids("look")
    for i, grid in enumerate(grids.tolist()):
        expected += [PLACEHOLDER[0]] + [IMAGE_PAD_ID] * (grid[1] * grid[2] // 4) + [PLACEHOLDER[2]]
        expected += text_ids(f" and {i}" if i < len(images) - 1 else "?")
    assert ids == expected
    positions, delta = _reference_positions(architecture, ids, grids)
    assert torch.equal(mm.positions(), positions)
    assert mm.rope_delta == delta
