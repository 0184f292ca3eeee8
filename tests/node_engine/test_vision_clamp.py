"""The processor's exact worst case and the ``--max-image-tokens`` clamp, against transformers' ``smart_resize``."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from node_engine.vision.clamp import clamp_processor, worst_case
from node_engine.vision.processor import ProcessorConfig

QWEN2_VL = ProcessorConfig()                                  # 56*56 .. 28*28*1280
QWEN2_VL_LARGE = ProcessorConfig(max_pixels=28 * 28 * 16384)  # Qwen2-VL-7B-Instruct's preprocessor_config.json
SMALL = ProcessorConfig(min_pixels=28 * 28 * 4, max_pixels=28 * 28 * 256)


def _hf_tokens(config: ProcessorConfig, height: int, width: int) -> int:
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

    h_bar, w_bar = smart_resize(height, width, factor=config.factor, min_pixels=config.min_pixels,
                                max_pixels=config.max_pixels)
    return (h_bar // config.factor) * (w_bar // config.factor)


def _shapes(num: int = 6000, seed: int = 0) -> list[tuple[int, int]]:
    """Random shapes of every kind (tiny, huge, square, 200:1 and 1:200 exactly), plus every small image."""
    rng = random.Random(seed)
    shapes = []
    for _ in range(num):
        short = rng.choice([rng.randint(1, 40), rng.randint(1, 3000), rng.randint(1000, 20000)])
        ratio = rng.choice([rng.uniform(1, 200), 200.0, rng.uniform(190, 200), rng.uniform(1, 2)])
        long = max(short, min(int(short * ratio), 200 * short))
        shapes.append((long, short) if rng.random() < 0.5 else (short, long))
    shapes += [(h, w) for h in range(1, 400, 3) for w in (1, 2, 7, 13, 14, 15, 20) if max(h, w) <= 200 * min(h, w)]
    return shapes


@pytest.mark.parametrize("config", [QWEN2_VL, QWEN2_VL_LARGE, SMALL], ids=["default", "16k", "small"])
def test_worst_case_is_exact(config: ProcessorConfig) -> None:
    worst = worst_case(config)
    seen = max(_hf_tokens(config, h, w) for h, w in _shapes())
    assert seen <= worst.num_tokens  # an upper bound for every image sampled
    # ... and attained: the witness size itself resizes to exactly that many tokens.
    assert _hf_tokens(config, worst.image_height, worst.image_width) == worst.num_tokens


@pytest.mark.parametrize("cap", [15, 29, 64, 256, 1000, 2048])
def test_clamp_keeps_every_image_within_the_cap(cap: int) -> None:
    clamp = clamp_processor(QWEN2_VL_LARGE, cap)
    clamped = clamp.processor
    assert clamp.is_changed and clamp.worst.num_tokens <= cap
    assert max(_hf_tokens(clamped, h, w) for h, w in _shapes(3000, seed=cap)) <= cap
    # The largest such setting: one more pixel of max_pixels lets some image exceed the cap.
    looser = replace(clamped, max_pixels=clamped.max_pixels + 1)
    assert worst_case(looser).num_tokens > cap
    witness = worst_case(looser)
    assert _hf_tokens(looser, witness.image_height, witness.image_width) > cap


def test_a_naive_clamp_is_not_enough() -> None:
    """max_pixels = cap x 28 x 28 lets a 200:1 image through with far more tokens than the cap."""
    cap = 64
    naive = replace(QWEN2_VL, max_pixels=cap * 28 * 28)
    assert _hf_tokens(naive, 20000, 100) > cap
    assert _hf_tokens(clamp_processor(QWEN2_VL, cap).processor, 20000, 100) <= cap


def test_small_images_alone_lower_min_pixels() -> None:
    """A 200 x 1 image scales up to 29 tokens at the default min_pixels; a cap of 20 must lower min_pixels."""
    assert _hf_tokens(QWEN2_VL, 200, 1) == 29
    clamp = clamp_processor(QWEN2_VL, 20)
    assert clamp.processor.min_pixels < QWEN2_VL.min_pixels
    assert _hf_tokens(clamp.processor, 200, 1) <= 20


def test_a_processor_within_the_cap_is_unchanged() -> None:
    clamp = clamp_processor(QWEN2_VL, 1280)
    assert not clamp.is_changed and clamp.processor == QWEN2_VL and clamp.worst.num_tokens == 1280
