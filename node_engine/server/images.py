"""A request's images, ready for the engine: decoded, checked, resized, placeholders expanded.

The work runs in a worker thread (decoding a large image takes the GIL off
and on for a while; hashing its pixels for the prefix cache is done there too,
not on the event loop), one image at a time, and at most ``DECODE_CONCURRENCY``
images decode at once in the process, so a burst of large images cannot hold
many decoded images in memory at the same time (each can take about 20 bytes a
pixel while it is converted: ``docs/memory.md``), and requests take turns image
by image. A request whose client left (or whose preparation is cancelled)
decodes no further image. Anything wrong is a 400 before the engine sees the
request: nothing is allocated for it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from handoff.protocol.generate_request import MAX_IMAGES_PER_PROMPT
from handoff.service.errors import InvalidRequest, Unsupported
from node_engine.engine import Engine
from node_engine.vision.decode import ImageInputError, ImagePolicy, allow_pixels, load_image, readable_source
from node_engine.vision.inputs import MultimodalPrompt
from node_engine.vision.placeholders import (GENERIC_TEXT_PLACEHOLDER, PlaceholderError, check_placeholders,
                                             content_key, expand, native_placeholder, normalize_text)
from node_engine.vision.processor import ImageShapeError, ResizedImage

DECODE_CONCURRENCY = 2


class ImageLoader:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        config = engine.config
        self.policy = ImagePolicy(max_pixels=config.max_image_pixels, local_media_dir=config.allowed_local_media_path)
        allow_pixels(self.policy.max_pixels)
        self._slots: asyncio.Semaphore | None = None
        vision_arch = engine.arch.vision
        self._placeholder = None if vision_arch is None else native_placeholder(
            vision_arch, lambda ids: engine.tokenizer.decode(ids, skip_special_tokens=False))

    def check_supported(self, field: str) -> None:
        if self.engine.vision is None:
            raise Unsupported(f"{field}: {self.engine.config.model_name} has no vision tower; images are refused",
                              extra={"field": field})

    def normalize_text(self, text: str, num_images: int, field: str) -> str:
        """``<image>`` in a text prompt stands for the model's own placeholder (43 characters for Qwen2-VL's, done
        on the event loop): more of them than images is a 400 before any is replaced, so a text grows by at most
        that many placeholders."""
        if self._placeholder is None:
            return text
        count = text.count(GENERIC_TEXT_PLACEHOLDER)
        if count > num_images:
            raise InvalidRequest(f"{field}: the prompt has {count} {GENERIC_TEXT_PLACEHOLDER} placeholders for "
                                 f"{num_images} image(s); put one per image")
        return normalize_text(text, self._placeholder) if count else text

    def check_no_placeholder(self, prompt_ids: list[int], field: str) -> None:
        """400 for image placeholders in a prompt without images (the model would read them as text)."""
        vision_arch = self.engine.arch.vision
        if vision_arch is not None and vision_arch.image_token_id in prompt_ids:
            raise InvalidRequest(f"{field}: the prompt holds an image placeholder but no image was given "
                                 "(send the images in image_data, one per placeholder)")

    def check_before_decoding(self, prompt_ids: list[int], items: Sequence[object], field: str) -> None:
        """400 for a prompt whose placeholders do not match its images, whose text with one token per image is
        already as long as the context, or with an item that cannot be an image whatever its bytes, before any
        image is decoded (64 images can take a decode slot for half a minute)."""
        self.check_supported(field)
        num_images = len(items)
        if num_images > MAX_IMAGES_PER_PROMPT:
            raise InvalidRequest(f"{field}: at most {MAX_IMAGES_PER_PROMPT} images per prompt, got {num_images}")
        try:
            runs = check_placeholders(prompt_ids, num_images, self.engine.arch.vision)
        except PlaceholderError as exc:
            raise InvalidRequest(f"{field}: {exc}") from exc
        for i, item in enumerate(items):
            try:
                readable_source(item)
            except ImageInputError as exc:
                raise InvalidRequest(f"{field}[{i}]: {exc}") from exc
        num_text = len(prompt_ids) - sum(end - start for start, end in runs)
        context_len = self.engine.runner.kv_plan.context_len
        if num_text + num_images >= context_len:
            raise InvalidRequest(f"{field}: the input ({num_text} tokens of text and {num_images} image(s), at least "
                                 f"one token each) is longer than the model's context length ({context_len} tokens).")

    async def prepare(self, prompt_ids: list[int], items: Sequence[object], field: str,
                      ) -> tuple[list[int], MultimodalPrompt]:
        """The prompt with its placeholders expanded, and its images (400 for an image that does not decode).
        The caller has run :meth:`check_before_decoding` on every prompt of the request first."""
        resized, keys = [], []
        for i, item in enumerate(items):  # a cancellation stops it here, before the next image
            image, key = await self._resize_in_slot(item, f"{field}[{i}]")
            resized.append(image)
            keys.append(key)
        vision = self.engine.vision
        try:
            return expand(prompt_ids, resized, self.engine.arch.vision, vision.processor, keys)
        except PlaceholderError as exc:
            raise InvalidRequest(f"{field}: {exc}") from exc

    async def _resize_in_slot(self, item: object, field: str) -> tuple[ResizedImage, int]:
        """One image resized, and its :func:`content_key`, in a worker thread that holds a decode slot until it
        ends: a cancelled request (its client left) stops waiting at once, but its thread cannot be stopped, so
        the slot is given back only when the thread is done, not when the request is cancelled."""
        slots = self._slots
        if slots is None:
            slots = self._slots = asyncio.Semaphore(DECODE_CONCURRENCY)
        await slots.acquire()
        work = asyncio.ensure_future(asyncio.to_thread(self._resize, item, field))
        work.add_done_callback(lambda done: _release(slots, done))
        return await asyncio.shield(work)

    def _resize(self, item: object, field: str) -> tuple[ResizedImage, int]:
        try:
            image = self.engine.vision.processor.resize(load_image(item, self.policy))
        except (ImageInputError, ImageShapeError) as exc:
            raise InvalidRequest(f"{field}: {exc}") from exc
        return image, content_key(image)


def _release(slots: asyncio.Semaphore, done: asyncio.Future) -> None:
    slots.release()
    if not done.cancelled():
        done.exception()  # retrieved: the error of an image whose request was cancelled has nobody to go to
