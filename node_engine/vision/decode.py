"""Image bytes from a request, checked before anything is allocated for it.

An image arrives as SGLang's ``image_data`` items and OpenAI's ``image_url``
parts send it: a data URL (``data:image/png;base64,...``), bare base64, or a
local file path (``file://...``, or a path ending in an image extension),
which is read only below ``--allowed-local-media-path``. Nothing is fetched
from the network: an ``http(s)://`` URL is refused.

Every failure is an :class:`ImageInputError` (a 400 for the caller): not an
image or a format outside ``ALLOWED_FORMATS``, zero-sized, truncated or
corrupt, more pixels than ``max_pixels`` (a decompression bomb: checked from
the header, before decoding), a JPEG of more than ``MAX_JPEG_SCANS`` scans
(each scan makes the decoder go over every block of the image again: a few
bytes each, hours of CPU in a megabyte), a path outside the allowed folder.
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
from urllib.parse import unquote, urlparse

from PIL import Image, UnidentifiedImageError

ALLOWED_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")
IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".webp", ".gif", ".bmp")
# An 8192 x 4096 image. Decoding it and compositing its transparency (processor.to_rgb, as transformers does)
# peaks at about 20 bytes a pixel: 640 MiB for an RGBA image (docs/memory.md).
DEFAULT_MAX_IMAGE_PIXELS = 32 * 2**20
DEFAULT_MAX_IMAGE_BYTES = 64 * 2**20   # encoded, per image (a file; base64 is bounded by the body limit first)
MAX_JPEG_SCANS = 100      # libjpeg's progressive scripts write 6 to 18; each costs a pass over every block
MAX_JPEG_MARKERS = 4096   # segments walked to count them (ICC profiles split in 255 at most, a few per scan)
# A JPEG marker: 0xFF (repeated as fill) and a code that is neither a stuffed zero nor a restart (RST0-7).
_JPEG_MARKER = re.compile(rb"\xff+([^\x00\xd0-\xd7\xff])")
_JPEG_NO_LENGTH = (0x01, 0xD8)  # TEM, SOI: markers without a segment
_WHITESPACE = re.compile(rb"\s+")
_PILLOW_DEFAULT_MAX_PIXELS = Image.MAX_IMAGE_PIXELS


class ImageInputError(ValueError):
    """An image a request cannot use; the message says why (the caller answers 400)."""


@dataclass(frozen=True)
class ImagePolicy:
    max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS
    max_bytes: int = DEFAULT_MAX_IMAGE_BYTES
    local_media_dir: Path | None = None  # None: no local file is ever read


def image_bytes(item: object, policy: ImagePolicy) -> bytes:
    """The encoded bytes an ``image_data`` item or an ``image_url`` URL stands for."""
    if not isinstance(item, str):
        raise ImageInputError(f"an image must be a string (base64, a data URL or an allowed file path), "
                              f"got {type(item).__name__}")
    if not item:
        raise ImageInputError("the image is empty")
    lowered = item[:16].lower()
    if lowered.startswith(("http://", "https://")):
        raise ImageInputError("images are not fetched from the network; send the bytes (base64 or a data URL)")
    if lowered.startswith("file://"):
        return _read_local(Path(unquote(urlparse(item).path)), policy)
    if item.lower().endswith(IMAGE_EXTENSIONS) and len(item) < 4096:
        return _read_local(Path(item), policy)
    if lowered.startswith("data:"):
        header, comma, payload = item.partition(",")
        if not comma or not header.lower().endswith(";base64"):
            raise ImageInputError("a data URL image must be base64: data:image/<type>;base64,<data>")
        return _base64(payload)
    return _base64(item)


def _base64(text: str) -> bytes:
    try:
        data = base64.b64decode(_WHITESPACE.sub(b"", text.encode("ascii")), validate=True)
    except (UnicodeEncodeError, binascii.Error, ValueError) as exc:
        raise ImageInputError("the image is not valid base64 (nor a data URL, nor an allowed file path)") from exc
    if not data:
        raise ImageInputError("the image is empty")
    return data


def _read_local(path: Path, policy: ImagePolicy) -> bytes:
    """A file below the allowed folder. Whatever is outside it gets one answer whether or not it exists (the
    path is checked as written before the file system is asked anything), and a file swapped for a FIFO or
    a link after the check is refused at the open, not waited on."""
    allowed = policy.local_media_dir
    if allowed is None:
        raise ImageInputError("local image paths are not allowed here (the engine reads them only below "
                              "--allowed-local-media-path); send the bytes (base64 or a data URL)")
    if "\x00" in str(path):
        raise ImageInputError("an image path cannot hold a NUL character")
    roots = (Path(os.path.abspath(allowed)), allowed.resolve())
    missing = ImageInputError(f"no such image file below --allowed-local-media-path: {path}")
    if not any(Path(os.path.abspath(path)).is_relative_to(root) for root in roots):
        raise missing
    try:
        resolved = path.resolve(strict=True)
    except (OSError, RuntimeError, ValueError):
        raise missing from None
    if not resolved.is_relative_to(roots[1]):  # a link inside that points out
        raise missing
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
    if data.startswith(b"\xff\xd8\xff"):  # what Pillow takes for a JPEG
        check_jpeg_scans(data)
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


def check_jpeg_scans(data: bytes) -> None:
    """Refuse a JPEG of more than ``MAX_JPEG_SCANS`` scans (SOS markers before its first EOI), as libjpeg-turbo's
    scan limit does. Segments are skipped by their length, as the decoder skips them, so bytes inside one (an
    EXIF thumbnail, an ICC profile) are not counted; in a scan's entropy-coded data a 0xFF is followed by a
    stuffed zero or a restart marker, so the next match after a scan is the next real marker."""
    scans, pos = 0, 2
    for _ in range(MAX_JPEG_MARKERS):
        match = _JPEG_MARKER.search(data, pos)
        if match is None or match[1] == b"\xd9":
            return
        if match[1] == b"\xda":
            scans += 1
            if scans > MAX_JPEG_SCANS:
                raise ImageInputError(f"the JPEG has more than {MAX_JPEG_SCANS} scans (each makes the decoder go "
                                      "over the whole image again)")
        pos = match.end()
        if match[1][0] not in _JPEG_NO_LENGTH:  # the segment's length counts its own two bytes
            pos += int.from_bytes(data[pos:pos + 2], "big")
    raise ImageInputError(f"the JPEG has more than {MAX_JPEG_MARKERS} segments")


def load_image(item: object, policy: ImagePolicy) -> Image.Image:
    return decode_image(image_bytes(item, policy), policy)
