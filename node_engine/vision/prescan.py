"""Bounded walks over an image's structure before Pillow decodes it: a few bytes can cost a decoder a lot.

- JPEG: each scan of a progressive JPEG makes libjpeg go over every block of
  the image again (a dozen bytes a scan, hours of CPU in a megabyte): more
  than ``MAX_JPEG_SCANS`` is refused, as libjpeg-turbo's own scan limit does.
- PNG: Pillow reads every chunk of the first frame (from the signature to
  IEND, or to the next frame's ``fcTL`` in an animated PNG) one by one in
  Python, holding the GIL: an empty chunk is 12 bytes and about 2.6 us, so a
  36 MB image of them is 8 s. An animated PNG's later frames are not read.
- GIF: Pillow walks what precedes the first image (extension blocks, their
  data sub-blocks, stray bytes) one by one in Python, about 0.1 us a byte.

A PNG or a GIF may take ``MAX_HEADER_STEPS`` chunks (blocks) plus one per
``BYTES_PER_HEADER_STEP`` of its size: real images take tens (a PNG's image
data split in libpng's 8 KiB chunks fits the second part), and the walk
here costs at most about as much as Pillow's own of that many. Anything else
wrong with the structure (truncated, a bad length) is left to Pillow to say.
"""

from __future__ import annotations

import re

from handoff.protocol.image_source import ImageInputError

MAX_JPEG_SCANS = 100      # libjpeg's progressive scripts write 6 to 18; each costs a pass over every block
MAX_JPEG_MARKERS = 4096   # segments walked to count them (ICC profiles split in 255 at most, a few per scan)
MAX_HEADER_STEPS = 4096
BYTES_PER_HEADER_STEP = 4096
MAX_RLE_BMP_PIXELS = 2**21  # a 1920 x 1080 screenshot; at most about 0.5 s, as long as a large PNG takes
_BMP_RLE = (1, 2)           # the compression field's RLE8 and RLE4
# A JPEG marker: 0xFF (repeated as fill) and a code that is neither a stuffed zero nor a restart (RST0-7).
_JPEG_MARKER = re.compile(rb"\xff+([^\x00\xd0-\xd7\xff])")
_JPEG_NO_LENGTH = (0x01, 0xD8)  # TEM, SOI: markers without a segment
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
GIF_SIGNATURES = (b"GIF87a", b"GIF89a")
_APNG_MAX_FRAMES = 0x80000000  # Pillow ignores an acTL of more frames (or of none)


def prescan(data: bytes) -> None:
    """Refuse (:class:`ImageInputError`) an image Pillow would spend unbounded time on before or while decoding,
    recognised as Pillow recognises its format."""
    if data.startswith(b"\xff\xd8\xff"):
        check_jpeg_scans(data)
    elif data.startswith(PNG_SIGNATURE):
        check_png_chunks(data)
    elif data[:6] in GIF_SIGNATURES:
        check_gif_blocks(data)
    elif data.startswith(b"BM"):
        check_bmp(data)


def header_steps(data: bytes) -> int:
    """The chunks (blocks) a PNG (GIF) of this size may take before its first frame is decoded."""
    return MAX_HEADER_STEPS + len(data) // BYTES_PER_HEADER_STEP


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


def check_png_chunks(data: bytes) -> None:
    """Refuse a PNG whose first frame Pillow reaches through more than :func:`header_steps` chunks. Chunks are
    walked by their length fields, as Pillow reads them: up to the image data (IDAT, or an APNG's fdAT), then
    to IEND, or to the next frame's fcTL when the image is animated as Pillow counts frames (acTL's count, one
    more when the IDAT image comes before any fcTL; a second acTL cancels the first)."""
    limit = header_steps(data)
    pos, steps, frames, has_fctl, animated, in_first_frame = len(PNG_SIGNATURE), 0, None, False, False, False
    while pos + 8 <= len(data):
        kind = data[pos + 4:pos + 8]
        if kind == b"IEND" or (in_first_frame and animated and kind == b"fcTL"):
            return
        steps += 1
        if steps > limit:
            raise ImageInputError(f"the PNG has more than {limit} chunks in its first frame (each is read apart; "
                                  "real images have tens)")
        length = int.from_bytes(data[pos:pos + 4], "big")
        if not in_first_frame:
            if kind == b"acTL" and length >= 8:
                count = int.from_bytes(data[pos + 8:pos + 12], "big")
                frames = None if frames is not None else (count if 0 < count <= _APNG_MAX_FRAMES else None)
            has_fctl = has_fctl or kind == b"fcTL"
            if kind in (b"IDAT", b"fdAT"):
                in_first_frame = True
                animated = (frames or 1) + (kind == b"IDAT" and frames is not None and not has_fctl) > 1
        pos += 12 + length


def check_gif_blocks(data: bytes) -> None:
    """Refuse a GIF whose first image descriptor Pillow reaches through more than :func:`header_steps` steps:
    a byte between blocks (Pillow skips strays one at a time), or a data sub-block of an extension."""
    limit = header_steps(data)
    flags = data[10] if len(data) > 10 else 0
    pos, steps = 13 + (3 << ((flags & 7) + 1) if flags & 0x80 else 0), 0
    while pos < len(data) and data[pos] not in b",;":
        steps += 1
        if data[pos] == 0x21:  # an extension: its label, then sub-blocks up to an empty one
            pos += 2
            while pos < len(data) and data[pos] and steps <= limit:
                steps += 1
                pos += 1 + data[pos]
        pos += 1
        if steps > limit:
            raise ImageInputError(f"the GIF has more than {limit} blocks before its first image (each is read "
                                  "apart; real images have a few)")


def check_bmp(data: bytes) -> None:
    """Refuse a run-length encoded BMP of more than ``MAX_RLE_BMP_PIXELS`` pixels (its width and height read as
    Pillow reads them: an info header of 40 bytes or more, a negative height for a top-down image)."""
    if len(data) < 34 or int.from_bytes(data[14:18], "little") not in (40, 52, 56, 64, 108, 124):
        return
    if int.from_bytes(data[30:34], "little") not in _BMP_RLE:
        return
    width = int.from_bytes(data[18:22], "little", signed=True)
    height = int.from_bytes(data[22:26], "little", signed=True)
    if abs(width * height) > MAX_RLE_BMP_PIXELS:
        raise ImageInputError(f"the run-length encoded BMP has {abs(width)} x {abs(height)} pixels, more than "
                              f"{MAX_RLE_BMP_PIXELS} (it is decoded in Python; send it uncompressed or as a PNG)")
