"""The safetensors header parser against the ``safetensors`` library (differential fuzz).

``handoff.checkpoint.safetensors_header`` must accept a file exactly when
``safetensors.safe_open`` does, with the same tensor names, dtypes and shapes:
the sidecar's check exists so that a foreign engine never refuses a file half
way through a reload, and the engine reads files the library would read.
Files are generated (valid layouts, then perturbed: offsets, sizes, numbers
spelt as JSON allows, keys given twice, metadata, padding) and mutated byte by
byte; each is given to both.
"""

from __future__ import annotations

import json
import struct
import threading
import time
from pathlib import Path
from typing import Callable

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors import SafetensorError, safe_open

from handoff.checkpoint.errors import CheckpointError
from handoff.checkpoint.files import FileReader
from handoff.checkpoint.safetensors_header import DTYPE_BITS, USIZE_MAX, read_header

FUZZ = settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


class Raw(str):
    """A JSON token written as is (``-0``, ``1.0``, ``true``, a number past 64 bits)."""


def encode(value: object) -> str:
    """JSON text; a list of pairs is an object (so a key may come twice), :class:`Raw` is written as is."""
    if isinstance(value, Raw):
        return str(value)
    if isinstance(value, tuple):  # an object as (key, value) pairs
        return "{" + ", ".join(f"{json.dumps(k)}: {encode(v)}" for k, v in value) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(encode(v) for v in value) + "]"
    return json.dumps(value)


def write(path: Path, header: bytes, data_size: int, declared: int | None = None) -> Path:
    path.write_bytes(struct.pack("<Q", len(header) if declared is None else declared) + header
                     + b"\x00" * data_size)
    return path


def outcome_of_library(path: Path) -> dict | str:
    try:
        with safe_open(str(path), framework="pt") as f:
            return {name: (list(f.get_slice(name).get_shape()), f.get_slice(name).get_dtype()) for name in f.keys()}
    except SafetensorError:
        return "refused"


def outcome_of_ours(path: Path) -> dict | str:
    try:
        entries = read_header(FileReader(), path)
    except CheckpointError:
        return "refused"
    return {name: (list(entry.shape), entry.dtype) for name, entry in entries.items()}


def assert_same(path: Path) -> None:
    theirs, ours = outcome_of_library(path), outcome_of_ours(path)
    assert ours == theirs, f"ours {ours!r} != the library's {theirs!r} for {path.read_bytes()[:600]!r}"


# -- generated layouts ---------------------------------------------------------------
ODD_NUMBERS = [Raw("-0"), Raw("1.0"), Raw("1e0"), Raw("true"), Raw("-1"), Raw(str(USIZE_MAX)),
               Raw(str(USIZE_MAX + 1)), Raw("1" + "0" * 400), Raw("null"), Raw('"2"')]


def mostly(usual: list, odd: list, weight: int = 12) -> st.SearchStrategy:
    """One of ``usual`` most of the time, else one of ``odd`` (most generated files should be valid)."""
    return st.sampled_from(usual * weight + odd)


dims = st.one_of(*[st.integers(1, 6)] * 40, st.just(0), st.sampled_from([2**32, USIZE_MAX]),
                 st.sampled_from(ODD_NUMBERS))
dtypes = mostly(sorted(DTYPE_BITS), ["X", "f32", "F32 ", ""], weight=15)
tensor_specs = st.lists(st.tuples(st.text("abc._", min_size=1, max_size=4), dtypes, st.lists(dims, max_size=3)),
                        max_size=5)


def _num_bytes(dtype: str, shape: list) -> int:
    count = DTYPE_BITS.get(dtype, 32)
    for dim in shape:
        count *= dim if type(dim) is int else 1
    return min(count // 8, 1 << 12)


@st.composite
def layouts(draw: st.DrawFn) -> tuple[bytes, int]:
    """A header and a data size: tensors laid out one after another, then perturbed."""
    fields, offset = [], 0
    for name, dtype, shape in draw(tensor_specs):
        size = _num_bytes(dtype, shape)
        begin, end = offset, offset + size
        perturb = draw(mostly(["none"], ["begin", "end", "odd", "swap"], weight=30))
        if perturb == "begin":
            begin += draw(st.sampled_from([-1, 1]))
        elif perturb == "end":
            end += draw(st.sampled_from([-1, 1]))
        offsets: list = [begin, end]
        if perturb == "odd":
            offsets = draw(st.sampled_from([[Raw("-0"), end], [begin, end, end], [begin], [Raw(f"{begin}.0"), end]]))
        elif perturb == "swap":
            offsets = [end, begin]
        offset += size
        form = draw(mostly(["object"], ["array", "extra", "missing", "field twice"], weight=10))
        if form == "array":
            fields.append((name, [dtype, shape, offsets]))
        elif form == "extra":
            fields.append((name, (("dtype", dtype), ("shape", shape), ("data_offsets", offsets),
                                  ("z", draw(st.sampled_from([[[[1]]], Raw("-0"), {"a": None}]))))))
        elif form == "field twice":
            fields.append((name, (("dtype", dtype), ("shape", shape), ("data_offsets", offsets), ("dtype", dtype))))
        elif form == "missing":
            fields.append((name, (("dtype", dtype), ("data_offsets", offsets))))
        else:
            fields.append((name, (("dtype", dtype), ("shape", shape), ("data_offsets", offsets))))
    metadata = draw(mostly(["absent", (("k", "v"),), Raw("null")], [(("k", 1),), [], (("k", 1), ("k", "v"))], weight=8))
    for _ in range(0 if metadata == "absent" else draw(mostly([1], [2]))):
        fields.insert(draw(st.integers(0, len(fields))), ("__metadata__", metadata))
    text = encode(tuple(fields))
    text = draw(mostly(["", " ", "\n"], ["\ufeff"])) + text + draw(mostly(["", "   ", "\t"], ["x", "\0"]))
    data_size = offset + draw(mostly([0], [-1, 1], weight=30))
    return text.encode("utf-8"), max(data_size, 0)


@FUZZ
@given(layout=layouts())
def test_generated_headers_are_judged_as_the_library_judges_them(tmp_path: Path, layout: tuple[bytes, int]) -> None:
    header, data_size = layout
    assert_same(write(tmp_path / "f.safetensors", header, data_size))


@FUZZ
@given(layout=layouts(), edits=st.lists(st.tuples(st.integers(0, 10**6), st.sampled_from(["set", "insert", "drop"]),
                                                  st.integers(0, 255)), min_size=1, max_size=3))
def test_mutated_headers_are_judged_as_the_library_judges_them(tmp_path: Path, layout: tuple[bytes, int],
                                                                 edits: list[tuple[int, str, int]]) -> None:
    header, data_size = bytearray(layout[0]), layout[1]
    for position, edit, byte in edits:
        if not header:
            break
        at = position % len(header)
        if edit == "set":
            header[at] = byte
        elif edit == "insert":
            header.insert(at, byte)
        else:
            del header[at]
    assert_same(write(tmp_path / "f.safetensors", bytes(header), data_size))


@pytest.mark.parametrize("header, data_size, declared", [
    (b"{}", 0, None),
    (b"{}", 0, 3),                    # the declared length past the file
    (b"{}", 0, 100_000_001),          # past the library's limit
    (b"", 0, None),
    (b'{"a": {"dtype": "F4", "shape": [2], "data_offsets": [0, 1]}}', 1, None),       # two 4-bit values, one byte
    (b'{"a": {"dtype": "F6_E2M3", "shape": [2], "data_offsets": [0, 1]}}', 1, None),  # 12 bits: not whole bytes
    (b'{"a": {"dtype": "F32", "shape": [4294967296, 4294967296, 0], "data_offsets": [0, 0]}}', 0, None),  # overflow
    (b'{"a": {"dtype": "F32", "shape": [0, 4294967296, 4294967296], "data_offsets": [0, 0]}}', 0, None),  # 0 first
    (b'{"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}, "a": {"dtype": "F32", "shape": [2], '
     b'"data_offsets": [0, 8]}}', 8, None),                                                 # a key twice: the last
    (b'{"a": {"dtype": "F32", "shape": [0], "data_offsets": [0, 0]}, "b": {"dtype": "F32", "shape": [0], '
     b'"data_offsets": [0, 0]}}', 0, None),                                                 # two empty tensors
    (b'{"\\ud800": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}', 4, None),     # a lone surrogate
    (b'{"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4], "z": ' + b"[" * 126 + b"]" * 126 + b"}}", 4,
     None),                                                                                 # 128 levels
    (b'{"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4], "z": ' + b"[" * 125 + b"]" * 125 + b"}}", 4,
     None),                                                                                 # 127 levels
    *[(b'{"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4], "z": ' + b"[" * n + b"]" * n + b'}, "a": '
       b'{"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}', 4, None) for n in (125, 126)],  # hidden by a twin
    (b'{"a": {"dtype": "X", "shape": [1], "data_offsets": [0, 4]}, "a": {"dtype": "F32", "shape": [1], '
     b'"data_offsets": [0, 4]}}', 4, None),                                                 # the first of two is bad
    (b'{"a": {"dtype": "F32", "dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}', 4, None),  # a field twice
    (b'{"a": {"dtype": "F32", "z": 1, "z": 2, "shape": [1], "data_offsets": [0, 4]}}', 4, None),  # an extra twice
    (b'{"__metadata__": null, "__metadata__": {}}', 0, None),                                # metadata twice
    (b'{"__metadata__": {"k": 1, "k": "v"}}', 0, None),                                      # a bad value hidden
    (b'{\x00}\x00', 0, None),         # UTF-16 to a guesser, not JSON in UTF-8
    (b'\xef\xbb\xbf{}', 0, None),     # a UTF-8 BOM
    (b'{"a": {"dtype": "F32", "shape": [1e400], "data_offsets": [0, 4]}}', 4, None),
    (b'{"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4], "z": 2' + b"0" * 250 + b'e60}}', 4, None),  # 2e310
    (b'{"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4], "z": "\\ud800"}, "a": {"dtype": "F32", '
     b'"shape": [1], "data_offsets": [0, 4]}}', 4, None),                           # a lone surrogate in the first a
    (b'{"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4], "z": {"q": "\\udc00", "q": 1}}}', 4, None),
    (b'{"__metadata__": {"k": "\\ud800", "k": "v"}}', 0, None),                   # hidden by a key given twice
    (b'{"a": {"dtype": {"F32": null}, "shape": [1], "data_offsets": [0, 4]}}', 4, None),  # serde's enum as a map
    (b'{"a": [{"F32": null}, [1], [0, 4]]}', 4, None),
    (b'{"a": {"dtype": {"F32": null, "F32": null}, "shape": [1], "data_offsets": [0, 4]}}', 4, None),
    (b'{"a": {"dtype": {"F32": 1}, "shape": [1], "data_offsets": [0, 4]}}', 4, None),
])
def test_edges_are_judged_as_the_library_judges_them(tmp_path: Path, header: bytes, data_size: int,
                                                     declared: int | None) -> None:
    assert_same(write(tmp_path / "f.safetensors", header, data_size, declared))


def test_a_file_shorter_than_its_length_prefix_and_non_files_are_refused(tmp_path: Path) -> None:
    (tmp_path / "short.safetensors").write_bytes(b"\x01\x02")
    assert_same(tmp_path / "short.safetensors")
    (tmp_path / "dir.safetensors").mkdir()
    with pytest.raises(CheckpointError, match="regular files"):
        read_header(FileReader(), tmp_path / "dir.safetensors")


def test_a_device_is_refused_before_it_is_opened(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Opening some devices acts (a watchdog starts): a shard that links to one is refused on what it names."""
    import os

    (tmp_path / "model.safetensors").symlink_to("/dev/zero")
    opened: list[str] = []
    real_open = os.open
    monkeypatch.setattr(os, "open", lambda path, *args, **kwargs: opened.append(str(path)) or real_open(
        path, *args, **kwargs))
    with pytest.raises(CheckpointError, match="a character device"):
        read_header(FileReader(), tmp_path / "model.safetensors")
    assert opened == []


# -- a folder's headers together -------------------------------------------------------
def shard_with(path: Path, num_tensors: int, padding: int = 0) -> Path:
    """A valid shard of ``num_tensors`` empty tensors named after the file, its header padded with spaces."""
    fields = tuple((f"{path.stem}.{i}", (("dtype", "F32"), ("shape", [0]), ("data_offsets", [0, 0])))
                   for i in range(num_tensors))
    return write(path, encode(fields).encode() + b" " * padding, 0)


class CountingReader(FileReader):
    """Counts the bytes read."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes_read = 0

    def pread(self, fd: int, num_bytes: int, offset: int, path: Path) -> bytes:
        self.bytes_read += num_bytes
        return super().pread(fd, num_bytes, offset, path)


def test_a_folder_s_headers_are_bounded_together_not_only_each(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each header may be up to 100 MB (the library's limit per file), and a folder up to 4096 shards: 400 GB of
    JSON parsed, and its tensors held, by one reload. The headers are bounded together: past the bound the folder is
    refused (a 400) once that much has been read, and nothing more is read."""
    from handoff.checkpoint import safetensors_header

    limit = 64 * 1024
    monkeypatch.setattr(safetensors_header, "MAX_FOLDER_HEADER_BYTES", limit)
    for i in range(40):
        shard_with(tmp_path / f"model-{i:05d}.safetensors", 2, padding=limit // 8)
    reader = CountingReader()
    with pytest.raises(CheckpointError, match=f"headers of more than {limit} bytes together"):
        safetensors_header.read_folder_headers(reader, tmp_path)
    assert reader.bytes_read <= limit + 40 * 8


def test_a_folder_s_tensors_are_bounded_together(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Small headers of many tensors each: the folder's tensors are counted together, each shard as it is read."""
    from handoff.checkpoint import safetensors_header

    monkeypatch.setattr(safetensors_header, "MAX_FOLDER_TENSORS", 90)
    for i in range(10):
        shard_with(tmp_path / f"model-{i:05d}.safetensors", 30)
    with pytest.raises(CheckpointError, match="more than 90 tensors together \\(at model-00003"):
        safetensors_header.read_folder_headers(FileReader(), tmp_path)
    for i in range(3, 10):
        (tmp_path / f"model-{i:05d}.safetensors").unlink()
    assert len(safetensors_header.read_folder_headers(FileReader(), tmp_path)) == 90  # at the bound: read


def longest_gil_hold(work: Callable[[], object]) -> tuple[float, object]:
    """(the longest time ``work``, run on a thread, kept this one from running, what it returned)."""
    done = threading.Event()
    outcome: list[object] = []

    def run() -> None:
        try:
            outcome.append(work())
        finally:
            done.set()

    thread = threading.Thread(target=run)
    thread.start()
    longest, last = 0.0, time.monotonic()
    while not done.wait(0.01):  # each wake needs the GIL: a gap is how long the work held it
        now = time.monotonic()
        longest, last = max(longest, now - last), now
    thread.join()
    assert outcome, "the work raised"
    return longest, outcome[0]


def test_parsing_a_header_never_holds_the_gil_for_long(tmp_path: Path) -> None:
    """A reload parses headers on a thread while the engine thread serves. A header of 16 MB (the library takes
    100) that is one string of ``e``: the scan for floats out of range, one regular expression over the whole
    header, held the GIL for seconds (the engine stopped, ``/health`` too), per shard."""
    path = write(tmp_path / "f.safetensors", b'{"__metadata__": {"k": "' + b"e" * (16 << 20) + b'"}}', 0)
    held, entries = longest_gil_hold(lambda: read_header(FileReader(), path))
    assert entries == {}
    assert held < 2.0, f"the parse held the GIL for {held:.1f} s"  # 5-7 s before; room for a busy box's scheduling


def test_reading_a_config_or_index_never_holds_the_gil_for_long(tmp_path: Path) -> None:
    """``config.json`` and the shard index (up to 64 MB each) are read on the same thread: the same scan held
    the GIL for seconds."""
    path = tmp_path / "config.json"
    path.write_bytes(b'{"k": "' + b"e" * (16 << 20) + b'"}')
    held, config = longest_gil_hold(lambda: FileReader().read_json(path))
    assert isinstance(config, dict) and len(config["k"]) == 16 << 20
    assert held < 2.0, f"the read held the GIL for {held:.1f} s"
