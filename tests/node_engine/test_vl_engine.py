"""A vision-language engine (builtin:tiny-vl) end to end in-process: the clamp serves oversized images, features
are collected after prefill, memory stays flat, the vision reservation lives in ``workspace``."""

from __future__ import annotations

import asyncio
import contextlib
import weakref
from pathlib import Path
from typing import Iterator

import pytest

from node_engine.config import EngineConfig
from node_engine.engine import Engine
from node_engine.memory.host_heap import trim_host_heap
from node_engine.memory.peak import HostPeakMeter
from node_engine.memory.tags import BackupMode, MemoryTag
from node_engine.sampling import SamplingParams
from node_engine.step import StepKind
from node_engine.vision.placeholders import expand
from node_engine.vision.processor import ImageProcessor
from tests.node_engine.engine_harness import running_engine
from tests.node_engine.vl_checkpoints import prompt_with_images, random_image

MiB = 2**20
GREEDY = SamplingParams(max_new_tokens=4, temperature=0, ignore_eos=True)


def _image_request(engine: Engine, images, *parts):
    vision = engine.runner.vision
    prompt = prompt_with_images(*parts) if parts else prompt_with_images("see", *[None] * len(images), "?")
    return expand(prompt, [vision.processor.resize(image) for image in images], engine.arch.vision,
                  vision.processor)


async def _generate(engine: Engine, images, params: SamplingParams = GREEDY) -> list[int]:
    ids, mm = _image_request(engine, images)
    engine.gate.check(ids, params)
    handle = engine.submit(ids, params, mm=mm)
    tokens: list[int] = []
    while True:
        out = await asyncio.wait_for(handle.next(), timeout=60)
        tokens += out.token_ids_delta
        if out.is_final:
            assert out.error is None
            return tokens


async def test_an_oversized_image_is_served_resized_to_the_cap() -> None:
    config = EngineConfig(model_path="builtin:tiny-vl", max_image_tokens=64, max_total_tokens=2048)
    async with running_engine(config) as engine:
        processor = engine.runner.vision.processor
        unclamped = ImageProcessor(processor.config.with_pixels(56 * 56, 28 * 28 * 256))
        for height, width in [(3000, 2000), (4000, 20), (20, 4000), (900, 900)]:
            image = random_image(height, width)
            assert processor.num_tokens(processor.resize(image)) <= 64
            assert unclamped.num_tokens(unclamped.resize(image)) > 64  # without the clamp: over the cap
            tokens = await _generate(engine, [image])
            assert len(tokens) == GREEDY.max_new_tokens


def test_features_are_collected_after_prefill_before_decode(monkeypatch: pytest.MonkeyPatch) -> None:
    """Pixel values, embeddings and M-RoPE positions: no reference survives the prefill that consumed them."""
    engine = Engine(EngineConfig(model_path="builtin:tiny-vl", max_batch_tokens=48, max_image_tokens=256,
                                 max_total_tokens=2048))
    runner, scheduler = engine.runner, engine.scheduler
    encoder = runner.vision.encoder
    refs: list[weakref.ref] = []
    make_pixels = encoder.processor.pixel_values
    monkeypatch.setattr(encoder.processor, "pixel_values",
                        lambda source: _tracked(refs, make_pixels(source)))
    encode = encoder.encode

    def tracked_encode(images):
        encode(images)
        refs.extend(weakref.ref(image.embeddings) for image in images)

    monkeypatch.setattr(encoder, "encode", tracked_encode)
    ids, mm = _image_request(engine, [random_image(280, 196), random_image(112, 224, seed=1)])
    refs.append(weakref.ref(mm.positions()))
    engine.gate.check(ids, GREEDY)
    engine.submit(ids, GREEDY, mm=mm)
    engine._drain_inbox(block=False)
    kinds = []
    while scheduler.has_work:
        step = scheduler.schedule()
        kinds.append(step.kind)
        if step.kind is StepKind.DECODE and kinds.count(StepKind.DECODE) == 1:
            # The first decode step: everything derived from the images is gone already.
            assert len(refs) >= 5 and all(ref() is None for ref in refs)
        scheduler.postprocess(step, runner.run(step))
    assert kinds.count(StepKind.PREFILL) > 1  # the images were consumed over several chunks
    assert mm.images[0].source is not None  # the resized source stays until the request ends (recompute)


def test_without_the_budget_the_reservation_covers_every_image_a_step_reaches() -> None:
    """Found by review: with ``--visual-batch-max-tokens 0`` the reservation was measured for one full-size image
    per running request, but one request's chunk reaches every image in it (and the rest of an image cut at
    either end): at ``--max-running-requests 1`` a step encoded 80 image tokens (five images) against a
    reservation measured for 64 (one image)."""
    engine = Engine(EngineConfig(model_path="builtin:tiny-vl", max_batch_tokens=256, max_running_requests=1,
                                 visual_batch_max_tokens=0, max_image_tokens=64, max_total_tokens=2048))
    runner, scheduler = engine.runner, engine.scheduler
    reserved_for = sum(image.num_tokens for image in runner.vision.worst_case_batch())
    ids, mm = _image_request(engine, [random_image(196, 196, seed=i) for i in range(5)])
    engine.gate.check(ids, GREEDY)
    engine.submit(ids, GREEDY, mm=mm)
    engine._drain_inbox(block=False)
    step = scheduler.schedule()
    assert step.kind is StepKind.PREFILL and len(step.images) == 5
    assert sum(image.num_tokens for image in step.images) <= reserved_for


def _tracked(refs: list, tensor):
    refs.append(weakref.ref(tensor))
    return tensor


async def test_memory_stays_flat_over_200_image_requests() -> None:
    config = EngineConfig(model_path="builtin:tiny-vl", max_total_tokens=4096, max_running_requests=8)
    meter = HostPeakMeter()
    async with running_engine(config) as engine:
        async def wave(first: int) -> None:
            await asyncio.gather(*(_generate(engine, [random_image(224, 224, seed=first + i)]) for i in range(8)))

        for first in range(0, 40, 8):
            await wave(first)
        trim_host_heap()
        warm = meter.current_bytes()
        for first in range(40, 200, 8):
            await wave(first)
        trim_host_heap()
        grown = meter.current_bytes() - warm
    # 160 leaked pixel-value tensors alone would be 190 MiB (each 224 x 224 image: 256 patches x 1176 floats).
    assert grown < 32 * MiB, f"RSS grew by {grown / MiB:.1f} MiB over 160 image requests"


async def test_the_vision_reservation_is_workspace_lent_to_encodes_and_restored_on_resume(tmp_path: Path) -> None:
    config = EngineConfig(model_path="builtin:tiny-vl", max_total_tokens=2048, max_batch_tokens=512,
                          enable_memory_saver=True, weights_backup=BackupMode.DISK, backup_dir=tmp_path)
    meter = HostPeakMeter()
    async with running_engine(config) as engine:
        vision = engine.runner.vision
        reservation = vision.reservation
        assert reservation.num_bytes >= 4 * MiB
        occupation = engine.memory.occupation()
        workspace = occupation[MemoryTag.WORKSPACE.value]["bytes"]
        assert workspace >= reservation.num_bytes + engine.runner.req_to_token.nbytes
        # The vision tower's parameters are part of `weights`, released and restored with the decoder's.
        tower = list(engine.runner.model.visual.parameters())
        weights = occupation[MemoryTag.WEIGHTS.value]["bytes"]
        assert sum(t.nbytes for t in tower) > 0
        assert weights == sum(t.nbytes for t in engine.runner.model.parameters())
        # An encode of the worst case borrows the reservation: while it runs the reservation holds no storage, so
        # the process never holds both, and what the lent encode adds stays well under the reservation (its pages
        # are those the reservation gave back). Without lending, an encode's growth here depends on what the
        # heap of this test process already holds; bench/vision_memory.py compares the two in fresh processes.
        images = vision.worst_case_batch()
        encoder = vision.encoder
        await engine.call(lambda: encoder.encode(images))  # one-time growth (thread pools) outside the window
        held_while_lent: list[int] = []

        @contextlib.contextmanager
        def lend_and_look() -> Iterator[None]:
            with reservation.lend():
                held_while_lent.append(reservation._buffer.untyped_storage().nbytes())
                yield

        encoder.encode_context = lend_and_look
        peaks: list[int] = []
        for _ in range(3):
            trim_host_heap()
            meter.reset()
            before = meter.current_bytes()
            await engine.call(lambda: encoder.encode(images))
            peaks.append(meter.peak_bytes() - before)
        encoder.encode_context = reservation.lend
        assert held_while_lent == [0, 0, 0]
        assert min(peaks) < reservation.num_bytes // 2, (peaks, reservation.num_bytes)
        assert reservation._buffer.untyped_storage().nbytes() == reservation.num_bytes  # taken back
        image = random_image(120, 80)
        expected = await _generate(engine, [image])
        released = await engine.call(lambda: engine.control.release(None, None))
        assert released["bytes_freed"][MemoryTag.WORKSPACE.value] == workspace
        assert released["bytes_freed"][MemoryTag.WEIGHTS.value] == weights
        assert reservation._buffer.untyped_storage().nbytes() == 0
        assert all(t.untyped_storage().nbytes() == 0 for t in tower)
        await engine.call(lambda: engine.control.resume(None))
        assert reservation._buffer.untyped_storage().nbytes() == reservation.num_bytes
        assert await _generate(engine, [image]) == expected  # weights (tower included) came back from the backup
