"""What an image item of a request points at: its bytes, a local file, or the network. Strings only, no decoding.

An image arrives as SGLang's ``image_data`` items and OpenAI's ``image_url``
parts send it: a data URL (``data:image/png;base64,...``), bare base64, a
local file (``file:///...``, or a path ending in an image extension), or an
``http(s)://`` URL. Both doors use this one reading: handoff's engine
(:mod:`node_engine.vision.decode`, which refuses URLs and reads files only
below ``--allowed-local-media-path``) and the sidecar in front of an engine
that fetches and reads on its own (:mod:`node_sidecar.media`).

A URL's scheme is read as Python's and urllib3's URL parsers read it (vLLM
parses with urllib3): blanks and control characters before it are skipped,
tabs and line breaks inside it dropped, case ignored. So ``" HTTP://..."`` is
a network URL here, as it is to vLLM.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from urllib.parse import unquote, urlsplit

IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".webp", ".gif", ".bmp")
MAX_PATH_CHARS = 4096  # longer is never a path (PATH_MAX): bare base64 that happens to end in ".png"
_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*")
_BLANK_OR_CONTROL = "".join(map(chr, range(0x21)))  # what urlsplit strips before a URL (WHATWG's C0 or space)
_DROPPED = re.compile(r"[\t\r\n]")                   # what urlsplit drops anywhere in a URL


class ImageInputError(ValueError):
    """An image a request cannot use; the message says why (the caller answers 400)."""


class SourceKind(Enum):
    NETWORK = "network"    # http(s) URL: ``text`` is the URL
    LOCAL = "local"        # a local file: ``text`` is its path
    DATA_URL = "data_url"  # ``text`` is the whole data URL
    BASE64 = "base64"      # ``text`` is the item (anything else is read as base64)


@dataclass(frozen=True)
class ImageSource:
    kind: SourceKind
    text: str


def url_scheme(item: str) -> str:
    """The item's URL scheme, lowercased, as ``urllib.parse.urlsplit`` finds it ("" for none). Only the text
    before the first colon is looked at, so a megabyte of base64 costs one search for a colon."""
    colon = item.find(":")
    if colon < 0:
        return ""
    head = _DROPPED.sub("", item[:colon].lstrip(_BLANK_OR_CONTROL))
    return head.lower() if _SCHEME.fullmatch(head) else ""


def image_source(item: object) -> ImageSource:
    """Where an ``image_data`` item or an ``image_url`` URL points (ImageInputError if it cannot be an image)."""
    if not isinstance(item, str):
        raise ImageInputError(f"an image must be a string (base64, a data URL or an allowed file path), "
                              f"got {type(item).__name__}")
    if not item:
        raise ImageInputError("the image is empty")
    scheme = url_scheme(item)
    if scheme.startswith("http"):  # vLLM fetches any scheme that starts so
        return ImageSource(SourceKind.NETWORK, item)
    if scheme == "file":
        return ImageSource(SourceKind.LOCAL, file_url_path(item))
    if item.lower().endswith(IMAGE_EXTENSIONS) and len(item) < MAX_PATH_CHARS:
        return ImageSource(SourceKind.LOCAL, item)
    if scheme == "data":
        return ImageSource(SourceKind.DATA_URL, item)
    return ImageSource(SourceKind.BASE64, item)


def file_url_path(url: str) -> str:
    """The path of a ``file:`` URL; one naming a host is refused (engines disagree on what it means: SGLang drops
    the host, vLLM reads it as the path's first folder)."""
    try:
        parts = urlsplit(url)
    except ValueError:  # an authority urllib cannot read ("file://[::1/..."): a host, or nothing usable
        raise ImageInputError(f"not a file URL (file:///path): {url[:200]!r}") from None
    if parts.netloc:
        raise ImageInputError(f"a file URL names no host (file:///path), got {url[:200]!r}")
    return unquote(parts.path)


def allowed_local_path(path: Path, allowed: Path | None) -> Path:
    """``path`` resolved, if it is below the folder ``allowed`` (ImageInputError if not). Whatever is outside it
    gets one answer whether or not it exists: the path is checked as written before the file system is asked
    anything. Asks the file system (to resolve links): call it off an event loop."""
    if allowed is None:
        raise ImageInputError("local image paths are not allowed here (they are read only below "
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
    return resolved
