"""SGLang's /weights_checker on a real in-process engine: the answers' shapes, the snapshot's host-memory bound,
what reset_tensors leaves (invalid weights), and the refusals (released weights, requests in flight)."""

from __future__ import annotations

import hashlib

import pytest
import torch

from handoff.protocol.weights import WeightsCheckerBody
from node_engine.config import EngineConfig
from node_engine.engine import Engine
from node_engine.errors import InsufficientMemory, MemoryReleased
from node_engine.memory import backup_room
from node_engine.memory.cgroup_memory import HostMemory
from node_engine.memory.tags import MemoryTag
from node_engine.weights_checker import overall_checksum
from tests.node_engine.engine_harness import running_engine

pytestmark = pytest.mark.timeout(120)

CONFIG = EngineConfig(model_path="builtin:tiny", max_total_tokens=256)


async def check(engine: Engine, **fields: object) -> tuple[int, dict]:
    body = WeightsCheckerBody.model_validate(fields)
    return await engine.call(lambda: engine.weights.checker.handle(body))


async def test_checksum_is_sglangs_single_rank_answer() -> None:
    async with running_engine(CONFIG) as engine:
        status, answer = await check(engine)
        assert status == 200
        assert list(answer) == ["success", "message", "ranks", "per_engine_checksum"]
        assert answer["success"] is True and answer["message"] == "Success."
        [rank] = answer["ranks"]
        assert list(rank) == ["checksums", "per_gpu_checksum", "parallelism_info"]
        names = [name for name, _ in engine.runner.model.named_parameters()]
        assert sorted(rank["checksums"]) == sorted(names)
        weight = dict(engine.runner.model.named_parameters())[names[0]].detach().contiguous()
        expected = hashlib.sha256(weight.reshape(-1).view(torch.uint8).numpy().tobytes()).digest()[:8]
        assert rank["checksums"][names[0]] == f"{int.from_bytes(expected, 'big'):016x}"
        assert rank["per_gpu_checksum"] == overall_checksum(rank["checksums"])
        assert answer["per_engine_checksum"] == hashlib.sha256(rank["per_gpu_checksum"].encode()).hexdigest()
        assert rank["parallelism_info"] == [{"role": "target", "tp_rank": 0, "tp_size": 1, "dp_rank": 0,
                                             "dp_size": 1, "pp_rank": 0, "pp_size": 1, "rank": 0, "size": 1}]
        status, skipped = await check(engine, skip_tensor_list=["layers.0."])
        assert not any("layers.0." in name for name in skipped["ranks"][0]["checksums"])
        # a draft selector selects no model here: SGLang does nothing and says so
        assert await check(engine, selector="draft", action="bogus") == (200, {"success": True,
                                                                                "message": "Success."})


async def test_snapshot_reset_compare_and_the_invalid_weights_in_between() -> None:
    async with running_engine(CONFIG) as engine:
        assert await check(engine, action="compare") == (400, {
            "success": False,
            "message": "no snapshot to compare with: call /weights_checker with action 'snapshot' first"})
        assert await check(engine, action="snapshot") == (200, {"success": True, "message": "Success."})
        original = {n: p.detach().clone() for n, p in engine.runner.model.named_parameters()}
        assert await check(engine, action="reset_tensors", skip_tensor_list=["embed_tokens"]) == (200, {
            "success": True, "message": "Success."})
        assert engine.memory.weights_valid is False  # garbage until an update: generation is refused
        params = dict(engine.runner.model.named_parameters())
        assert torch.equal(params["model.embed_tokens.weight"], original["model.embed_tokens.weight"])
        assert not torch.equal(params["lm_head_weight"], original["lm_head_weight"])
        status, answer = await check(engine, action="compare")
        assert status == 400 and answer["success"] is False
        assert answer["message"].startswith("check tensor equality failed:\nname=")
        assert "name=lm_head_weight max_abs_err=" in answer["message"]
        assert "expect=raw(shape=(320, 128) dtype=torch.float32)" in answer["message"]
        assert "embed_tokens" not in answer["message"]
        assert engine.weights.checker.has_snapshot  # a failed compare keeps it

        def restore() -> None:
            with torch.no_grad():
                for name, tensor in original.items():
                    params[name].copy_(tensor)
        await engine.call(restore)
        assert await check(engine, action="compare") == (200, {"success": True, "message": "Success."})
        assert not engine.weights.checker.has_snapshot  # a match drops it


async def test_a_snapshot_past_the_host_memory_is_refused_and_keeps_the_previous_one(monkeypatch) -> None:
    async with running_engine(CONFIG) as engine:
        await check(engine, action="snapshot")
        monkeypatch.setattr(backup_room, "host_memory", lambda root: HostMemory(1024, 1 << 30, True))
        with pytest.raises(InsufficientMemory, match="weights_checker snapshot needs .* within the container"):
            await check(engine, action="snapshot")
        assert engine.weights.checker.has_snapshot
        assert (await check(engine, action="compare"))[0] == 200


async def test_bad_action_and_released_weights_and_a_release_after_a_checksum() -> None:
    async with running_engine(EngineConfig(model_path="builtin:tiny", max_total_tokens=256,
                                           enable_memory_saver=True)) as engine:
        assert await check(engine, action="bogus") == (400, {"success": False,
                                                             "message": "Unsupported action='bogus'"})
        assert (await check(engine, action="checksum"))[0] == 200  # leaves the weights releasable
        await engine.call(lambda: engine.control.release([MemoryTag.WEIGHTS], None))
        with pytest.raises(MemoryReleased, match="the weights are released"):
            await check(engine, action="checksum")
