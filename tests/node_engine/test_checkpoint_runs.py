"""A read onto a GPU reads tensors that lie back to back as one run and splits it into views: the run logic,
on CPU (the GPU read itself: ``tests/gpu/test_weight_sync_cuda.py``)."""

from __future__ import annotations

import torch

from node_engine.model import checkpoint_io
from node_engine.model.checkpoint_io import CheckpointReader
from tests.support.weights import packed_sample, save_packed_safetensors


def test_back_to_back_tensors_form_one_run_and_a_gap_splits_it(tmp_path):
    tensors = packed_sample()
    entries = CheckpointReader().header(save_packed_safetensors(tmp_path / "model.safetensors", tensors))
    keys = sorted(entries, key=lambda k: entries[k].offset)
    total = sum(entries[key].num_bytes for key in keys)
    assert list(checkpoint_io._runs(entries, keys, total)) == [keys]
    assert list(checkpoint_io._runs(entries, keys, 0)) == [[key] for key in keys]
    without = [key for key in keys if key != "bytes"]
    at = keys.index("bytes")
    assert list(checkpoint_io._runs(entries, without, total)) == [keys[:at], keys[at + 1:]]


def test_a_run_stops_at_its_cap_and_a_larger_tensor_is_a_run_of_its_own(tmp_path):
    tensors = {"a": torch.zeros(10), "b": torch.zeros(10), "big": torch.zeros(100), "c": torch.zeros(5),
               "d": torch.zeros(5)}  # float32: 40, 40, 400, 20, 20 bytes
    entries = CheckpointReader().header(save_packed_safetensors(tmp_path / "model.safetensors", tensors))
    runs = list(checkpoint_io._runs(entries, list(tensors), 80))
    assert runs == [["a", "b"], ["big"], ["c", "d"]]
    assert list(checkpoint_io._runs(entries, list(tensors), 79)) == [["a"], ["b"], ["big"], ["c", "d"]]


def test_a_run_split_into_views_equals_each_tensor_read_alone(tmp_path):
    """Every dtype at every offset, an odd one included (a float32 view must start on 4 bytes: it is copied)."""
    tensors = packed_sample()
    path = save_packed_safetensors(tmp_path / "model.safetensors", tensors)
    reader = CheckpointReader()
    entries = reader.header(path)
    keys = sorted(entries, key=lambda k: entries[k].offset)
    run = checkpoint_io._run_entry(entries, keys)
    assert run.num_bytes == sum(entries[key].num_bytes for key in keys) and entries["odd_f32"].offset % 4
    data = path.read_bytes()
    run_bytes = torch.frombuffer(bytearray(data[run.offset:run.offset + run.num_bytes]), dtype=torch.uint8)
    split = dict(checkpoint_io._views_when_copied(entries, keys, run_bytes, None))
    alone = dict(reader.iter_tensors(entries, keys))
    for key, tensor in tensors.items():
        assert split[key].dtype == tensor.dtype and split[key].shape == tensor.shape, key
        assert torch.equal(split[key], tensor) and torch.equal(alone[key], tensor), key
