"""Media sources screened on their way to an engine that fetches and reads them on its own (SGLang, vLLM).

handoff's engine reads images itself under its own rules; SGLang and vLLM do
not share them. SGLang 0.5.23 reads any ``file://`` URL or path starting with
``/`` it is given, with no folder and no size limit (``utils/common.py``:
``get_image_bytes``; a video or an audio item that is not a URL or a data URL
is a path, relative ones too), and fetches ``http(s)`` URLs; vLLM reads files
below its own ``--allowed-local-media-path`` and fetches URLs unless told
which domains to take. The sidecar is the node's only door, so on the way to
such an engine every media item (``image_data``, ``video_data``,
``audio_data`` of ``/generate``, and the ``image_url``, ``video_url``,
``audio_url`` of chat parts, at any depth) is read as
:mod:`handoff.protocol.image_source` reads it, and:

- a local file is a 400 unless it is an absolute path to a file below the
  sidecar's ``--allowed-local-media-path`` (a link out of it, a FIFO, a
  device are refused);
- an ``http(s)`` URL passes (SGLang's users send them), unless the sidecar
  runs with ``--refuse-media-urls``;
- the bytes themselves (a data URL, base64) pass. A bare base64 video of
  ``MAX_PATH_CHARS`` characters or more passes too: SGLang reads a video item
  that names no existing file as base64, and the file system refuses a path
  that long (a shorter one is read as a path, as above).

A body that cannot hold such an item costs one search of its bytes: a key of
one ends in ``_data`` or ``_url``, and JSON can spell a letter of it only as
itself or as a ``\\u`` escape. Other bodies are parsed (in a thread: they
carry media) and walked.
"""

from __future__ import annotations

import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from handoff.protocol.image_source import (MAX_PATH_CHARS, ImageInputError, SourceKind, allowed_local_path,
                                           image_source)
from handoff.service.errors import InvalidRequest, parse_json_bytes

IMAGE_KEYS = frozenset({"image_data", "image_url"})
OTHER_MEDIA_KEYS = frozenset({"video_data", "audio_data", "video_url", "audio_url"})
_MAY_HOLD_MEDIA = re.compile(rb'_(?:data|url)"|\\u')
_BASE64 = re.compile(r"[A-Za-z0-9+/]+={0,2}")  # no scheme, query, fragment or escape a path reader could act on


@dataclass(frozen=True)
class MediaPolicy:
    local_media_dir: Path | None = None  # None: no local path reaches the engine
    refuse_urls: bool = False            # True: no http(s) URL reaches the engine


def may_hold_media(body: bytes) -> bool:
    """False when the body cannot name a media item (checked without parsing it)."""
    return _MAY_HOLD_MEDIA.search(body) is not None


def screen_body(body: bytes, policy: MediaPolicy) -> None:
    """400 (InvalidRequest naming the field) for a media item the policy keeps from the engine. Reads the file
    system for local paths: run it off the event loop."""
    for field, item, kind in media_items(parse_json_bytes(body)):
        try:
            _screen(item, kind, policy)
        except ImageInputError as exc:
            raise InvalidRequest(f"{field}: {exc}", extra={"field": field}) from None


def media_items(value: Any, where: str = "body") -> Iterator[tuple[str, str, str]]:
    """Every string an engine may load as media: ``(field, item, kind)`` (``image``, ``video``, ``audio``). Below
    a media key, an item is a string, in lists at any depth, or a dict's ``url`` (SGLang's ``ImageData``,
    OpenAI's ``{"url": ...}``)."""
    if isinstance(value, dict):
        for key, inner in value.items():
            if key in IMAGE_KEYS or key in OTHER_MEDIA_KEYS:
                yield from _items(inner, f"{where}.{key}", key.split("_")[0])
            else:
                yield from media_items(inner, f"{where}.{key}")
    elif isinstance(value, list):
        for i, inner in enumerate(value):
            yield from media_items(inner, f"{where}[{i}]")


def _items(value: Any, where: str, kind: str) -> Iterator[tuple[str, str, str]]:
    if isinstance(value, str):
        yield where, value, kind
    elif isinstance(value, list):
        for i, inner in enumerate(value):
            yield from _items(inner, f"{where}[{i}]", kind)
    elif isinstance(value, dict) and "url" in value:
        yield from _items(value["url"], f"{where}.url", kind)


def _screen(item: str, kind: str, policy: MediaPolicy) -> None:
    if not item:
        return  # nothing to load: the engine answers for it
    source = image_source(item)
    if source.kind is SourceKind.NETWORK:
        if policy.refuse_urls:
            raise ImageInputError("media URLs are not fetched on this node (--refuse-media-urls); send the bytes "
                                  "(a data URL)")
        return
    if source.kind is SourceKind.DATA_URL:
        return
    if source.kind is SourceKind.LOCAL:
        _check_local(source.text, policy)
    elif kind == "video" and len(item) >= MAX_PATH_CHARS and _BASE64.fullmatch(item):
        return  # SGLang's base64 video (it would be a path only if such a file existed: none can)
    elif item.startswith("/") or kind != "image":  # SGLang reads these as paths
        if policy.local_media_dir is None:
            raise ImageInputError("the engine would read this as a local file path (SGLang opens any image that "
                                  "starts with '/', and any video or audio that is not a URL); local paths are not "
                                  "allowed here: send the bytes as a data URL (data:<type>;base64,...)")
        _check_local(item, policy)


def _check_local(path: str, policy: MediaPolicy) -> None:
    if policy.local_media_dir is not None and not os.path.isabs(path):
        raise ImageInputError(f"a local media path must be absolute (send other bytes as a data URL): {path[:200]!r}")
    resolved = allowed_local_path(Path(path), policy.local_media_dir)
    try:
        is_file = stat.S_ISREG(os.stat(resolved).st_mode)
    except OSError:
        is_file = False
    if not is_file:
        raise ImageInputError(f"{path} is not a file")
