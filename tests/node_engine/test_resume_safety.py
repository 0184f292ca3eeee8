"""A release that cannot keep its backup is refused before it starts; a resumed KV pool never feeds NaN into
attention (issue 18, items 3 and 5), on real CPU engines."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from handoff.protocol import errors as E
from handoff.protocol.weights import UpdateWeightsFromTensorBody
from handoff.weight_sync import serialize_named_tensors
from node_engine import engine as engine_module
from node_engine.config import EngineConfig
from node_engine.detokenizer import IncrementalDetokenizer
from node_engine.engine import Engine
from node_engine.errors import BackupFailed, InsufficientMemory
from node_engine.memory.saver import CpuSaver
from node_engine.memory.tags import ALL_TAGS, BackupMode, MemoryTag
from node_engine.request import Request
from node_engine.sampling import SamplingParams
from node_engine.step import StepKind
from tests.node_engine.engine_harness import running_engine
from tests.support.weights import tiny_weights

GREEDY = SamplingParams(max_new_tokens=8, temperature=0, ignore_eos=True)
# Different lengths: decode steps are ragged, so attention reads (and masks) slots past the shorter sequences.
PROMPTS = [[256] + [(7 * n + 3 * i) % 256 for i in range(length)] for n, length in enumerate((4, 11, 30))]


def generate_together(engine: Engine, prompts: list[list[int]]) -> list[list[int]]:
    scheduler, runner = engine.scheduler, engine.runner
    requests = [Request(rid=f"r{n}", prompt_ids=p, params=GREEDY, on_output=lambda _: None,
                        detokenizer=IncrementalDetokenizer(engine.tokenizer)) for n, p in enumerate(prompts)]
    for request in requests:
        scheduler.add(request)
    num_ragged = 0
    while scheduler.has_work:
        step = scheduler.schedule()
        assert step is not None
        num_ragged += step.kind is StepKind.DECODE and len({e.start for e in step.entries}) > 1
        scheduler.postprocess(step, runner.run(step))
    assert num_ragged, "no ragged decode step: nothing masked was read"
    return [r.output_ids for r in requests]


class UndefinedPagesSaver(CpuSaver):
    """The CPU backend, but a tag resumed without a backup holds NaN, as fresh device pages may."""

    resumes_zeroed = False

    def resume(self, tag: MemoryTag) -> int:
        num_bytes = super().resume(tag)
        if tag is MemoryTag.KV_CACHE:
            for storage, _ in self._storages[tag]:
                torch.empty(0, dtype=torch.float32).set_(storage).fill_(float("nan"))
        return num_bytes


@pytest.fixture
def nan_engine(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Engine:
    monkeypatch.setattr(engine_module, "make_saver", lambda config: UndefinedPagesSaver(tmp_path / "backup"))
    return Engine(EngineConfig(model_path="builtin:tiny", max_total_tokens=1024, enable_memory_saver=True))


def cycle_kv(engine: Engine) -> None:
    engine.control.release([MemoryTag.KV_CACHE], stage_to_cpu=None)
    engine.control.resume([MemoryTag.KV_CACHE])


def test_a_resumed_kv_pool_holds_zeros_not_whatever_the_pages_held(nan_engine: Engine) -> None:
    before = generate_together(nan_engine, PROMPTS)
    cycle_kv(nan_engine)
    assert int(torch.isnan(nan_engine.runner.kv_cache).sum()) == 0
    assert generate_together(nan_engine, PROMPTS) == before


def test_without_the_zeroing_masked_slots_poison_the_output(nan_engine: Engine,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """The test above bites: masked slots are read, and NaN there ruins the answer."""
    before = generate_together(nan_engine, PROMPTS)
    monkeypatch.setattr(nan_engine.runner, "reset_kv_cache", lambda: None)
    cycle_kv(nan_engine)
    assert generate_together(nan_engine, PROMPTS) != before


def test_a_backup_with_nowhere_to_go_is_507_before_anything_is_released(tmp_path: Path) -> None:
    backup_dir = tmp_path / "backup"
    engine = Engine(EngineConfig(model_path="builtin:tiny", max_total_tokens=1024, enable_memory_saver=True,
                                 weights_backup=BackupMode.DISK, backup_dir=backup_dir))
    before = generate_together(engine, PROMPTS)
    backup_dir.mkdir(parents=True, exist_ok=True)
    backup_dir.rmdir()
    backup_dir.write_text("a file where the backup directory was")
    with pytest.raises(BackupFailed) as refused:
        engine.control.release(None, stage_to_cpu=None)
    assert refused.value.status == E.BACKUP_FAILED.status == 507
    assert "cannot take a file" in refused.value.message
    assert engine.memory.released_tags() == [] and engine.memory.weights_valid
    assert generate_together(engine, PROMPTS) == before
    backup_dir.unlink()
    engine.control.release(None, stage_to_cpu=None)  # room again: the same call works
    assert engine.memory.released_tags() == list(ALL_TAGS)
    engine.control.resume(None)
    assert generate_together(engine, PROMPTS) == before


# -- a weights backup that cannot be read back (found by review) ------------------------------------------

_W = [MemoryTag.WEIGHTS]
_PROMPT = [256] + list(range(40, 120, 3))
_Q = "model.layers.0.self_attn.q_proj.weight"


def _backed_up(folder: Path, backup: BackupMode = BackupMode.DISK) -> EngineConfig:
    return EngineConfig(model_path="builtin:tiny", max_total_tokens=512, enable_memory_saver=True,
                        weights_backup=backup, backup_dir=folder)


async def _score(engine: Engine) -> torch.Tensor:
    return await engine.call(lambda: engine.runner.score(_PROMPT).clone())


async def _push(engine: Engine, named: list[tuple[str, torch.Tensor]]) -> dict:
    body = UpdateWeightsFromTensorBody(serialized_named_tensors=[serialize_named_tensors(named)])
    return await engine.weights.update_from_tensor(body)


async def test_a_backup_that_cannot_be_read_leaves_the_weights_released_and_the_backup_kept(tmp_path: Path) -> None:
    """A backup file cut short made the resume fail part way: the backup was forgotten and its other files
    deleted, and the next resume filled the weights with zeros and called them valid (greedy outputs off,
    logits 4.2 away). Now the failed resume changes nothing and says so (507); a repaired file resumes."""

    async with running_engine(_backed_up(tmp_path)) as engine:
        before = await _score(engine)
        await engine.call(lambda: engine.control.release(_W, True))
        victim = sorted((engine.saver.backup_folder.path / "weights").iterdir())[5]
        whole = victim.read_bytes()
        victim.write_bytes(whole[:10])
        for _ in range(2):
            with pytest.raises(BackupFailed) as info:
                await engine.call(lambda: engine.control.resume(_W))
            assert info.value.kind is E.BACKUP_FAILED and "stay released" in str(info.value)
            assert engine.memory.released_tags() == [MemoryTag.WEIGHTS]
        victim.write_bytes(whole)
        answer = await engine.call(lambda: engine.control.resume(_W))
        assert answer["weights_valid"] and torch.equal(await _score(engine), before)


async def test_an_update_resumes_past_a_lost_backup_and_counts_every_weight(tmp_path: Path) -> None:
    """A weight update resumes the weights first: past a backup that is gone it resumes without it, and the
    weights are invalid until every one is written (a one-tensor bucket over zeros answered valid)."""

    new = tiny_weights(5)
    async with running_engine(_backed_up(tmp_path)) as engine:
        await engine.call(lambda: engine.control.release(_W, True))
        sorted((engine.saver.backup_folder.path / "weights").iterdir())[3].unlink()
        assert not (await _push(engine, [(_Q, new[_Q])]))["weights_valid"]
        assert (await _push(engine, [(k, v) for k, v in new.items() if k != _Q]))["weights_valid"]


async def test_weights_written_before_a_backed_up_release_still_count_after_it(tmp_path: Path) -> None:
    """Weights resumed without a backup become valid once every weight is written: writes made before a
    release that kept a backup were forgotten by its resume."""

    items = list(tiny_weights(5).items())
    async with running_engine(_backed_up(tmp_path, BackupMode.CPU)) as engine:
        await engine.call(lambda: engine.control.release(_W, False))
        await engine.call(lambda: engine.control.resume(_W))
        assert not (await _push(engine, items[:10]))["weights_valid"]
        await engine.call(lambda: engine.control.release(_W, True))
        await engine.call(lambda: engine.control.resume(_W))
        assert (await _push(engine, items[10:]))["weights_valid"]


class FailsOnceSaver(CpuSaver):
    """The CPU backend, but the resume of ``fail_next`` raises once, as a storage that cannot get its memory
    back does (``resize_`` out of host memory, a CUDA map out of device memory)."""

    fail_next: MemoryTag | None = None
    refused_by_allocator = False  # raise what torch's CPU allocator raises when the host refuses the memory
    refused_with: str | None = None  # raise a plain RuntimeError with this text

    def resume(self, tag: MemoryTag) -> int:
        if tag is self.fail_next:
            self.fail_next = None
            if self.refused_by_allocator:
                torch.empty(1 << 62, dtype=torch.uint8)  # "DefaultCPUAllocator: can't allocate memory"
            raise RuntimeError(self.refused_with or f"cannot allocate the {tag.value} storages (simulated)")
        return super().resume(tag)


def test_a_resume_that_fails_after_the_kv_pool_came_back_still_forgets_the_cached_prefixes(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A resume of kv_cache and workspace failed at the workspace, after the KV pool came back (zeroed): the
    scheduler kept its slots and the prefix cache its entries, and the retried resume found kv_cache already
    resident and reset nothing, so a repeated prompt reused cached prefixes that were zeros (outputs off)."""
    saver = FailsOnceSaver(tmp_path / "backup")
    monkeypatch.setattr(engine_module, "make_saver", lambda config: saver)
    engine = Engine(EngineConfig(model_path="builtin:tiny", max_total_tokens=1024, enable_memory_saver=True))
    expected = generate_together(engine, PROMPTS)
    assert engine.scheduler.cache is not None and engine.scheduler.cache.num_cached_tokens
    tags = [MemoryTag.KV_CACHE, MemoryTag.WORKSPACE]
    engine.control.release(tags, stage_to_cpu=None)
    saver.fail_next = MemoryTag.WORKSPACE
    with pytest.raises(RuntimeError, match="simulated"):
        engine.control.resume(tags)
    assert engine.memory.released_tags() == [MemoryTag.WORKSPACE]
    engine.control.resume(tags)
    slots = engine.scheduler.slots
    assert engine.scheduler.cache.num_cached_tokens == 0 and slots.num_free == slots.capacity
    assert generate_together(engine, PROMPTS) == expected


def test_a_resume_the_allocator_refuses_is_a_507_naming_what_stays_released(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The room is checked before a resume, but the allocator may still refuse (strict overcommit, another
    process took the memory meanwhile): that was a 500 ``internal_error`` (found by review). Now a 507
    ``insufficient_memory`` naming the tags still released; the tags resumed before it stay resident, and a
    later resume brings the rest back with the same outputs."""
    saver = FailsOnceSaver(tmp_path / "backup")
    monkeypatch.setattr(engine_module, "make_saver", lambda config: saver)
    engine = Engine(EngineConfig(model_path="builtin:tiny", max_total_tokens=1024, enable_memory_saver=True))
    expected = generate_together(engine, PROMPTS)
    tags = [MemoryTag.KV_CACHE, MemoryTag.WORKSPACE]
    engine.control.release(tags, stage_to_cpu=None)
    saver.fail_next, saver.refused_by_allocator = MemoryTag.WORKSPACE, True
    with pytest.raises(InsufficientMemory) as refused:
        engine.control.resume(tags)
    assert (refused.value.status, refused.value.type) == (507, E.INSUFFICIENT_MEMORY.name)
    assert refused.value.extra["released"] == ["workspace"] and "can't allocate memory" in refused.value.message
    assert engine.memory.released_tags() == [MemoryTag.WORKSPACE]
    saver.fail_next = MemoryTag.WORKSPACE  # anything else the saver raises is a bug, not a 507: it stays raised
    saver.refused_by_allocator = False
    with pytest.raises(RuntimeError, match="simulated"):
        engine.control.resume(tags)
    engine.control.resume(tags)
    assert generate_together(engine, PROMPTS) == expected


@pytest.mark.parametrize("text", [
    "CUDA error: out of memory\nCUDA kernel errors might be asynchronously reported at some other API call",
    "CUDA out of memory. Tried to allocate 2.00 GiB",
])
def test_a_resume_cuda_refuses_as_a_plain_runtime_error_is_a_507(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, text: str) -> None:
    """A pinned-host or device allocation CUDA refuses can come as a plain RuntimeError with CUDA's text (not
    torch's OutOfMemoryError): that was a 500 ``internal_error``. Now a 507 like the CPU allocator's refusal."""
    saver = FailsOnceSaver(tmp_path / "backup")
    monkeypatch.setattr(engine_module, "make_saver", lambda config: saver)
    engine = Engine(EngineConfig(model_path="builtin:tiny", max_total_tokens=1024, enable_memory_saver=True))
    tags = [MemoryTag.KV_CACHE, MemoryTag.WORKSPACE]
    engine.control.release(tags, stage_to_cpu=None)
    saver.fail_next, saver.refused_with = MemoryTag.WORKSPACE, text
    with pytest.raises(InsufficientMemory) as refused:
        engine.control.resume(tags)
    assert (refused.value.status, refused.value.extra["released"]) == (507, ["workspace"])
    assert text.splitlines()[0] in refused.value.message
    saver.fail_next, saver.refused_with = MemoryTag.WORKSPACE, "CUDA error: an illegal memory access was encountered"
    with pytest.raises(RuntimeError, match="illegal memory access"):  # any other CUDA error stays a 500
        engine.control.resume(tags)
    engine.control.resume(tags)
    assert engine.memory.released_tags() == []
