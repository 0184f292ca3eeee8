"""Qwen2-VL and Qwen2.5-VL against transformers on tiny random checkpoints (float32, CPU).

The image processor pixel for pixel, logits to 1e-4 with one and several images of
different sizes and aspect ratios, and greedy tokens through the engine's scheduler
(whole and chunked prefill, images split across chunks).
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from node_engine.config import EngineConfig
from node_engine.engine import Engine
from node_engine.memory.saver import DisabledSaver
from node_engine.model.source import load_model_source
from node_engine.runner import ModelRunner
from node_engine.sampling import SamplingParams
from node_engine.vision.placeholders import expand
from node_engine.vision.processor import ImageProcessor
from tests.node_engine.engine_harness import running_engine
from tests.node_engine.vl_checkpoints import (PROCESSOR, VL_KINDS, hf_processor, make_vl_checkpoint,
                                              prompt_with_images, random_image)

# Several sizes and aspect ratios: scaled down, scaled up (tiny), extreme (1:10), odd grids that pad windows.
IMAGES = [(60, 90), (30, 300), (200, 150), (17, 45)]
MULTI_PROMPT = prompt_with_images("look ", None, " and ", None, " then", None, " or", None, " ok?")
ONE_PROMPT = prompt_with_images("what is", None, " here?")
CAP = 4096  # --max-image-tokens above the processor's own worst case: no clamp, as transformers processes


@pytest.fixture(scope="module", params=VL_KINDS)
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    folder = tmp_path_factory.mktemp(request.param)
    return folder, make_vl_checkpoint(folder, request.param)


@pytest.fixture(scope="module")
def runner(checkpoint) -> ModelRunner:
    folder, _ = checkpoint
    config = EngineConfig(model_path=str(folder), max_total_tokens=1024, max_image_tokens=CAP)
    arch, _ = load_model_source(config)
    return ModelRunner(config, DisabledSaver(), arch)


def _hf_inputs(ids: list[int], images) -> dict:
    pixels = hf_processor()(images=images, return_tensors="pt")
    input_ids = torch.tensor([ids])
    return dict(input_ids=input_ids, pixel_values=pixels["pixel_values"], image_grid_thw=pixels["image_grid_thw"],
                mm_token_type_ids=(input_ids == 260).int())


@pytest.mark.parametrize("mode", ["RGB", "RGBA", "L", "P"])
def test_processor_matches_transformers_pixel_for_pixel(mode: str) -> None:
    images = [random_image(h, w, seed=i, mode=mode) for i, (h, w) in enumerate(IMAGES + [(400, 2), (3, 3)])]
    # fed as SGLang's loader feeds it: convert("RGB") of anything not RGB (transparency dropped, not composited)
    theirs = hf_processor()(images=[i if i.mode == "RGB" else i.convert("RGB") for i in images], return_tensors="pt")
    processor = ImageProcessor(PROCESSOR)
    resized = [processor.resize(image) for image in images]
    assert [list(processor.grid(r)) for r in resized] == theirs["image_grid_thw"].tolist()
    ours = torch.cat([processor.pixel_values(r) for r in resized])
    assert torch.equal(ours, theirs["pixel_values"])


@pytest.mark.parametrize("prompt,sizes", [(ONE_PROMPT, IMAGES[:1]), (MULTI_PROMPT, IMAGES)],
                         ids=["one-image", "four-images"])
def test_logits_match_transformers(checkpoint, runner: ModelRunner, prompt: list[int], sizes) -> None:
    _, reference = checkpoint
    images = [random_image(h, w, seed=i) for i, (h, w) in enumerate(sizes)]
    vision = runner.vision
    ids, mm = expand(prompt, [vision.processor.resize(image) for image in images], runner.arch.vision,
                     vision.processor)
    ours = runner.score(ids, mm)
    with torch.no_grad():
        theirs = reference(**_hf_inputs(ids, images)).logits[0]
    assert ours.shape == theirs.shape
    assert (ours - theirs).abs().max().item() < 1e-4
    # Guards the bound above: other pixels (the same image sizes) move the logits far more than 1e-4.
    others = [random_image(h, w, seed=100 + i) for i, (h, w) in enumerate(sizes)]
    _, other_mm = expand(prompt, [vision.processor.resize(image) for image in others], runner.arch.vision,
                         vision.processor)
    assert (runner.score(ids, other_mm) - theirs).abs().max().item() > 1e-2
    # The features were dropped once the prefill consumed them.
    assert all(image.embeddings is None for image in mm.images) and mm._positions is None


@pytest.fixture(scope="module")
def expected_greedy(checkpoint) -> tuple[list[int], list[int]]:
    _, reference = checkpoint
    images = [random_image(h, w, seed=i) for i, (h, w) in enumerate(IMAGES)]
    processor = ImageProcessor(PROCESSOR)
    ids, _ = expand(MULTI_PROMPT, [processor.resize(image) for image in images],
                    load_model_source(EngineConfig(model_path=str(checkpoint[0])))[0].vision, processor)
    with torch.no_grad():
        out = reference.generate(**_hf_inputs(ids, images), max_new_tokens=16, do_sample=False, eos_token_id=None,
                                 pad_token_id=319, min_new_tokens=16)
    return ids, out[0, len(ids):].tolist()


async def _engine_greedy(engine: Engine, images) -> tuple[list[int], list[int]]:
    vision = engine.runner.vision
    ids, mm = expand(MULTI_PROMPT, [vision.processor.resize(image) for image in images], engine.arch.vision,
                     vision.processor)
    params = SamplingParams(max_new_tokens=16, temperature=0, ignore_eos=True)
    engine.gate.check(ids, params)
    handle = engine.submit(ids, params, mm=mm)
    tokens: list[int] = []
    while True:
        out = await asyncio.wait_for(handle.next(), timeout=60)
        tokens += out.token_ids_delta
        if out.is_final:
            return ids, tokens


@pytest.mark.parametrize("max_batch_tokens", [4096, 7], ids=["whole-prefill", "chunks-of-7"])
async def test_greedy_tokens_match_generate(checkpoint, expected_greedy, max_batch_tokens: int) -> None:
    """16 greedy tokens after four images; with chunks of 7 tokens every image spans several steps, images
    are deferred by the per-step budget, and decode rotates by M-RoPE's delta."""
    expected_ids, expected = expected_greedy
    config = EngineConfig(model_path=str(checkpoint[0]), max_total_tokens=1024, max_batch_tokens=max_batch_tokens,
                          max_image_tokens=CAP)
    async with running_engine(config) as engine:
        images = [random_image(h, w, seed=i) for i, (h, w) in enumerate(IMAGES)]
        ids, tokens = await _engine_greedy(engine, images)
        assert ids == expected_ids
        assert tokens == expected
        # The same images again: the prefix cache reuses the image tokens' KV and the tokens are the same.
        _, again = await _engine_greedy(engine, images)
        assert again == expected and engine.scheduler.num_prefix_hit_tokens >= len(ids) - 1
        # Other images of the same sizes: same placeholders, never the cached KV.
        hits = engine.scheduler.num_prefix_hit_tokens
        _, other = await _engine_greedy(engine, [random_image(h, w, seed=50 + i) for i, (h, w) in enumerate(IMAGES)])
        assert other != expected
        assert engine.scheduler.num_prefix_hit_tokens - hits < len(ids) // 2
