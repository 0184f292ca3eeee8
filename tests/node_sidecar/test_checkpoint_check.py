"""The sidecar's checkpoint check: safetensors headers read against the safetensors library, hostile folders refused.

Before a vLLM or SGLang node loads a checkpoint the sidecar reads its
safetensors headers itself (``node_sidecar/engines/checkpoint.py``). What it
reads is compared with what the ``safetensors`` library reads from the same
files (random names, shapes and dtypes), and anything malformed is one clear
400, never an exception.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.torch import save_file

from handoff.service.errors import InvalidRequest
from node_sidecar.engines.checkpoint import check_compatible, read_checkpoint

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.int8, torch.int64, torch.bool]
CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 320, "hidden_size": 8,
          "intermediate_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
          "head_dim": 4, "tie_word_embeddings": False}

tensors_strategy = st.dictionaries(
    keys=st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789._", min_size=1, max_size=40).filter(
        lambda name: name != "__metadata__"),  # the format's reserved key
    values=st.tuples(st.lists(st.integers(0, 5), min_size=0, max_size=4), st.sampled_from(DTYPES)),
    min_size=1, max_size=12)


def write(folder: Path, tensors: dict[str, torch.Tensor], config: dict | None = None) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config or CONFIG))
    save_file(tensors, str(folder / "model.safetensors"))
    return folder


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(spec=tensors_strategy)
def test_shapes_read_as_the_safetensors_library_reads_them(tmp_path: Path, spec: dict) -> None:
    folder = tmp_path / f"c{abs(hash(tuple(spec))) % 10**9}"
    write(folder, {name: torch.zeros(shape, dtype=dtype) for name, (shape, dtype) in spec.items()})
    ours = read_checkpoint(str(folder)).tensors
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        theirs = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}
    assert ours == theirs


def test_sharded_checkpoints_and_what_must_match(tmp_path: Path) -> None:
    from node_engine.model.builtin import builtin_arch, builtin_weights, save_checkpoint

    arch = builtin_arch("builtin:tiny")
    save_checkpoint(tmp_path / "whole", arch, builtin_weights(arch, 0))
    save_checkpoint(tmp_path / "shards", arch, builtin_weights(arch, 1), max_shard_bytes=200_000)
    assert len(list((tmp_path / "shards").glob("*.safetensors"))) > 3
    whole, shards = read_checkpoint(str(tmp_path / "whole")), read_checkpoint(str(tmp_path / "shards"))
    assert whole.tensors == shards.tensors and whole.config == shards.config
    check_compatible(shards, whole)
    narrow = builtin_arch("builtin:tiny", {"intermediate_size": 128})
    save_checkpoint(tmp_path / "narrow", narrow, builtin_weights(narrow, 0))
    with pytest.raises(InvalidRequest, match="intermediate_size"):
        check_compatible(read_checkpoint(str(tmp_path / "narrow")), whole)
    renamed = {k.replace("layers.3", "layers.9"): v for k, v in builtin_weights(arch, 0).items()}
    save_checkpoint(tmp_path / "renamed", arch, renamed)
    with pytest.raises(InvalidRequest, match="missing .*layers.3"):
        check_compatible(read_checkpoint(str(tmp_path / "renamed")), whole)


def header_file(folder: Path, header: bytes, declared: int | None = None) -> Path:
    """A folder with a config and one safetensors file holding only ``header`` (its length ``declared``)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(CONFIG))
    length = len(header) if declared is None else declared
    (folder / "model.safetensors").write_bytes(struct.pack("<Q", length) + header)
    return folder


def with_file(name: str, content: bytes | str, header: bytes | None = None):
    """A builder: a folder holding ``name`` (and a safetensors file with ``header``, if given)."""
    def build(folder: Path) -> Path:
        folder.mkdir(parents=True)
        if header is not None:
            header_file(folder, header)  # then ``name`` is written over it, when it is the same file
        path = folder / name
        path.write_bytes(content) if isinstance(content, bytes) else path.write_text(content)
        return folder
    return build


def sparse_file(name: str, num_bytes: int):
    def build(folder: Path) -> Path:
        folder.mkdir(parents=True)
        with open(folder / name, "wb") as f:
            f.truncate(num_bytes)
        return folder
    return build


@pytest.mark.parametrize("build, message", [
    (lambda d: d / "nope", "not a folder"),
    (with_file("other.txt", "x"), "config.json"),
    (with_file("config.json", "{}"), r"no \*.safetensors"),
    (with_file("config.json", "{"), "not valid JSON"),
    (sparse_file("config.json", 65 << 20), "at most"),
    (lambda d: with_file("model.safetensors", b"\x01", header=b"{}")(d), "too short to be a safetensors"),
    (lambda d: header_file(d, b"{}", declared=1 << 40), "header length"),
    (lambda d: header_file(d, b"{not json"), "not valid JSON"),
    (lambda d: header_file(d, b"[" * 100_000 + b"]" * 100_000), "more than 127 deep"),
    (lambda d: header_file(d, b"[1, 2]"), "not a JSON object"),
    (lambda d: header_file(d, b'{"w": {"dtype": "F32", "shape": ["x"], "data_offsets": [0, 0]}}'), "malformed shape"),
    (with_file("model.safetensors.index.json", json.dumps({"weight_map": {"w": "../elsewhere.safetensors"}}), b"{}"),
     "file names in the folder"),
    (with_file("model.safetensors.index.json", "[]", b"{}"), "not a valid safetensors index"),
], ids=["missing", "no config", "no weights", "config not json", "config too big", "short file", "huge header",
        "header not json", "deep header", "header not an object", "bad shape", "index outside", "index without map"])
def test_malformed_folders_are_one_clear_400(tmp_path: Path, build, message: str) -> None:
    with pytest.raises(InvalidRequest, match=message):
        read_checkpoint(str(build(tmp_path / "ckpt")))


def test_a_check_that_hangs_is_a_504_after_its_deadline(monkeypatch: pytest.MonkeyPatch) -> None:
    """A folder on a hung mount (stood in for by a read that blocks) costs the check's deadline, not the request."""
    import asyncio
    import threading
    import types

    from handoff.service.errors import ServiceError
    from node_sidecar.engines import foreign
    from node_sidecar.engines.sglang import SglangEngine

    release = threading.Event()
    monkeypatch.setattr(foreign, "read_checkpoint", lambda path: release.wait(30))
    monkeypatch.setattr(foreign, "CHECK_TIMEOUT_S", 0.2)
    adapter = SglangEngine(types.SimpleNamespace(base_url="http://127.0.0.1:9"))
    try:
        with pytest.raises(ServiceError) as refused:
            asyncio.run(asyncio.wait_for(adapter.check_checkpoint("/hung/ckpt"), 10))
    finally:
        release.set()
    assert refused.value.status == 504 and refused.value.type == "checkpoint_timeout"
    assert "hung storage" in refused.value.message


def test_a_served_checkpoint_on_hung_storage_does_not_block_a_reload_off_it(monkeypatch: pytest.MonkeyPatch,
                                                                          tmp_path: Path) -> None:
    """The folder the engine serves is on a mount that hung; a reload to a healthy folder is the way off it. The
    check read the served folder as well (to compare shapes), so every reload was a 504 ``checkpoint_timeout``
    naming the served folder, and once four reads of it were stuck, the healthy folder's check was refused at
    once too (``TooManyStuck``): no reload could pass (found by review). Nothing to compare with is what a
    served checkpoint that cannot be read already means."""
    import asyncio
    import threading
    import types

    from node_sidecar.engines import foreign
    from node_sidecar.engines.sglang import SglangEngine

    release = threading.Event()
    healthy = write(tmp_path / "next", {"w": torch.zeros(2)})
    read = foreign.read_checkpoint

    def read_or_hang(path: str):
        if path == "/hung/served":
            release.wait(30)
        return read(path)

    monkeypatch.setattr(foreign, "read_checkpoint", read_or_hang)
    monkeypatch.setattr(foreign, "CHECK_TIMEOUT_S", 0.2)
    adapter = SglangEngine(types.SimpleNamespace(base_url="http://127.0.0.1:9"))
    adapter.model_path = "/hung/served"
    try:
        for _ in range(6):  # more reloads than stuck reads are allowed
            asyncio.run(asyncio.wait_for(adapter.check_checkpoint(str(healthy)), 10))
        with pytest.raises(InvalidRequest, match="not a folder"):  # the new folder is still checked
            asyncio.run(asyncio.wait_for(adapter.check_checkpoint(str(tmp_path / "nope")), 10))
    finally:
        release.set()


def test_what_a_checkpoint_holds_is_cut_in_messages(tmp_path: Path) -> None:
    """A header's tensor name, a shape and a config value are the file's to choose: a 5 MB tensor name with an
    unknown dtype was a 5 MB 400 (and log line), a tensor the served model lacks or a config value likewise. They
    are cut as a long path already was (found by review)."""
    from node_sidecar.engines.checkpoint import CheckpointShape

    name = "w" * 5_000_000
    header = json.dumps({name: {"dtype": "X", "shape": [1] * 100_000, "data_offsets": [0, 4]}}).encode()
    folder = with_file("config.json", json.dumps(CONFIG), header=header)(tmp_path / "ckpt")
    with pytest.raises(InvalidRequest, match="unknown dtype") as refused:
        read_checkpoint(str(folder))
    assert len(refused.value.message) < 2000
    served = CheckpointShape("/served", dict(CONFIG), {"w": (2,)})
    for new in (CheckpointShape("/new", {**CONFIG, "model_type": "x" * 5_000_000}, {"w": (2,)}),
                CheckpointShape("/new", dict(CONFIG), {"w": (2,), name: (1,)}),
                CheckpointShape("/new", dict(CONFIG), {"w": (1,) * 5_000_000})):
        with pytest.raises(InvalidRequest) as refused:
            check_compatible(new, served)
        assert len(refused.value.message) < 2000
