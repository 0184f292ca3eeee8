"""CPU weight packing: one copy of the weights, same outputs, and correct across release, resume and reload."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from handoff.protocol.control import UpdateWeightsFromDiskBody
from node_engine.config import EngineConfig
from node_engine.errors import BackupFailed
from node_engine.memory.saver import CpuSaver, DisabledSaver
from node_engine.memory.tags import BackupMode, MemoryTag
from node_engine.model import projection as projections
from node_engine.model.builtin import builtin_arch, builtin_weights, save_checkpoint
from node_engine.model.source import load_model_source
from node_engine.runner import ModelRunner
from node_engine.sampling import SamplingParams
from tests.node_engine.engine_harness import generate, running_engine

PROMPT = [256] + list(range(40, 120, 3))
GREEDY = SamplingParams(max_new_tokens=16, temperature=0, ignore_eos=True)
ALL_TAGS = list(MemoryTag)


@pytest.fixture(autouse=True)
def pack_everything(monkeypatch: pytest.MonkeyPatch) -> None:
    """Send every projection of the built-in model through oneDNN, so every one is packed."""
    if projections._ONEDNN_LINEAR is None:
        pytest.skip("this torch build has no oneDNN linear")
    monkeypatch.setattr(projections, "ONEDNN_MIN_WEIGHT_NUMEL", 1)


def tiny_runner(saver=None, model_override: str | None = None) -> ModelRunner:
    config = EngineConfig(model_path="builtin:tiny", max_total_tokens=512, model_override=model_override)
    arch, _ = load_model_source(config)
    return ModelRunner(config, saver or DisabledSaver(), arch)


def test_packed_model_holds_its_weights_once() -> None:
    runner = tiny_runner()
    packing = runner.packing
    # 4 per layer and the untied LM head.
    assert packing.is_packed and packing.num_projections == 4 * runner.arch.num_layers + 1
    for projection in packing.projections:
        assert projection.packed is not None
        assert projection.weight.untyped_storage().nbytes() == 0


@pytest.mark.parametrize("model_override", [None, '{"attention_bias": true}'])
def test_packed_and_plain_projections_give_the_same_logits(model_override: str | None) -> None:
    runner = tiny_runner(model_override=model_override)
    packed = runner.score(PROMPT)
    runner.packing.unpack()
    assert not runner.packing.is_packed
    assert all(p.packed is None and p.weight.untyped_storage().nbytes() > 0 for p in runner.packing.projections)
    plain = runner.score(PROMPT)
    assert (packed - plain).abs().max().item() < 1e-5
    runner.packing.pack()
    assert torch.equal(runner.score(PROMPT), packed)


def test_a_pack_that_fails_part_way_leaves_a_working_model(monkeypatch: pytest.MonkeyPatch) -> None:
    from node_engine.model import packing

    runner = tiny_runner()
    expected = runner.score(PROMPT)
    runner.packing.unpack()
    calls = []

    def fail_on_the_third(weight: torch.Tensor, batch_hint: int) -> torch.Tensor:
        calls.append(weight)
        if len(calls) == 3:
            raise MemoryError("no memory for a packed copy")
        return torch.ops.mkldnn._reorder_linear_weight(weight, batch_hint)

    monkeypatch.setattr(packing, "_reorder", fail_on_the_third)
    with pytest.raises(MemoryError):
        runner.packing.pack()
    num_packed = sum(p.packed is not None for p in runner.packing.projections)
    assert num_packed == 2 and not runner.packing.is_packed
    assert (runner.score(PROMPT) - expected).abs().max().item() < 1e-5
    monkeypatch.undo()
    runner.packing.pack()  # finishes the job
    assert runner.packing.is_packed and torch.equal(runner.score(PROMPT), expected)


def test_a_tied_lm_head_stays_unpacked() -> None:
    config = EngineConfig(model_path="builtin:tiny", max_total_tokens=512,
                          model_override='{"tie_word_embeddings": true}')
    arch, _ = load_model_source(config)
    runner = ModelRunner(config, DisabledSaver(), arch)
    assert runner.model.logits_head not in runner.packing.projections
    assert runner.model.logits_head.packed is None
    assert runner.model.model.embed_tokens.weight.untyped_storage().nbytes() > 0


def test_a_disabled_saver_refuses_a_release_without_touching_the_packing() -> None:
    from node_engine.memory.info import HostMemoryInfo
    from node_engine.memory.manager import MemoryManager
    from node_engine.memory.saver import MemorySaverDisabled

    runner = tiny_runner()
    before = runner.score(PROMPT)
    manager = MemoryManager(runner.saver, HostMemoryInfo(), BackupMode.NONE, weights_listener=runner.packing)
    with pytest.raises(MemorySaverDisabled):
        manager.release([MemoryTag.WEIGHTS], stage_to_cpu=None)
    assert runner.packing.is_packed
    assert torch.equal(runner.score(PROMPT), before)


@pytest.fixture
def checkpoint(tmp_path: Path) -> Path:
    arch = builtin_arch("builtin:tiny", {})
    save_checkpoint(tmp_path / "ckpt", arch, builtin_weights(arch, seed=0))
    return tmp_path / "ckpt"


async def test_release_with_backup_and_resume_repack_the_same_weights(tmp_path: Path, checkpoint: Path) -> None:
    config = EngineConfig(model_path="builtin:tiny", enable_memory_saver=True, weights_backup=BackupMode.DISK,
                          backup_dir=tmp_path / "backup")
    async with running_engine(config) as engine:
        assert isinstance(engine.saver, CpuSaver)
        expected, _ = await generate(engine, PROMPT, GREEDY)
        await engine.call(lambda: engine.control.release(ALL_TAGS, None))
        packing = engine.runner.packing
        assert not packing.is_packed and all(p.packed is None for p in packing.projections)
        assert all(p.weight.untyped_storage().nbytes() == 0 for p in packing.projections)
        # A reload's dry run reads shapes only: it works while the weights are released.
        assert (await engine.weights.check_disk(str(checkpoint)))["success"]
        result = await engine.call(lambda: engine.control.resume(None))
        assert result["weights_valid"] and packing.is_packed
        tokens, _ = await generate(engine, PROMPT, GREEDY)
    assert tokens == expected


async def test_release_without_backup_then_reload_packs_the_loaded_weights(checkpoint: Path) -> None:
    config = EngineConfig(model_path="builtin:tiny", enable_memory_saver=True)
    async with running_engine(config) as engine:
        expected, _ = await generate(engine, PROMPT, GREEDY)
        packing = engine.runner.packing
        await engine.call(lambda: engine.control.release([MemoryTag.WEIGHTS], None))
        result = await engine.call(lambda: engine.control.resume(None))
        assert not result["weights_valid"] and not packing.is_packed  # zeros are not worth packing
        await engine.weights.update_from_disk(UpdateWeightsFromDiskBody(model_path=str(checkpoint),
                                                                        weight_version="v1"))
        assert packing.is_packed
        assert all(p.weight.untyped_storage().nbytes() == 0 for p in packing.projections)
        tokens, _ = await generate(engine, PROMPT, GREEDY)
    assert tokens == expected


async def test_a_reload_of_other_weights_changes_the_packed_outputs(tmp_path: Path, checkpoint: Path) -> None:
    other = tmp_path / "other"
    arch = builtin_arch("builtin:tiny", {})
    save_checkpoint(other, arch, builtin_weights(arch, seed=1))
    async with running_engine(EngineConfig(model_path=str(other))) as fresh:
        expected_other, _ = await generate(fresh, PROMPT, GREEDY)
    async with running_engine(EngineConfig(model_path="builtin:tiny")) as engine:
        before, _ = await generate(engine, PROMPT, GREEDY)
        await engine.weights.update_from_disk(UpdateWeightsFromDiskBody(model_path=str(other), weight_version="v2"))
        assert engine.runner.packing.is_packed
        after, _ = await generate(engine, PROMPT, GREEDY)
    assert after != before and after == expected_other


async def test_a_failed_backup_release_leaves_the_weights_resident_and_packed(tmp_path: Path) -> None:
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("the backup cannot go under a file")
    config = EngineConfig(model_path="builtin:tiny", enable_memory_saver=True, weights_backup=BackupMode.DISK,
                          backup_dir=not_a_dir / "backup")
    async with running_engine(config) as engine:
        expected, _ = await generate(engine, PROMPT, GREEDY)
        with pytest.raises(BackupFailed) as failure:
            await engine.call(lambda: engine.control.release([MemoryTag.WEIGHTS], None))
        assert failure.value.status == 507 and failure.value.extra == {"released": []}
        assert engine.memory.released_tags() == [] and engine.runner.packing.is_packed
        tokens, _ = await generate(engine, PROMPT, GREEDY)
    assert tokens == expected


async def test_a_pack_failure_after_a_resume_degrades_to_plain_weights(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    from node_engine.model import packing

    config = EngineConfig(model_path="builtin:tiny", enable_memory_saver=True, weights_backup=BackupMode.DISK,
                          backup_dir=tmp_path / "backup")
    async with running_engine(config) as engine:
        expected, _ = await generate(engine, PROMPT, GREEDY)
        await engine.call(lambda: engine.control.release(ALL_TAGS, None))

        def out_of_memory(weight: torch.Tensor, batch_hint: int) -> torch.Tensor:
            raise RuntimeError("DefaultCPUAllocator: can't allocate memory")

        monkeypatch.setattr(packing, "_reorder", out_of_memory)
        result = await engine.call(lambda: engine.control.resume(None))
        # every tag came back; the weights are valid, only unpacked
        assert result["resumed"] == [t.value for t in ALL_TAGS] and result["weights_valid"]
        assert not any(p.packed is not None for p in engine.runner.packing.projections)
        tokens, _ = await generate(engine, PROMPT, GREEDY)
    assert tokens == expected
