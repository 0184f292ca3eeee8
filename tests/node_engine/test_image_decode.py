"""Image bytes from requests: every accepted spelling, every refusal (the caller answers 400)."""

from __future__ import annotations

import base64
import io
import os
import struct
import time
import zlib
from pathlib import Path

import pytest
from PIL import Image

from node_engine.vision.decode import ImageInputError, ImagePolicy, image_bytes, load_image
from tests.node_engine.vl_checkpoints import encoded, progressive_jpeg

POLICY = ImagePolicy()


PNG = encoded(Image.new("RGB", (30, 20), (10, 200, 30)))


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _png_header_only(width: int, height: int) -> bytes:
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"")) + chunk(b"IEND", b"")


@pytest.mark.parametrize("item", [b64(PNG), "data:image/png;base64," + b64(PNG),
                                  "DATA:image/png;BASE64," + b64(PNG),
                                  "\n".join(b64(PNG)[i:i + 76] for i in range(0, len(b64(PNG)), 76))],
                         ids=["base64", "data-url", "data-url-upper", "mime-wrapped"])
def test_accepted_spellings(item: str) -> None:
    assert load_image(item, POLICY).size == (30, 20)


@pytest.mark.parametrize("fmt", ["JPEG", "WEBP", "GIF", "BMP"])
def test_common_formats(fmt: str) -> None:
    assert load_image(b64(encoded(Image.new("RGB", (9, 7)), fmt)), POLICY).size == (9, 7)


@pytest.mark.parametrize("item,reason", [
    ("", "empty"),
    (123, "must be a string"),
    ("http://example.com/cat.png", "not fetched from the network"),
    ("https://example.com/cat", "not fetched from the network"),
    ("not base64 at all!", "not valid base64"),
    ("data:image/png,rawbytes", "must be base64"),
    (b64(b"hello, I am text"), "not an image"),
    (b64(PNG[:len(PNG) // 2]), "truncated or corrupt"),
    (b64(_png_header_only(0, 10)), "not an image"),                       # zero-sized: PIL refuses it
    (b64(encoded(Image.new("1", (20000, 20000)))), "decompression bomb"),  # 400 megapixels in 48 KiB
    (b64(encoded(Image.new("1", (6000, 6000)))), "more than the"),         # over our 32 Mi-pixel bound
    (b64(encoded(Image.new("RGB", (8, 8)), "TIFF")), "not an image"),      # a format we do not take
    ("/etc/hostname.png", "not allowed here"),
    ("file:///etc/hosts", "not allowed here"),
    ("file://host/etc/hosts.png", "names no host"),
    (" \tHTTPS://example.com/cat", "not fetched from the network"),  # as urllib and vLLM read a URL
    ("file://[::1/etc/hosts.png", "not a file URL"),  # urllib raises ValueError on it: was a 500
], ids=["empty", "not-a-string", "http", "https", "bad-base64", "data-url-not-base64", "text", "truncated",
        "zero-sized", "bomb", "over-our-bound", "tiff", "path", "file-url", "file-url-host", "url-spelt-otherwise",
        "file-url-unparsable"])
def test_refusals(item, reason: str) -> None:
    with pytest.raises(ImageInputError, match=reason):
        load_image(item, POLICY)


def test_a_jpeg_of_too_many_scans_is_refused_before_decoding() -> None:
    """Found by review: a progressive JPEG may repeat scans, a dozen bytes each, and libjpeg goes over every block
    of the image for each (a 131 KiB JPEG of 25 Mi pixels took 7.5 s of CPU in a decode slot, a megabyte of them
    would take minutes): no client could stop it, and two held every image decode of the engine."""
    with pytest.raises(ImageInputError, match="more than 100 scans"):
        load_image(b64(progressive_jpeg(100)), POLICY)
    from node_engine.vision.prescan import MAX_JPEG_SCANS, check_jpeg_scans

    # Real JPEGs pass: baseline, progressive (color, CMYK), with EXIF, and up to the limit of scans.
    exif = Image.Exif()
    exif[0x0110] = "camera"
    for image, options in [(Image.new("RGB", (40, 30)), {}), (Image.new("RGB", (40, 30)), {"progressive": True}),
                           (Image.new("CMYK", (40, 30)), {"progressive": True}),
                           (Image.new("RGB", (40, 30)), {"exif": exif.tobytes(), "progressive": True})]:
        buffer = io.BytesIO()
        image.save(buffer, "JPEG", **options)
        assert load_image(b64(buffer.getvalue()), POLICY).size == (40, 30)
    scans = progressive_jpeg(0).count(b"\xff\xda")
    assert load_image(b64(progressive_jpeg(MAX_JPEG_SCANS - scans)), POLICY).size == (64, 64)
    # Bytes that look like scans inside a segment (a comment, an EXIF thumbnail) or after the EOI are not.
    comment = b"\xff\xfe" + (2 + 4 * 200).to_bytes(2, "big") + b"\xff\xda\x00\x02" * 200
    jpeg = progressive_jpeg(0)
    check_jpeg_scans(jpeg[:2] + comment + jpeg[2:] + b"\xff\xda\x00\x02" * 200)
    with pytest.raises(ImageInputError, match="segments"):
        check_jpeg_scans(jpeg[:2] + b"\xff\xfe\x00\x02" * 5000 + jpeg[2:])


def _chunk(kind: bytes, data: bytes = b"") -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def _png_chunks(data: bytes) -> list[bytes]:
    """A PNG's chunks, each whole (length, type, data, CRC)."""
    pos, chunks = 8, []
    while pos < len(data):
        end = pos + 12 + int.from_bytes(data[pos:pos + 4], "big")
        chunks.append(data[pos:end])
        pos = end
    return chunks


def _png(chunks: list[bytes]) -> bytes:
    return b"\x89PNG\r\n\x1a\n" + b"".join(chunks)


def _apng(frames: int) -> bytes:
    buffer = io.BytesIO()
    images = [Image.new("RGB", (8, 8), (i % 256, i // 256, 7)) for i in range(frames)]
    images[0].save(buffer, "PNG", save_all=True, append_images=images[1:])
    return buffer.getvalue()


def _refused_quickly(data: bytes, reason: str) -> None:
    """Refused for ``reason``, which only the scan before decoding gives (milliseconds here); the bound is only
    against a scan gone quadratic, with room for a slow machine."""
    started = time.process_time()  # CPU time: a scan gone quadratic costs seconds of it, a loaded box none
    with pytest.raises(ImageInputError, match=reason):
        load_image(b64(data), POLICY)
    assert time.process_time() - started < 5.0


def test_a_png_of_too_many_chunks_is_refused_before_decoding() -> None:
    """Found by review: Pillow reads a PNG's chunks one by one in Python, holding the GIL (an empty chunk is 12
    bytes and about 2.6 us: a 36 MB image of them held the engine's event loop and engine thread for 8 s), before
    the image data, between its IDAT chunks and after them."""
    ihdr, idat, iend = _png_chunks(PNG)[0], b"".join(_png_chunks(PNG)[1:-1]), _png_chunks(PNG)[-1]
    junk = 100_000
    _refused_quickly(_png([ihdr, _chunk(b"abCd") * junk, idat, iend]), "more than .* chunks in its first frame")
    _refused_quickly(_png([ihdr, idat, _chunk(b"tEXt") * junk, iend]), "chunks in its first frame")
    _refused_quickly(_png([ihdr, _chunk(b"IDAT") * junk, idat, iend]), "chunks in its first frame")
    # An acTL of one frame with the image data first: Pillow takes it for a still image and reads to IEND.
    def fctl(sequence: int) -> bytes:
        return _chunk(b"fcTL", struct.pack(">IIIIIHHBB", sequence, 30, 20, 0, 0, 1, 10, 0, 0))

    one_frame = _chunk(b"acTL", struct.pack(">II", 1, 0))
    _refused_quickly(_png([ihdr, one_frame, fctl(0), idat, fctl(1), _chunk(b"abCd") * junk, iend]),
                     "chunks in its first frame")


def test_real_pngs_pass_the_chunk_walk() -> None:
    from node_engine.vision.prescan import MAX_HEADER_STEPS, check_png_chunks, header_steps

    ihdr, idat, iend = _png_chunks(PNG)[0], b"".join(_png_chunks(PNG)[1:-1]), _png_chunks(PNG)[-1]
    fits = _png([ihdr, _chunk(b"abCd") * (MAX_HEADER_STEPS - 2), idat, iend])  # IHDR, junk, IDAT: the budget
    assert header_steps(fits) == MAX_HEADER_STEPS + len(fits) // 4096 and len(fits) < 4096 * 13
    fits = _png([ihdr, _chunk(b"abCd") * (header_steps(fits) - 2), idat, iend])
    assert load_image(b64(fits), POLICY).size == (30, 20)
    with pytest.raises(ImageInputError, match="chunks"):
        check_png_chunks(_png([ihdr, _chunk(b"abCd") * (header_steps(fits) - 1), idat, iend]))
    # Image data in many chunks, as large images come (libpng writes 8 KiB chunks; here 2 KiB ones).
    buffer = io.BytesIO()
    Image.frombytes("L", (2900, 2900), os.urandom(2900 * 2900)).save(buffer, "PNG", compress_level=0)
    chunks = _png_chunks(buffer.getvalue())
    data = b"".join(chunk[8:-4] for chunk in chunks if chunk[4:8] == b"IDAT")
    split = _png([chunks[0], *(_chunk(b"IDAT", data[i:i + 2048]) for i in range(0, len(data), 2048)), chunks[-1]])
    assert len(_png_chunks(split)) > MAX_HEADER_STEPS
    assert load_image(b64(split), POLICY).size == (2900, 2900)
    # An animated PNG: only its first frame is read, so its length does not count (Pillow admits 2**31 frames).
    apng = _apng(3000)
    assert len(_png_chunks(apng)) > header_steps(apng)
    image = load_image(b64(apng), POLICY)
    assert image.size == (8, 8) and image.n_frames == 3000
    # Its first frame's chunks count, whether the image data is that frame or a default image before it.
    first, *rest = _png_chunks(apng)[:-1]
    cut = next(i for i, chunk in enumerate(rest) if chunk[4:8] == b"IDAT") + 1
    with pytest.raises(ImageInputError, match="chunks"):
        check_png_chunks(_png([first, *rest[:cut], _chunk(b"abCd") * 6000, *rest[cut:], iend]))


def _gif(blocks: bytes) -> bytes:
    """A 9 x 7 GIF with ``blocks`` between its header (and palette) and its first image."""
    data = encoded(Image.new("P", (9, 7)), "GIF")
    start = 13 + (3 << ((data[10] & 7) + 1) if data[10] & 0x80 else 0)
    return data[:start] + blocks + data[start:]


def test_a_gif_of_too_many_blocks_before_its_image_is_refused_before_decoding() -> None:
    """Found by review: Pillow walks a GIF's extensions, their data sub-blocks and stray bytes up to the first
    image one by one in Python (about 0.1 s a megabyte, holding the GIL)."""
    junk = 600_000
    _refused_quickly(_gif(b"\x21\xfe\x00" * junk), "more than .* blocks before its first image")  # comments
    _refused_quickly(_gif(b"\x21\xfe" + b"\x01x" * junk + b"\x00"), "blocks before its first image")  # 1 comment
    _refused_quickly(_gif(b"\x00" * junk), "blocks before its first image")                 # stray bytes


def test_real_gifs_pass_the_block_walk() -> None:
    from node_engine.vision.prescan import check_gif_blocks, header_steps

    comment = b"\x21\xfe" + (b"\xff" + b"c" * 255) * 1000 + b"\x00"  # a 255 KB comment: 1000 sub-blocks
    assert load_image(b64(_gif(b"\x21\xf9\x04\x00\x00\x00\x00\x00" + comment)), POLICY).size == (9, 7)
    fits = _gif(b"\x00" * 4096)
    fits = _gif(b"\x00" * header_steps(fits))
    check_gif_blocks(fits)
    with pytest.raises(ImageInputError, match="blocks"):
        check_gif_blocks(_gif(b"\x00" * (header_steps(fits) + 1)))
    # An animated GIF: what comes after the first image is not walked.
    buffer = io.BytesIO()
    images = [Image.new("P", (9, 7), i % 256) for i in range(5000)]
    images[0].save(buffer, "GIF", save_all=True, append_images=images[1:], comment=b"x")
    assert load_image(b64(buffer.getvalue()), POLICY).size == (9, 7)


def test_local_files_only_below_the_allowed_folder(tmp_path: Path) -> None:
    allowed = tmp_path / "media"
    allowed.mkdir()
    (allowed / "cat.png").write_bytes(PNG)
    (tmp_path / "secret.png").write_bytes(PNG)
    (allowed / "link.png").symlink_to(tmp_path / "secret.png")
    policy = ImagePolicy(local_media_dir=allowed)
    assert load_image(str(allowed / "cat.png"), policy).size == (30, 20)
    assert load_image(f"file://{allowed / 'cat.png'}", policy).size == (30, 20)
    for outside in (str(tmp_path / "secret.png"), str(allowed / "link.png"), str(allowed / ".." / "secret.png")):
        with pytest.raises(ImageInputError, match="no such image file below --allowed-local-media-path"):
            image_bytes(outside, policy)
    with pytest.raises(ImageInputError, match="no such image file"):
        image_bytes(str(allowed / "missing.png"), policy)


def test_paths_outside_the_folder_get_one_answer_whether_they_exist_or_not(tmp_path: Path) -> None:
    """Found by review: an outside path that exists answered "outside", a missing one "no such file"."""
    allowed = tmp_path / "media"
    allowed.mkdir()
    (tmp_path / "secret.png").write_bytes(PNG)
    policy = ImagePolicy(local_media_dir=allowed)
    answers = set()
    for name in ("secret.png", "missing.png"):
        for item in (str(tmp_path / name), f"file://{tmp_path / name}", str(allowed / ".." / name)):
            with pytest.raises(ImageInputError) as refusal:
                image_bytes(item, policy)
            answers.add(str(refusal.value).replace(name, "NAME").replace(str(allowed / ".."), str(tmp_path)))
    assert len(answers) == 1  # the same words for a file that exists and for one that does not


@pytest.mark.parametrize("item", ["/media/cat\x00.png", "file:///media/cat%00.png"], ids=["path", "file-url"])
def test_a_nul_in_a_local_path_is_refused(tmp_path: Path, item: str) -> None:
    """Found by review: a NUL reached Path.resolve (ValueError): a 500."""
    with pytest.raises(ImageInputError, match="NUL"):
        image_bytes(item, ImagePolicy(local_media_dir=tmp_path))


def test_a_fifo_swapped_in_below_the_folder_is_refused_not_waited_on(tmp_path: Path) -> None:
    (tmp_path / "pipe.png").unlink(missing_ok=True)
    os.mkfifo(tmp_path / "pipe.png")
    with pytest.raises(ImageInputError, match="not a file"):
        image_bytes(str(tmp_path / "pipe.png"), ImagePolicy(local_media_dir=tmp_path))


def test_max_image_pixels_above_pillows_own_limit_is_honoured(monkeypatch: pytest.MonkeyPatch) -> None:
    """Found by review: Pillow's bomb check (about 89.5 million pixels) refused what the flag allowed."""
    from node_engine.vision.decode import allow_pixels

    buffer = io.BytesIO()
    Image.new("1", (10000, 9000)).save(buffer, "PNG")  # 90 million pixels
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", Image.MAX_IMAGE_PIXELS)  # restored after the test
    allow_pixels(120_000_000)
    assert load_image(base64.b64encode(buffer.getvalue()).decode(), ImagePolicy(max_pixels=120_000_000)).size == (
        10000, 9000)
    with pytest.raises(ImageInputError, match="more than the 80000000 allowed"):
        load_image(base64.b64encode(buffer.getvalue()).decode(), ImagePolicy(max_pixels=80_000_000))


def _rle_bmp(width: int, height: int, pixels: bytes, *, rle4: bool = False) -> bytes:
    """A BMP whose ``pixels`` are run-length encoded (RLE8, or RLE4), with a 256 (16) colour palette."""
    palette = b"".join(bytes((i, i, i, 0)) for i in range(256)) if not rle4 else b"\x00\x40\x80\x00" * 16
    info = struct.pack("<IiiHHIIiiII", 40, width, height, 1, 4 if rle4 else 8, 2 if rle4 else 1, len(pixels),
                       2835, 2835, 0, 0)
    offset = 14 + len(info) + len(palette)
    return b"BM" + struct.pack("<IHHI", offset + len(pixels), 0, 0, offset) + info + palette + pixels


def test_a_run_length_encoded_bmp_of_many_pixels_is_refused_before_decoding() -> None:
    """Found by review: Pillow decodes an RLE BMP in Python, holding the GIL, and pads each row that an
    end-of-line code cuts short one byte at a time: 17 KB of BMP (one pixel and an end of line per row of
    8192 x 4096, under --max-image-pixels) took 7.6 s of CPU to decode, a request of 64 of them eight minutes."""
    rows = b"\x01\x07\x00\x00" * 4096 + b"\x00\x01"
    _refused_quickly(_rle_bmp(8192, 4096, rows), "run-length encoded BMP")
    _refused_quickly(_rle_bmp(8192, -4096, rows), "run-length encoded BMP")  # top-down: a negative height
    _refused_quickly(_rle_bmp(8192, 4096, (b"\xff\x12" * 33 + b"\x00\x00") * 4096, rle4=True),
                     "run-length encoded BMP")
    # Real RLE BMPs up to the bound pass (a 1920 x 1080 screenshot), and decode to what they encode.
    from node_engine.vision.prescan import MAX_RLE_BMP_PIXELS, check_bmp

    assert 1920 * 1080 <= MAX_RLE_BMP_PIXELS
    check_bmp(_rle_bmp(1920, 1080, rows))
    image = load_image(b64(_rle_bmp(30, 20, (b"\x1e\x05\x00\x00" * 20) + b"\x00\x01")), POLICY)
    assert image.size == (30, 20) and image.convert("RGB").getpixel((3, 4)) == (5, 5, 5)
    assert load_image(b64(encoded(Image.new("RGB", (3000, 2000)), "BMP")), POLICY).size == (3000, 2000)  # raw
