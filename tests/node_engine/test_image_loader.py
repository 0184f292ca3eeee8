"""The image loader of a vision-language engine (builtin:tiny-vl, in-process): its bound on images decoded at once
holds for requests whose client left, whose decode thread cannot be stopped."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import threading
import time

import pytest

from node_engine.config import EngineConfig
from node_engine.engine import Engine
from node_engine.server import images as images_module
from node_engine.server.images import DECODE_CONCURRENCY, ImageLoader
from node_engine.vision import placeholders as placeholders_module
from tests.node_engine.vl_checkpoints import encoded, prompt_with_images, random_image

PROMPT = prompt_with_images("see", None, "?")


class _Decodes:
    """Stands in for ``load_image``: counts the decodes running at once, each until :attr:`go` is set."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.running = 0
        self.most = 0
        self.started = 0
        self.go = threading.Event()

    def __call__(self, item: object, policy: object):
        with self.lock:
            self.running += 1
            self.started += 1
            self.most = max(self.most, self.running)
        try:
            self.go.wait(timeout=30)
            return random_image(56, 56)
        finally:
            with self.lock:
                self.running -= 1


async def _until(condition, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


async def test_a_cancelled_request_keeps_its_decode_slot_until_its_thread_ends(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Found by review: a cancelled request (its client left) gave its slot back while its decode thread, which
    cannot be stopped, went on; clients that send a costly image and leave then had any number decoded at once
    (each about 20 bytes a pixel: 640 MiB for a 32 Mi pixel RGBA PNG), not ``DECODE_CONCURRENCY``."""
    decodes = _Decodes()
    monkeypatch.setattr(images_module, "load_image", decodes)
    loader = ImageLoader(Engine(EngineConfig(model_path="builtin:tiny-vl", max_total_tokens=1024)))
    left = [asyncio.create_task(loader.prepare(PROMPT, ["x"], "image_data")) for _ in range(DECODE_CONCURRENCY)]
    try:
        await _until(lambda: decodes.started == DECODE_CONCURRENCY)
        for task in left:  # their clients leave
            task.cancel()
        await asyncio.gather(*left, return_exceptions=True)
        behind = asyncio.create_task(loader.prepare(PROMPT, ["x"], "image_data"))
        await asyncio.sleep(0.2)  # a window in which a third decode would start, not a synchronisation
        assert decodes.started == DECODE_CONCURRENCY, "a decode started while the cancelled ones still ran"
    finally:
        decodes.go.set()
    ids, mm = await asyncio.wait_for(behind, timeout=30)
    assert decodes.most <= DECODE_CONCURRENCY
    assert len(mm.images) == 1 and len(ids) > len(PROMPT)


class _HashWatch:
    """Stands in for ``hashlib`` in the placeholders module: while an image's pixels are hashed, asks the event
    loop to run a callback and waits (at most ``timeout_s``) for it. A loop that does the hashing itself cannot
    run it meanwhile; a loop left free runs it at once."""

    def __init__(self, loop: asyncio.AbstractEventLoop, timeout_s: float = 5.0) -> None:
        self.loop = loop
        self.timeout_s = timeout_s
        self.loop_answered: list[bool] = []  # per hashed image: the loop ran a callback while it was hashed

    def blake2b(self, **kwargs):
        watch = self
        real = hashlib.blake2b(**kwargs)

        class Hasher:
            def update(self, data: bytes) -> None:
                if len(data) > 64:  # the pixels, not the size prefix
                    answered = threading.Event()
                    watch.loop.call_soon_threadsafe(answered.set)
                    watch.loop_answered.append(answered.wait(watch.timeout_s))
                real.update(data)

            def digest(self) -> bytes:
                return real.digest()

        return Hasher()


async def test_image_hashing_leaves_the_event_loop_free(monkeypatch: pytest.MonkeyPatch) -> None:
    """Found by review: each image's pixels were hashed (its prefix-cache key) on the engine's event loop; 64
    images at Qwen2-VL's default pixel limit are about 190 MB, a stall of ~0.2 s per request in which every
    other client's stream stood still. The hash now runs in the image's decode thread, in its decode slot."""
    watch = _HashWatch(asyncio.get_running_loop())
    monkeypatch.setattr(placeholders_module, "hashlib", watch)
    loader = ImageLoader(Engine(EngineConfig(model_path="builtin:tiny-vl", max_total_tokens=1024)))
    images = [random_image(56, 56, seed=1), random_image(56, 84, seed=2)]
    prompt = prompt_with_images("see", None, "and", None, "?")
    items = [base64.b64encode(encoded(image)).decode() for image in images]
    _, mm = await asyncio.wait_for(loader.prepare(prompt, items, "image_data"), timeout=30)
    assert watch.loop_answered == [True, True], "the event loop was busy hashing an image"
    monkeypatch.setattr(placeholders_module, "hashlib", hashlib)
    processor = loader.engine.vision.processor
    assert [image.cache_key for image in mm.images] == [
        placeholders_module.content_key(processor.resize(image)) for image in images]
