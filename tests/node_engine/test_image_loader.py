"""The image loader of a vision-language engine (builtin:tiny-vl, in-process): its bound on images decoded at once
holds for requests whose client left, whose decode thread cannot be stopped."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from node_engine.config import EngineConfig
from node_engine.engine import Engine
from node_engine.server import images as images_module
from node_engine.server.images import DECODE_CONCURRENCY, ImageLoader
from tests.node_engine.vl_checkpoints import prompt_with_images, random_image

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
