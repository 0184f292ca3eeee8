"""Image bytes from a request, checked before anything is allocated for it.

An image arrives as SGLang's ``image_data`` items and OpenAI's ``image_url``
parts send it: a data URL (``data:image/png;base64,...``), bare base64, or a
local file path (``file://...``, or a path ending in an image extension),
which is read only below ``--allowed-local-media-path``. Nothing is fetched
from the network: an ``http(s)://`` URL is refused.

Every failure is an :class:`ImageInputError` (a 400 for the caller): not an
image or a format outside ``ALLOWED_FORMATS``, zero-sized, truncated or
corrupt, more pixels than ``max_pixels`` (a decompression bomb: checked from
the header, before decoding), a structure that would cost the decoder far
more than its size (:mod:`node_engine.vision.prescan`: a JPEG of too many
scans, a PNG or a GIF of too many chunks or blocks), a path outside the
allowed folder. What an item points at is read as the sidecar reads it
(:mod:`handoff.protocol.image_source`).
"""

from __future__ import annotations

import base64
import binascii
import io
import os
import re
import stat
import warnings
from dataclasses import dataclass
from pathlib import Path

from PIL import Image, UnidentifiedImageError

from handoff.protocol.image_source import (ImageInputError, ImageSource, SourceKind, allowed_local_path,
                                          image_source)
from node_engine.vision.prescan import prescan

ALLOWED_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")
# An 8192 x 4096 image. Decoding it and converting it to RGB (processor.to_rgb) peaks at under 20 bytes a pixel,
# 640 MiB (docs/memory.md).
DEFAULT_MAX_IMAGE_PIXELS = 32 * 2**20
DEFAULT_MAX_IMAGE_BYTES = 64 * 2**20   # encoded, per image (a file; base64 is bounded by the body limit first)
_WHITESPACE = re.compile(rb"\s+")
_PILLOW_DEFAULT_MAX_PIXELS = Image.MAX_IMAGE_PIXELS


@dataclass(frozen=True)
class ImagePolicy:
    max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS
    max_bytes: int = DEFAULT_MAX_IMAGE_BYTES
    local_media_dir: Path | None = None  # None: no local file is ever read


def readable_source(item: object) -> ImageSource:
    """Where an item points, refused (:class:`ImageInputError`) when no bytes could make it an image here (not a
    string, a network URL, a file URL naming a host): cheap, so checked for every item before any is decoded."""
    source = image_source(item)
    if source.kind is SourceKind.NETWORK:
        raise ImageInputError("images are not fetched from the network; send the bytes (base64 or a data URL)")
    return source


def image_bytes(item: object, policy: ImagePolicy) -> bytes:
    """The encoded bytes an ``image_data`` item or an ``image_url`` URL stands for."""
    source = readable_source(item)
    if source.kind is SourceKind.LOCAL:
        return _read_local(Path(source.text), policy)
    if source.kind is SourceKind.DATA_URL:
        header, comma, payload = source.text.partition(",")
        if not comma or not header.lower().endswith(";base64"):
            raise ImageInputError("a data URL image must be base64: data:image/<type>;base64,<data>")
        return _base64(payload)
    return _base64(source.text)


def _base64(text: str) -> bytes:
    try:
        data = base64.b64decode(_WHITESPACE.sub(b"", text.encode("ascii")), validate=True)
    except (UnicodeEncodeError, binascii.Error, ValueError) as exc:
        raise ImageInputError("the image is not valid base64 (nor a data URL, nor an allowed file path)") from exc
    if not data:
        raise ImageInputError("the image is empty")
    return data


def _read_local(path: Path, policy: ImagePolicy) -> bytes:
    """A file below the allowed folder (:func:`~handoff.protocol.image_source.allowed_local_path`); a file swapped
    for a FIFO or a link after the check is refused at the open, not waited on."""
    resolved = allowed_local_path(path, policy.local_media_dir)
    try:
        fd = os.open(resolved, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW)
    except OSError as exc:
        raise ImageInputError(f"cannot read {path}: {exc.strerror}") from None
    with os.fdopen(fd, "rb") as f:
        info = os.fstat(f.fileno())
        if not stat.S_ISREG(info.st_mode):
            raise ImageInputError(f"{path} is not a file")
        if info.st_size > policy.max_bytes:
            raise ImageInputError(f"{path} is larger than {policy.max_bytes} bytes")
        return f.read(policy.max_bytes + 1)[:policy.max_bytes]


def allow_pixels(max_pixels: int) -> None:
    """Let Pillow decode images up to ``max_pixels`` (its own bomb check stops at about 89 million pixels
    by default, below what ``--max-image-pixels`` may allow). Process-wide: one engine, one policy."""
    Image.MAX_IMAGE_PIXELS = max(max_pixels, _PILLOW_DEFAULT_MAX_PIXELS)


def decode_image(data: bytes, policy: ImagePolicy) -> Image.Image:
    """The decoded image (first frame), after checking its size from the header."""
    if len(data) > policy.max_bytes:
        raise ImageInputError(f"the image is {len(data)} bytes, more than {policy.max_bytes}")
    prescan(data)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data), formats=ALLOWED_FORMATS)
            width, height = image.size
            if width <= 0 or height <= 0:
                raise ImageInputError(f"the image is zero-sized ({width} x {height})")
            if width * height > policy.max_pixels:
                raise ImageInputError(f"the image has {width} x {height} pixels, more than the {policy.max_pixels} "
                                      "allowed (a decompression bomb?)")
            image.load()
    except ImageInputError:
        raise
    except UnidentifiedImageError as exc:
        raise ImageInputError(f"not an image, or not one of {', '.join(ALLOWED_FORMATS)}") from exc
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        raise ImageInputError(f"the image is too large to decode (a decompression bomb?): {exc}") from exc
    except (OSError, SyntaxError, ValueError, EOFError) as exc:  # PIL's ways of saying truncated or corrupt
        raise ImageInputError(f"the image is truncated or corrupt: {exc}") from exc
    return image


def load_image(item: object, policy: ImagePolicy) -> Image.Image:
    return decode_image(image_bytes(item, policy), policy)
