"""A vision-language runner's vision state, set up at start.

In order: the image processor, clamped so that no image exceeds
``--max-image-tokens`` (``clamp.py``); the encoder the runner calls each
prefill step; the worst-case image batch of one step (the caps and the
per-step budget decide it); and the reservation that holds its measured peak
in ``workspace`` (``reservation.py``), so the KV pool is sized after it.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path

import numpy as np

from node_engine.config import ConfigError, EngineConfig
from node_engine.memory.saver import MemorySaver
from node_engine.model.arch import ModelArch
from node_engine.model.builtin import BUILTIN_PROCESSOR, is_builtin
from node_engine.model.rotary import RotaryTable
from node_engine.vision.clamp import ImpossibleCap, clamp_processor
from node_engine.vision.encoder import VisionEncoder
from node_engine.vision.inputs import ImageInput
from node_engine.vision.processor import ImageProcessor, ProcessorConfig, ResizedImage
from node_engine.vision.reservation import VisionReservation
from node_engine.vision.tower import VisionTower

log = logging.getLogger(__name__)


class VisionRuntime:
    def __init__(self, config: EngineConfig, arch: ModelArch, tower: VisionTower, rotary: RotaryTable,
                 processor_config: ProcessorConfig) -> None:
        vision = arch.vision
        if vision is None:
            raise ValueError("not a vision-language model")
        cap = config.resolved_max_image_tokens
        try:
            clamp = clamp_processor(processor_config, cap)
        except ImpossibleCap as exc:
            raise ConfigError(f"--max-image-tokens {cap}: {exc}") from exc
        if clamp.is_changed:
            log.info("image processor clamped to --max-image-tokens %d: min_pixels %d -> %d, max_pixels %d -> %d",
                     cap, processor_config.min_pixels, clamp.processor.min_pixels, processor_config.max_pixels,
                     clamp.processor.max_pixels)
        self.processor = ImageProcessor(clamp.processor)
        self.worst = clamp.worst  # the most tokens any image becomes, and a size that becomes that many
        self.visual_budget = config.resolved_visual_batch_max_tokens
        # Without the budget, a step encodes every image its chunks reach: their tokens, and per request the
        # rest of an image cut at either end of its chunk (at the start after a prefix-cache hit inside one).
        num_requests = min(config.max_running_requests, config.max_batch_tokens)
        self.max_reachable_tokens = config.max_batch_tokens + 2 * num_requests * (clamp.worst.num_tokens - 1)
        self.encoder = VisionEncoder(tower, self.processor, rotary, vision.mrope_section)
        self.reservation: VisionReservation | None = None

    @property
    def max_image_tokens(self) -> int:
        return self.worst.num_tokens

    def worst_case_batch(self) -> list[ImageInput]:
        """The most image tokens one step can encode: full-size images up to the per-step budget (at least one;
        with the budget off, up to what the step's chunks can reach), the rest of it in one smaller image."""
        cap = self.worst.num_tokens
        limit = self.visual_budget or self.max_reachable_tokens
        sizes = [cap] * max(1, limit // cap)
        if limit > sum(sizes):
            sizes.append(limit - sum(sizes))
        f = self.processor.config.factor
        images = []
        for n in sizes:
            if n == cap:
                height, width = self.worst.height, self.worst.width
            else:
                rows = max(d for d in range(1, math.isqrt(n) + 1) if n % d == 0)
                height, width = rows * f, (n // rows) * f
            source = ResizedImage(np.zeros((3, height, width), dtype=np.uint8))
            images.append(ImageInput(offset=0, num_tokens=n, grid=self.processor.grid(source), source=source,
                                     cache_key=-1))
        return images

    def reserve(self, config: EngineConfig, saver: MemorySaver, device) -> VisionReservation:
        """Measure (or take from ``--vision-reserve-mb``) the worst-case peak and hold it; every later encode
        borrows it."""
        if config.vision_reserve_mb is not None:
            reservation = VisionReservation.fixed(saver, device, config.vision_reserve_mb * 2**20)
        else:
            images = self.worst_case_batch()

            def encode_worst_case() -> None:
                self.encoder.encode(images)
                for image in images:
                    image.embeddings = None

            reservation = VisionReservation.measured(saver, device, encode_worst_case)
            log.info("vision worst case: %d image(s), %d tokens, peak %.1f MiB reserved in workspace",
                     len(images), sum(i.num_tokens for i in images), reservation.num_bytes / 2**20)
        self.reservation = reservation
        self.encoder.encode_context = reservation.lend
        return reservation


def processor_config_for(config: EngineConfig, arch: ModelArch) -> ProcessorConfig:
    """The checkpoint's image processor (``preprocessor_config.json``), or the built-in model's."""
    if arch.vision is None:
        raise ValueError("not a vision-language model")
    if is_builtin(config.model_path):
        return BUILTIN_PROCESSOR
    return ProcessorConfig.for_model(arch.vision, Path(config.model_path))
