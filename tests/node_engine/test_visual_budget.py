"""The per-step visual budget (CPU bookkeeping): bounded steps, arrival order, no deadlock, features freed."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from node_engine.detokenizer import IncrementalDetokenizer
from node_engine.kv_cache import RowAllocator, SlotAllocator
from node_engine.request import Request
from node_engine.sampling import SamplingParams
from node_engine.scheduler import Scheduler, SchedulerConfig
from node_engine.step import StepKind
from node_engine.tokenizer import Tokenizer
from node_engine.vision.encoder import VisionEncoder
from node_engine.vision.inputs import ImageInput, MultimodalPrompt
from node_engine.vision.processor import ResizedImage

TOKENIZER = Tokenizer.builtin_bytes(vision=True)
IMAGE_TOKEN = 260


def make_scheduler(max_visual_tokens: int, *, max_batch_tokens: int = 256, num_slots: int = 4096) -> Scheduler:
    return Scheduler(SchedulerConfig(max_running_requests=16, max_batch_tokens=max_batch_tokens, context_len=1024,
                                     eos_token_ids=(257,), max_visual_tokens=max_visual_tokens),
                     SlotAllocator(num_slots), RowAllocator(16))


def image_request(rid: str, sizes: list[int], *, text: int = 3) -> Request:
    """A prompt of ``text`` tokens, then per image its tokens and ``text`` more."""
    ids: list[int] = [65] * text
    images = []
    for n, size in enumerate(sizes):
        source = ResizedImage(np.zeros((3, 28, 28 * size), dtype=np.uint8))
        images.append(ImageInput(offset=len(ids), num_tokens=size, grid=(1, 2, 2 * size), source=source,
                                 cache_key=-1 - hash((rid, n)) % 2**40))
        ids += [IMAGE_TOKEN] * size + [65] * text
    mm = MultimodalPrompt(images=images, num_prompt_tokens=len(ids), merge_size=2)
    return Request(rid=rid, prompt_ids=ids, params=SamplingParams(max_new_tokens=2),
                   detokenizer=IncrementalDetokenizer(TOKENIZER), on_output=lambda _: None, mm=mm)


def run_until_done(scheduler: Scheduler) -> list[list[tuple[str, int]]]:
    """Steps the scheduler as the engine would (encode = give embeddings; release what chunks consumed);
    returns, per prefill step, the images it encoded as (request, image index)."""
    encoded: list[list[tuple[str, int]]] = []
    for _ in range(1000):
        step = scheduler.schedule()
        if step is None:
            return encoded
        if step.kind is StepKind.PREFILL:
            names = []
            for image in step.images:
                assert image.embeddings is None, "an image is encoded once"
                image.embeddings = torch.zeros(image.num_tokens, 4)
                owner = next(e.request for e in step.entries if e.request.mm and image in e.request.mm.images)
                names.append((owner.rid, owner.mm.images.index(image)))
            encoded.append(names)
            for e in step.entries:  # every image token of a chunk was encoded by now
                if e.request.mm is not None:
                    for image in e.request.mm.images:
                        if image.offset < e.end and image.end > e.start:
                            assert image.embeddings is not None
            VisionEncoder.release_consumed([(e.request.mm, e.start, e.end) for e in step.entries])
        scheduler.postprocess(step, [66] * sum(e.samples for e in step.entries))
    raise AssertionError("the scheduler did not finish")


@pytest.mark.parametrize("budget", [40, 64, 100])
def test_an_image_burst_stays_within_the_budget_in_arrival_order(budget: int) -> None:
    scheduler = make_scheduler(budget)
    sizes = {"a": [30, 12], "b": [50], "c": [8, 8, 8], "d": [64], "e": [20, 40], "f": [5]}
    for rid, image_sizes in sizes.items():
        scheduler.add(image_request(rid, image_sizes))
    steps = run_until_done(scheduler)
    size_of = {(rid, i): n for rid, image_sizes in sizes.items() for i, n in enumerate(image_sizes)}
    for images in steps:
        total = sum(size_of[name] for name in images)
        assert total <= budget or len(images) == 1  # the first image of a step is always admitted
    order = [name for images in steps for name in images]
    assert order == [(rid, i) for rid, image_sizes in sizes.items() for i in range(len(image_sizes))]
    assert max(len(images) for images in steps) > 1  # the budget batches images, it does not serialize them


def test_without_the_budget_a_step_encodes_everything_it_reaches() -> None:
    scheduler = make_scheduler(0)
    for rid in "abc":
        scheduler.add(image_request(rid, [50, 50]))
    steps = run_until_done(scheduler)
    assert len(steps[0]) == 5  # 256 tokens reach a and b (109 tokens each) and the start of c


def test_an_image_larger_than_the_budget_never_deadlocks() -> None:
    scheduler = make_scheduler(10, max_batch_tokens=16)
    scheduler.add(image_request("big", [40, 3]))
    scheduler.add(image_request("small", [4]))
    steps = run_until_done(scheduler)
    assert [name for images in steps for name in images] == [("big", 0), ("big", 1), ("small", 0)]
    assert ["big", 0] not in [list(n) for images in steps[1:] for n in images]


def test_a_deferred_image_goes_first_next_step() -> None:
    """b's image does not fit after a's; c (later, text only up to its image) must not overtake b."""
    scheduler = make_scheduler(40)
    scheduler.add(image_request("a", [30]))
    scheduler.add(image_request("b", [30]))
    scheduler.add(image_request("c", [5]))
    first = scheduler.schedule()
    assert [image.num_tokens for image in first.images] == [30]
    # b is admitted for the text before its image; its chunk stops right before it; c is not admitted yet.
    b_entry = next(e for e in first.entries if e.request.rid == "b")
    assert b_entry.end == b_entry.request.mm.images[0].offset
    assert [e.request.rid for e in first.entries] == ["a", "b"]
    scheduler.postprocess(first, [66])
    for image in first.images:
        image.embeddings = None
    second = scheduler.schedule()
    assert [image.num_tokens for image in second.images] == [30, 5]  # b's image first, then c's


def test_preemption_forgets_features_and_reencodes() -> None:
    scheduler = make_scheduler(0, max_batch_tokens=8)
    request = image_request("a", [20])
    scheduler.add(request)
    step = scheduler.schedule()
    for image in step.images:
        image.embeddings = torch.zeros(image.num_tokens, 4)
    scheduler.postprocess(step, [])
    assert request.mm.images[0].embeddings is not None  # the image is half prefilled: kept
    request.mm.positions()
    scheduler.preempt(request)
    assert request.mm.images[0].embeddings is None and request.mm._positions is None
    again = scheduler.schedule()
    assert again.images == request.mm.images  # encoded again from the kept source
