"""A safetensors file's header, read and checked by the ``safetensors`` library's own rules.

The format: 8 bytes (little-endian length N), N bytes of UTF-8 JSON, then the
tensors' bytes. A file is accepted here exactly when ``safetensors.safe_open``
(0.8, its Rust ``read_metadata``) accepts it, with the same names, dtypes and
shapes (``tests/handoff/test_safetensors_header.py`` checks this against the
library on generated and mutated files), so that an engine loading a file
this module passed cannot refuse it half way through a reload:

- N is at most 100,000,000 and 8 + N fits the file.
- The JSON is strict UTF-8 (no BOM) and an object. Each key but
  ``__metadata__`` is a tensor: ``{"dtype", "shape", "data_offsets"}`` (other
  fields ignored) or those three as an array; dtypes are the library's names
  (``"F32"``, or ``{"F32": null}`` as serde also reads an enum);
  shape entries and offsets are unsigned 64-bit integers (``-0``, ``1.0`` and
  ``true`` are not); ``__metadata__`` is null or an object of strings. A
  tensor given twice is checked twice and the last one counts; ``__metadata__``
  or a tensor's field given twice is refused. Nesting deeper than
  serde_json's limit (128 levels) is refused.
- Sorted by their offsets, the tensors tile the data exactly: each begins
  where the previous ends, each spans its shape times its dtype's size (no
  element count or bit count past 2**64 - 1, whole bytes), and the last ends
  at the end of the file.

A folder's shards are bounded together too (:func:`read_folder_headers`): the
library's limit is per file, and a folder of 4096 shards (``MAX_SHARDS``) with
a 100 MB header each would be 400 GB of JSON parsed and millions of tensors
held by one reload. Past ``MAX_FOLDER_HEADER_BYTES`` of headers or
``MAX_FOLDER_TENSORS`` tensors together the folder is refused, before the
header that would pass the first is read.
"""

from __future__ import annotations

import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from handoff.checkpoint.errors import CheckpointError
from handoff.checkpoint.files import FileReader, shown
from handoff.service.peer_json import PeerJSONError, loads_bounded

MAX_HEADER_BYTES = 100_000_000   # the library's limit
MAX_FOLDER_HEADER_BYTES = 256 * 1024 * 1024  # every shard's header together (a large MoE's: tens of MB)
MAX_FOLDER_TENSORS = 1 << 20                 # every shard's tensors together (a large MoE's: a few 100,000)
MAX_HEADER_DEPTH = 127           # serde_json refuses a 128th level
USIZE_MAX = 2**64 - 1
METADATA_KEY = "__metadata__"
_TENSOR_FIELDS = ("dtype", "shape", "data_offsets")

# Each dtype the library knows, with its size in bits.
DTYPE_BITS = {
    "BOOL": 8, "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8, "F8_E8M0": 8,
    "F8_E4M3FNUZ": 8, "F8_E5M2FNUZ": 8, "I16": 16, "U16": 16, "F16": 16, "BF16": 16, "I32": 32, "U32": 32,
    "F32": 32, "C64": 64, "F64": 64, "I64": 64, "U64": 64,
}


@dataclass(frozen=True)
class HeaderEntry:
    """One tensor of a safetensors file: its dtype (the library's name), shape, and absolute byte range."""

    file: Path
    dtype: str
    shape: tuple[int, ...]
    offset: int
    num_bytes: int
    version: tuple[int, ...] = ()  # the file's when its header was read (:meth:`FileReader.version`)


def read_header(reader: FileReader, path: Path) -> dict[str, HeaderEntry]:
    """Every tensor of one safetensors file, from its header (checked against the file's size)."""
    raw, data_size, version = _read_raw(reader, path)
    return parse_header(raw, path=path, data_size=data_size, version=version)


def _read_raw(reader: FileReader, path: Path, budget: int | None = None) -> tuple[bytes, int, tuple[int, ...]]:
    """(header bytes, data size, file version) of one file; with ``budget`` (what the folder's headers may still
    take), a longer header is a CheckpointError before it is read."""
    fd, size = reader.open(path)
    try:
        version = reader.version(fd)
        if size < 8:
            raise CheckpointError(f"{path.name} is too short to be a safetensors file ({size} bytes)")
        (header_len,) = struct.unpack("<Q", reader.pread(fd, 8, 0, path))
        if header_len > MAX_HEADER_BYTES or 8 + header_len > size:
            raise CheckpointError(f"{path.name}: header length {header_len} does not fit the file ({size} "
                                  f"bytes) or the {MAX_HEADER_BYTES}-byte limit")
        if budget is not None and header_len > budget:
            raise CheckpointError(f"the shards hold headers of more than {MAX_FOLDER_HEADER_BYTES} bytes together "
                                  f"(at {path.name}, a header of {header_len} bytes)")
        raw = reader.pread(fd, header_len, 8, path)
    finally:
        os.close(fd)
    return raw, size - 8 - header_len, version


def parse_header(raw: bytes, *, path: Path, data_size: int, version: tuple[int, ...] = ()) -> dict[str, HeaderEntry]:
    """The tensors of a header ``raw`` followed by ``data_size`` bytes of data (the module docstring's rules)."""
    header = _decode(raw, path.name)
    infos: dict[str, tuple[str, tuple[int, ...], tuple[int, int]]] = {}
    for name, value in header.pairs:
        if name == METADATA_KEY:
            _check_metadata(value, path.name, given_twice=name in infos)
            infos[name] = ("", (), (0, 0))  # seen; not a tensor
        else:
            infos[name] = _tensor_info(name, value, path.name)  # a name given twice: each checked, the last kept
    infos.pop(METADATA_KEY, None)
    entries: dict[str, HeaderEntry] = {}
    covered = 0
    for name, (dtype, shape, (begin, end)) in sorted(infos.items(), key=lambda item: item[1][2]):
        if begin != covered or end < begin:
            raise CheckpointError(f"{path.name}: tensor {_name(name)} has data_offsets [{begin}, {end}], where "
                                  f"[{covered}, ...) was due (the tensors must tile the data)")
        covered = end
        num_bits = _num_bits(shape, DTYPE_BITS[dtype], name, path.name)
        if num_bits % 8 or end - begin != num_bits // 8:
            raise CheckpointError(f"{path.name}: tensor {_name(name)} ({dtype} {shown_shape(shape)}) does not span its "
                                  f"data_offsets [{begin}, {end}]")
        entries[name] = HeaderEntry(path, dtype, shape, 8 + len(raw) + begin, end - begin, version)
    if covered != data_size:
        raise CheckpointError(f"{path.name}: the tensors cover {covered} of the {data_size} bytes after the "
                              "header")
    return entries


def _name(name: str) -> str:
    """A tensor name as messages show it: cut as a path is (a header's names are the file's to choose)."""
    return repr(shown(name))


def shown_shape(shape: tuple[int, ...]) -> str:
    """A shape as messages show it: its first 16 dimensions."""
    return str(list(shape)) if len(shape) <= 16 else f"{str(list(shape[:16]))[:-1]}, ...] ({len(shape)} dimensions)"


class _Object(dict):
    """A JSON object that keeps its (key, value) pairs as written: serde checks each, a key given twice too."""

    __slots__ = ("pairs",)

    def __init__(self, pairs: list[tuple[str, Any]]) -> None:
        super().__init__(pairs)
        self.pairs = pairs


def _check_metadata(value: object, file_name: str, *, given_twice: bool) -> None:
    if given_twice:
        raise CheckpointError(f"{file_name}: {METADATA_KEY} is given twice")
    if value is not None and not (isinstance(value, _Object) and all(isinstance(v, str) for _, v in value.pairs)):
        raise CheckpointError(f"{file_name}: {METADATA_KEY} is not an object of strings")


def _json_int(text: str) -> int | float:
    """A JSON integer as serde_json reads it: a usize when it is one, else a float (never a usize)."""
    value = int(text)
    if text[0] != "-" and value <= USIZE_MAX:
        return value
    as_float = float(value)  # OverflowError past a float's range: serde_json's "number out of range" too
    if not math.isfinite(as_float):
        raise ValueError(f"{text[:40]} is out of range")
    return as_float


def _decode(raw: bytes, name: str) -> _Object:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise CheckpointError(f"{name}: the safetensors header is not UTF-8 ({exc.reason} at byte {exc.start})")
    try:
        # in turns: the engine serves while a reload parses, and a scan over the whole header (floats out of
        # range) held the GIL for seconds on 16 MB of ``e``; the nesting is measured over each object's ``pairs``
        header = loads_bounded(text, max_depth=MAX_HEADER_DEPTH, parse_int=_json_int, object_pairs_hook=_Object,
                               in_turns=True)
    except PeerJSONError as exc:
        raise CheckpointError(f"{name}: the safetensors header is not valid JSON ({exc})") from exc
    if not isinstance(header, _Object):
        raise CheckpointError(f"{name}: the safetensors header is not a JSON object")
    return header


def _is_usize(value: object) -> bool:
    return type(value) is int and 0 <= value <= USIZE_MAX


def _tensor_info(name: str, value: object, file_name: str) -> tuple[str, tuple[int, ...], tuple[int, int]]:
    """(dtype, shape, (begin, end)) of one header entry, in either of the forms serde accepts."""
    if isinstance(value, _Object) and all(field in value for field in _TENSOR_FIELDS):
        if len([key for key, _ in value.pairs if key in _TENSOR_FIELDS]) != len(_TENSOR_FIELDS):
            raise CheckpointError(f"{file_name}: tensor {_name(name)} gives a field twice")
        dtype, shape, offsets = value["dtype"], value["shape"], value["data_offsets"]
    elif isinstance(value, list) and len(value) == 3:
        dtype, shape, offsets = value
    else:
        raise CheckpointError(f"{file_name}: tensor {_name(name)} is not an object with dtype, shape and data_offsets")
    if isinstance(dtype, _Object) and len(dtype.pairs) == 1 and dtype.pairs[0][1] is None:
        dtype = dtype.pairs[0][0]  # serde reads an enum's variant from {"F32": null} too
    if not isinstance(dtype, str) or dtype not in DTYPE_BITS:
        raise CheckpointError(f"{file_name}: tensor {_name(name)} has an unknown dtype {str(dtype)[:40]!r}")
    if (not isinstance(shape, list) or not all(map(_is_usize, shape)) or not isinstance(offsets, list)
            or len(offsets) != 2 or not all(map(_is_usize, offsets))):
        raise CheckpointError(f"{file_name}: tensor {_name(name)} has a malformed shape or data_offsets (unsigned "
                              "integers)")
    return dtype, tuple(shape), (offsets[0], offsets[1])


def _num_bits(shape: tuple[int, ...], dtype_bits: int, name: str, file_name: str) -> int:
    count = 1
    for dim in shape:
        count *= dim
        if count > USIZE_MAX:  # the library multiplies left to right in 64 bits
            raise CheckpointError(f"{file_name}: tensor {_name(name)}'s shape {shown_shape(shape)} overflows")
    if count * dtype_bits > USIZE_MAX:
        raise CheckpointError(f"{file_name}: tensor {_name(name)}'s size in bits overflows")
    return count * dtype_bits


def read_folder_headers(reader: FileReader, folder: Path) -> dict[str, HeaderEntry]:
    """Every tensor of a checkpoint folder (its shards' headers); a tensor in two shards is a CheckpointError, and so
    are more than ``MAX_FOLDER_HEADER_BYTES`` of headers or ``MAX_FOLDER_TENSORS`` tensors together."""
    entries: dict[str, HeaderEntry] = {}
    budget = MAX_FOLDER_HEADER_BYTES
    for path in reader.shard_files(folder):
        raw, data_size, version = _read_raw(reader, path, budget)
        budget -= len(raw)
        shard = parse_header(raw, path=path, data_size=data_size, version=version)
        del raw
        if len(entries) + len(shard) > MAX_FOLDER_TENSORS:
            raise CheckpointError(f"the shards hold more than {MAX_FOLDER_TENSORS} tensors together (at {path.name})")
        for name, entry in shard.items():
            if name in entries:
                raise CheckpointError(f"tensor {_name(name)} is in two shards: {entries[name].file.name} and "
                                      f"{path.name}")
            entries[name] = entry
    return entries
