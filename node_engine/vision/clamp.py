"""The most tokens an image can become, exactly, and the ``--max-image-tokens`` clamp.

``smart_resize`` bounds the pixels of most images, not all of them:

- a *large* image is scaled down to about ``max_pixels``, but its short side
  keeps at least one token: a 200:1 image becomes 1 x 14 or more tokens
  whatever ``max_pixels`` says;
- a *small* image is scaled up to about ``min_pixels`` without any check
  against ``max_pixels``: a 200 x 1 image becomes 29 tokens at Qwen2-VL's
  default ``min_pixels`` of 56 x 56;
- any other image is rounded to the nearest token grid.

With ``f`` the token side in pixels and ``r`` the aspect ratio (long side over
short side, at most 200), the three branches give:

- scaled down: ``max(1, floor(sqrt(r M) / f)) * max(1, floor(sqrt(M / r) / f))``
  for ``M = max_pixels``. The first factor only steps up, the second only
  down, so the maximum over ``r`` in ``[1, 200]`` is at ``r = 1`` or where the
  first factor steps up, ``r = (k f)^2 / M``, where the product is
  ``k * max(1, M // (k f^2))`` in integers;
- scaled up: ``ceil(sqrt(r m) / f) * ceil(sqrt(m / r) / f)`` for ``m =
  min_pixels``, over the small images that take this branch: they are finitely
  many, so they are enumerated (the same float arithmetic as the processor);
- rounded: ``a * b`` for the grids ``a x b`` with ``m <= a b f^2 <= M`` that an
  image with an aspect ratio of at most 200 rounds to.

:func:`clamp_processor` keeps the processor as it is when its worst case fits
the cap; otherwise it lowers ``min_pixels`` (only when small images alone
exceed the cap) and then takes the largest ``max_pixels`` whose worst case
fits. Every branch is monotone in both bounds, so a bisection finds it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from node_engine.vision.processor import MAX_ASPECT_RATIO, ProcessorConfig

MAX_ENUMERATED_MIN_TOKENS = 1024  # beyond this min_pixels / f^2, small images are bounded, not enumerated


class ImpossibleCap(ValueError):
    """No processor setting keeps every image within the cap."""


@dataclass(frozen=True)
class WorstCase:
    """The most tokens any image becomes; the resized size it has, and the size of an image that gets there."""

    num_tokens: int
    height: int          # resized, pixels
    width: int
    image_height: int    # an input image that becomes ``num_tokens`` tokens
    image_width: int


@dataclass(frozen=True)
class Clamp:
    processor: ProcessorConfig
    worst: WorstCase
    is_changed: bool


def worst_case(config: ProcessorConfig) -> WorstCase:
    """The exact maximum of :meth:`ProcessorConfig.num_tokens` over every image the processor accepts."""
    f, m, big_m = config.factor, config.min_pixels, config.max_pixels
    return max(_scaled_down(f, big_m), _rounded(f, m, big_m), _scaled_up(f, m), key=lambda w: w.num_tokens)


_NONE = WorstCase(0, 0, 0, 0, 0)


def clamp_processor(config: ProcessorConfig, max_image_tokens: int) -> Clamp:
    """The processor with the largest pixel bounds (at most the configured ones) whose worst case fits."""
    worst = worst_case(config)
    if worst.num_tokens <= max_image_tokens:
        return Clamp(config, worst, is_changed=False)
    f = config.factor
    min_pixels = config.min_pixels
    if _scaled_up(f, min_pixels).num_tokens > max_image_tokens:
        min_pixels = _largest(1, min_pixels, lambda m: _scaled_up(f, m).num_tokens <= max_image_tokens)
    def fits(max_pixels: int) -> bool:
        return worst_case(config.with_pixels(min(min_pixels, max_pixels), max_pixels)).num_tokens <= max_image_tokens
    if not fits(1):
        raise ImpossibleCap(f"no image processor setting keeps every image within {max_image_tokens} tokens")
    max_pixels = _largest(1, config.max_pixels, fits)
    clamped = config.with_pixels(min(min_pixels, max_pixels), max_pixels)
    return Clamp(clamped, worst_case(clamped), is_changed=True)


def _largest(low: int, high: int, ok) -> int:
    """The largest value in ``[low, high]`` where the monotone ``ok`` holds (``ok(low)`` must)."""
    while low < high:
        mid = (low + high + 1) // 2
        if ok(mid):
            low = mid
        else:
            high = mid - 1
    return low


def _scaled_down(f: int, max_pixels: int) -> WorstCase:
    side = max(1, math.isqrt(max_pixels) // f)
    square = f * (math.isqrt(max_pixels) // f + 1000)  # any square this large is scaled down to side x side
    best = WorstCase(side * side, side * f, side * f, square, square)  # r = 1
    k = math.isqrt(max_pixels) // f + 1               # first k with (k f)^2 > M
    scale = 2 * f  # images k^2 f^2 x M (ratio exactly (k f)^2 / M), scaled up so that they are scaled down
    while (k * f) ** 2 <= MAX_ASPECT_RATIO * max_pixels:
        other = max(1, max_pixels // (k * f * f))
        if k * other > best.num_tokens:
            best = WorstCase(k * other, k * f, other * f, k * k * f * f * scale, max_pixels * scale)
        k += 1
    return best


def _rounded(f: int, min_pixels: int, max_pixels: int) -> WorstCase:
    most = max_pixels // (f * f)
    best = _NONE
    for b in range(1, math.isqrt(most) + 1):
        widest = max(w for w in range(b * f - f, b * f + f + 1) if w > 0 and round(w / f) == b)
        a = min(most // b, _longest_reachable(b, widest, f))
        if a >= b and a * b * f * f >= min_pixels and a * b > best.num_tokens:
            best = WorstCase(a * b, a * f, b * f, _shortest(a, f), widest)
    return best


def _shortest(a: int, f: int) -> int:
    """The smallest side that rounds to ``a`` tokens."""
    return min(h for h in range(max(1, a * f - f), a * f + f + 1) if round(h / f) == a)


def _longest_reachable(b: int, widest: int, f: int) -> int:
    """The largest ``a`` such that some image rounds to ``a x b`` tokens with an aspect ratio of at most 200
    (``widest``: the widest side that rounds to ``b``)."""
    a = (MAX_ASPECT_RATIO * widest) // f + 1
    while a > b and _shortest(a, f) > MAX_ASPECT_RATIO * widest:
        a -= 1
    return a


@lru_cache(maxsize=64)
def _scaled_up(f: int, min_pixels: int) -> WorstCase:
    if min_pixels // (f * f) > MAX_ENUMERATED_MIN_TOKENS:
        return _scaled_up_bound(f, min_pixels)
    heights, widths = _small_images(f, min_pixels)
    if heights.size == 0:
        return _NONE
    beta = np.sqrt(min_pixels / (heights * widths))  # float64, as the processor computes it
    h_bar = np.ceil(heights * beta / f) * f
    w_bar = np.ceil(widths * beta / f) * f
    tokens = (h_bar // f) * (w_bar // f)
    i = int(np.argmax(tokens))
    return WorstCase(int(tokens[i]), int(h_bar[i]), int(w_bar[i]), int(heights[i]), int(widths[i]))


def _small_images(f: int, min_pixels: int) -> tuple[np.ndarray, np.ndarray]:
    """Every (height >= width) an image can have and still be scaled up (its rounded grid below min_pixels)."""
    most = (min_pixels - 1) // (f * f)  # rounded grids a x b with a b f^2 < min_pixels
    heights: list[np.ndarray] = []
    widths: list[np.ndarray] = []
    width_limit = (math.isqrt(most) + 1) * f + f  # widths past this round to b > sqrt(most)
    for w in range(1, width_limit + 1):
        b = round(w / f)
        longest = MAX_ASPECT_RATIO * w if b == 0 else min(MAX_ASPECT_RATIO * w, (most // b) * f + f)
        if b > 0 and most // b < b:
            continue
        h = np.arange(w, longest + 1, dtype=np.int64)
        if b > 0:
            h = h[np.round(h / f).astype(np.int64) * b < most + 1]  # numpy rounds half to even, like Python
        heights.append(h)
        widths.append(np.full(h.shape, w, dtype=np.int64))
    if not heights:
        return np.empty(0, dtype=np.int64), np.empty(0, dtype=np.int64)
    return np.concatenate(heights), np.concatenate(widths)


def _scaled_up_bound(f: int, min_pixels: int) -> WorstCase:
    """An upper bound (not attained in general) for very large ``min_pixels``: the sup over every ratio."""
    best = 0
    for ratio_step in range(0, 2001):
        r = 1 + (MAX_ASPECT_RATIO - 1) * ratio_step / 2000
        best = max(best, (math.ceil(math.sqrt(r * min_pixels) / f) + 1) * (math.ceil(math.sqrt(min_pixels / r) / f) + 1))
    side = math.isqrt(best)
    return WorstCase(best, side * f, (best // max(1, side)) * f, 0, 0)  # a bound: no image is known to reach it
