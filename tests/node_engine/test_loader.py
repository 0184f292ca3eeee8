"""A checkpoint the engine cannot load fails at start with a message that names the problem."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from node_engine.config import EngineConfig
from node_engine.memory.saver import DisabledSaver
from node_engine.model.arch import ModelConfigError
from node_engine.model.builtin import builtin_arch, builtin_weights, save_checkpoint
from node_engine.model.source import load_model_source
from node_engine.runner import ModelRunner


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    arch = builtin_arch("builtin:tiny", {"num_layers": 1})
    save_checkpoint(tmp_path, arch, builtin_weights(arch, seed=1))
    return tmp_path


def _load(folder: Path) -> ModelRunner:
    config = EngineConfig(model_path=str(folder))
    arch, _ = load_model_source(config)
    return ModelRunner(config, DisabledSaver(), arch)


def test_saved_builtin_folder_loads(folder: Path) -> None:
    assert _load(folder).arch.num_layers == 1


def test_unsupported_architecture(folder: Path) -> None:
    config = json.loads((folder / "config.json").read_text())
    config["architectures"] = ["MistralForCausalLM"]
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelConfigError, match="MistralForCausalLM"):
        _load(folder)


@pytest.mark.parametrize("name", ["config.json", "tokenizer.json", "tokenizer_config.json", "model.safetensors"])
def test_missing_file(folder: Path, name: str) -> None:
    (folder / name).unlink()
    with pytest.raises(ModelConfigError, match="config.json|tokenizer|safetensors"):
        _load(folder)


def test_missing_and_unexpected_keys_are_named(folder: Path) -> None:
    tensors = load_file(folder / "model.safetensors")
    tensors["model.layers.0.mlp.extra.weight"] = tensors.pop("model.layers.0.mlp.down_proj.weight")
    save_file(tensors, folder / "model.safetensors")
    with pytest.raises(ModelConfigError) as info:
        _load(folder)
    assert "model.layers.0.mlp.down_proj.weight" in str(info.value)
    assert "model.layers.0.mlp.extra.weight" in str(info.value)


def test_wrong_shape_is_named(folder: Path) -> None:
    tensors = load_file(folder / "model.safetensors")
    tensors["model.norm.weight"] = tensors["model.norm.weight"][:-1].clone()
    save_file(tensors, folder / "model.safetensors")
    with pytest.raises(ModelConfigError, match="model.norm.weight"):
        _load(folder)


def test_unknown_rope_scaling(folder: Path) -> None:
    config = json.loads((folder / "config.json").read_text())
    config["rope_scaling"] = {"rope_type": "yarn", "factor": 4.0}
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelConfigError, match="yarn"):
        _load(folder)


def test_builtin_seed_is_reproducible() -> None:
    arch = builtin_arch("builtin:tiny")
    a, b, c = builtin_weights(arch, 3), builtin_weights(arch, 3), builtin_weights(arch, 4)
    assert all((a[k] == b[k]).all() for k in a)
    assert not (a["lm_head.weight"] == c["lm_head.weight"]).all()


def _two_tensor_file(path: Path, a: float, b: float, *, a_first: bool) -> None:
    """A safetensors file of two F32 [2] tensors, ``a`` laid out first or second (the header is as long either
    way, so both files have one size)."""
    import struct

    first, second = ("a", "b") if a_first else ("b", "a")
    header = json.dumps({first: {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                         second: {"dtype": "F32", "shape": [2], "data_offsets": [8, 16]}}).encode()
    values = {"a": a, "b": b}
    path.write_bytes(struct.pack("<Q", len(header)) + header + struct.pack("<4f", *[values[first]] * 2,
                                                                         *[values[second]] * 2))


def test_a_shard_replaced_after_its_header_was_read_is_refused(tmp_path: Path) -> None:
    """A trainer that writes its next checkpoint over the folder a reload is reading (same size, another
    layout): the header's offsets no longer describe the file, and reading by them loaded b's bytes as a, with
    no error. Refused now (found by review)."""
    import os
    import time

    from node_engine.model.checkpoint_io import CheckpointError, CheckpointReader

    shard = tmp_path / "model.safetensors"
    _two_tensor_file(shard, 1.0, 2.0, a_first=True)
    an_hour_ago = time.time_ns() - 3600 * 10**9
    os.utime(shard, ns=(an_hour_ago, an_hour_ago))  # written before the reload began
    reader = CheckpointReader()
    entries = reader.header(shard)  # the reload's check
    _two_tensor_file(tmp_path / "next.tmp", 3.0, 4.0, a_first=False)
    os.replace(tmp_path / "next.tmp", shard)  # the next checkpoint, saved over it
    assert shard.stat().st_size == entries["a"].offset + 16
    with pytest.raises(CheckpointError, match="changed since its header was read"):
        dict(reader.iter_tensors(entries, ["a", "b"]))
    assert {k: t.tolist() for k, t in reader.iter_tensors(reader.header(shard), ["a", "b"])} == {
        "a": [3.0, 3.0], "b": [4.0, 4.0]}  # read again from the start, the new file is whole
