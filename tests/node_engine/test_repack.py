"""A weight update that writes a packed projection whole packs it straight from the update's tensors; the
outputs are those of the plain way (unpack, copy, pack again), which buckets and update sessions still take."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from handoff.protocol.weights import BeginWeightUpdateBody
from node_engine.config import EngineConfig
from node_engine.engine import Engine
from node_engine.memory.tags import BackupMode, MemoryTag
from node_engine.model import packing
from node_engine.runner import ModelRunner
from tests.node_engine.test_packing import PROMPT, pack_everything, tiny_runner  # noqa: F401 (an autouse fixture)
from tests.support.weights import tiny_weights

QKV = [f"model.layers.0.self_attn.{p}_proj.weight" for p in "qkv"]
DOWN = "model.layers.0.mlp.down_proj.weight"


def plain_way_logits(weights: dict[str, torch.Tensor]) -> torch.Tensor:
    """The logits after ``weights`` were written the plain way (an update session copies into plain weights)."""
    runner = tiny_runner()
    runner.weight_writer.open_session()
    runner.weight_writer.apply(weights, is_complete=set(weights) == set(runner.model.hf_weight_map()))
    runner.weight_writer.close_session()
    assert runner.packing.is_packed
    return runner.score(PROMPT)


def watch_plain_writes(runner: ModelRunner, monkeypatch: pytest.MonkeyPatch) -> list[torch.Tensor]:
    """The projections whose plain storage got memory back during the update (the plain way)."""
    unparked: list[torch.Tensor] = []
    unpack = runner.packing.unpack

    def recording_unpack(**kwargs) -> None:
        before = {id(p.weight): p.weight.untyped_storage().nbytes() for p in runner.packing.projections}
        unpack(**kwargs)
        unparked.extend(p.weight for p in runner.packing.projections
                        if before[id(p.weight)] == 0 and p.weight.untyped_storage().nbytes() > 0)

    monkeypatch.setattr(runner.packing, "unpack", recording_unpack)
    return unparked


def test_a_whole_update_packs_every_projection_straight_from_its_tensors(monkeypatch: pytest.MonkeyPatch) -> None:
    runner = tiny_runner()
    unparked = watch_plain_writes(runner, monkeypatch)
    new = tiny_weights(5)
    runner.weight_writer.apply(dict(new), is_complete=True)
    assert unparked == []  # no plain weight was given memory, copied into and parked again
    assert runner.packing.is_packed
    assert all(p.weight.untyped_storage().nbytes() == 0 for p in runner.packing.projections)
    assert torch.equal(runner.score(PROMPT), plain_way_logits(new))


def test_a_bucket_repacks_what_it_writes_whole_and_writes_a_part_of_a_projection_the_plain_way(
        monkeypatch: pytest.MonkeyPatch) -> None:
    runner = tiny_runner()
    unparked = watch_plain_writes(runner, monkeypatch)
    new = tiny_weights(5)
    bucket = {key: new[key] for key in [DOWN, "model.norm.weight", *QKV[:2]]}  # q and k without v
    runner.weight_writer.apply(dict(bucket), is_complete=False)
    qkv = runner.model.model.layers[0].self_attn.qkv
    assert [id(w) for w in unparked] == [id(qkv.weight)]
    assert runner.packing.is_packed
    expected = tiny_weights(0)
    expected.update(bucket)
    assert torch.equal(runner.score(PROMPT), plain_way_logits(expected))


def test_bf16_tensors_are_converted_as_a_plain_copy_converts_them() -> None:
    runner = tiny_runner()
    new = {key: tensor.to(torch.bfloat16) for key, tensor in tiny_weights(5).items()}
    runner.weight_writer.apply(dict(new), is_complete=True)
    assert torch.equal(runner.score(PROMPT), plain_way_logits(new))


def test_a_projection_that_cannot_be_packed_is_written_the_plain_way(monkeypatch: pytest.MonkeyPatch) -> None:
    runner = tiny_runner()
    fused_rows = runner.arch.q_size + 2 * runner.arch.kv_size
    reorder = packing._reorder
    failed = []

    def out_of_memory_once(weight: torch.Tensor, batch_hint: int) -> torch.Tensor:
        if weight.shape[0] == fused_rows and not failed:
            failed.append(weight)
            raise RuntimeError("DefaultCPUAllocator: can't allocate memory")
        return reorder(weight, batch_hint)

    monkeypatch.setattr(packing, "_reorder", out_of_memory_once)
    new = tiny_weights(5)
    runner.weight_writer.apply(dict(new), is_complete=True)
    assert failed and runner.packing.is_packed  # packed again after the plain write
    monkeypatch.setattr(packing, "_reorder", reorder)  # not undo(): that would undo pack_everything too
    assert torch.equal(runner.score(PROMPT), plain_way_logits(new))


def test_unpacked_projections_are_written_the_plain_way() -> None:
    """Weights resumed without backup are not packed (zeros): nothing to repack, the plain way writes them."""
    runner = tiny_runner()
    runner.packing.discard()
    for projection in runner.packing.projections:
        projection.weight.untyped_storage().resize_(projection.weight.numel() * projection.weight.element_size())
        projection.weight.zero_()
    new = tiny_weights(5)
    runner.weight_writer.apply(dict(new), is_complete=True)
    assert runner.packing.is_packed
    assert torch.equal(runner.score(PROMPT), plain_way_logits(new))


def test_an_unexpected_failure_leaves_every_projection_writable(monkeypatch: pytest.MonkeyPatch) -> None:
    """A failure that is not out of memory propagates (the commit marks the weights invalid), but no
    projection is left without both its packed copy and its plain memory: the next update can write it."""
    runner = tiny_runner()
    reorder = packing._reorder

    def broken(weight: torch.Tensor, batch_hint: int) -> torch.Tensor:
        raise TypeError("a bug")

    monkeypatch.setattr(packing, "_reorder", broken)
    with pytest.raises(TypeError):
        runner.weight_writer.apply(dict(tiny_weights(5)), is_complete=True)
    assert all(p.packed is not None or p.weight.untyped_storage().nbytes() > 0 for p in runner.packing.projections)
    monkeypatch.setattr(packing, "_reorder", reorder)
    new = tiny_weights(6)
    runner.weight_writer.apply(dict(new), is_complete=True)
    assert runner.packing.is_packed
    assert torch.equal(runner.score(PROMPT), plain_way_logits(new))


# -- update sessions across a release and a resume, and a session that could not open (found by review) ------

def _session_engine(tmp_path: Path, backup: BackupMode) -> Engine:
    return Engine(EngineConfig(model_path="builtin:tiny", max_total_tokens=512, enable_memory_saver=True,
                               weights_backup=backup,
                               backup_dir=None if backup is BackupMode.NONE else tmp_path / "backup"))


@pytest.mark.parametrize("backup", [BackupMode.DISK, BackupMode.NONE])
def test_a_session_ended_while_the_weights_are_released_packs_nothing_until_they_resume(
        tmp_path: Path, backup: BackupMode, caplog: pytest.LogCaptureFixture) -> None:
    """``end_weight_update`` with the weights released packed parameters that had no memory: torch refused each
    one and the engine warned that every projection stays unpacked. Now nothing is packed until the resume."""
    engine = _session_engine(tmp_path, backup)
    engine.weights.begin_session(BeginWeightUpdateBody())
    engine.control.release([MemoryTag.WEIGHTS], stage_to_cpu=None)
    with caplog.at_level(logging.WARNING, logger=packing.__name__):
        engine.weights.end_session()
    # only warnings count: another test in the same process may have let INFO lines (the load, the release) through
    assert [record.getMessage() for record in caplog.records if record.levelno >= logging.WARNING] == []
    assert all(p.packed is None and p.weight.untyped_storage().nbytes() == 0 for p in engine.runner.packing.projections)
    new = tiny_weights(5)
    engine.weights.commit(dict(new), is_complete=True, version="v1", flush_cache=True, torch_empty_cache=False)
    assert engine.memory.weights_valid and engine.runner.packing.is_packed
    assert torch.equal(engine.runner.score(PROMPT), plain_way_logits(new))


def test_a_resume_inside_a_session_leaves_the_weights_plain(tmp_path: Path) -> None:
    """Inside an update session the weights stay plain (docs/api.md): a resume there packed them again, so the
    session's next bucket unpacked (allocated and copied) what it wrote. The session's end packs them."""
    engine = _session_engine(tmp_path, BackupMode.DISK)
    expected = engine.runner.score(PROMPT).clone()
    engine.weights.begin_session(BeginWeightUpdateBody())
    engine.control.release([MemoryTag.WEIGHTS], stage_to_cpu=True)
    engine.control.resume([MemoryTag.WEIGHTS])
    projections = engine.runner.packing.projections
    assert all(p.packed is None and p.weight.untyped_storage().nbytes() > 0 for p in projections)
    assert torch.equal(engine.runner.score(PROMPT), plain_way_logits(tiny_weights(0)))
    engine.weights.end_session()
    assert engine.runner.packing.is_packed and torch.equal(engine.runner.score(PROMPT), expected)


def test_a_session_that_could_not_unpack_is_not_left_open_in_the_writer(monkeypatch: pytest.MonkeyPatch) -> None:
    """``begin_weight_update`` that ran out of memory unpacking answered an error with no session open, but the
    writer kept its session flag: every later update skipped repacking, and the weights stayed plain for good."""
    runner = tiny_runner()

    def out_of_memory(**kwargs: object) -> None:
        raise RuntimeError("DefaultCPUAllocator: can't allocate memory")

    with monkeypatch.context() as patch:
        patch.setattr(runner.packing, "unpack", out_of_memory)
        with pytest.raises(RuntimeError):
            runner.weight_writer.open_session()
    bucket = {key: tiny_weights(5)[key] for key in QKV[:1]}  # a part of a projection: unpacked, then packed again
    runner.weight_writer.apply(dict(bucket), is_complete=False)
    assert runner.packing.is_packed
