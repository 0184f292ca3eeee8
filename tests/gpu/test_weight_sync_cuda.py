"""Weight sync into a CUDA engine (issue 15 on a real GPU): ``update_weights_from_tensor`` with CUDA IPC handles
in each form verl and slime send (torch's reduction and SGLang's patched one, which names the device by UUID;
per tensor and ``flattened_bucket``), into released weights, and a gloo broadcast from a trainer process.

Every push is judged against the same weights loaded from a checkpoint by the same engine: greedy tokens equal.
The trainer is this test process, on the same GPU, as in a colocated RL job. Skipped without CUDA
(tests/conftest.py) or torch_memory_saver.
"""

from __future__ import annotations

import gc
from pathlib import Path
from typing import Iterator

import httpx
import pytest
import torch

from handoff.weight_sync import serialize_named_tensors
from node_engine.model.builtin import builtin_arch, builtin_weights, save_checkpoint
from tests.gpu.engines import MODEL, MiB, GpuEngine, free_gpu_bytes, require_memory_saver, started
from tests.support.sglang_payloads import flattened_payload, verl_payload
from tests.support.trainer import Trainer
from tests.support.weights import packed_sample, save_packed_safetensors

pytestmark = [pytest.mark.gpu, pytest.mark.slow, pytest.mark.timeout(900)]

SEEDS = (0, 9)  # 0: the engine's own weights
Named = list[tuple[str, torch.Tensor]]
# What repeated pushes may leave held on the device: each push shares 1 GiB that the engine must let go of.
MAX_HELD_AFTER_PUSHES = 256 * MiB


@pytest.fixture(scope="module")
def weights() -> dict[int, dict[str, torch.Tensor]]:
    """Each seed's float32 weights on the host."""
    arch = builtin_arch("builtin:tiny", MODEL)
    return {seed: builtin_weights(arch, seed=seed) for seed in SEEDS}


@pytest.fixture(scope="module")
def on_gpu(weights: dict[int, dict[str, torch.Tensor]]) -> dict[int, Named]:
    """Each seed's weights in bf16 on this process's GPU, as a colocated trainer holds them."""
    return {seed: [(name, t.to("cuda", torch.bfloat16)) for name, t in named.items()]
            for seed, named in weights.items()}


@pytest.fixture(scope="module")
def engine(proc_log_dir: Path) -> Iterator[GpuEngine]:
    require_memory_saver()
    with started(proc_log_dir, "gpu_weight_sync", "--enable-memory-saver", "--weights-backup", "cpu",
                 "--mem-fraction", "0.5") as engine:
        yield engine


@pytest.fixture(scope="module")
def expected(engine: GpuEngine, weights: dict[int, dict[str, torch.Tensor]],
             tmp_path_factory: pytest.TempPathFactory) -> dict[int, list[list[int]]]:
    """Each seed's greedy tokens with its weights reloaded from a checkpoint (float32, as the engine's own, which
    it casts to bf16 as it loads); ends on seed 0."""
    arch = builtin_arch("builtin:tiny", MODEL)
    answers = {}
    for seed in reversed(SEEDS):
        folder = tmp_path_factory.mktemp(f"seed{seed}")
        save_checkpoint(folder, arch, weights[seed])
        r = engine.client.post("/update_weights_from_disk", json={"model_path": str(folder)})
        assert r.status_code == 200, r.text
        answers[seed] = engine.greedy()
    assert answers[0] != answers[9]
    return answers


def push(engine: GpuEngine, payload: str, **fields: object) -> httpx.Response:
    return engine.client.post("/update_weights_from_tensor", json={"serialized_named_tensors": [payload], **fields})


def payload_of(form: str, named: Named) -> tuple[str, object]:
    """The payload in ``form``, and what must stay alive until the engine answered."""
    if form == "direct":
        return serialize_named_tensors(named), named
    if form.startswith("verl"):
        return verl_payload(named, patched_cuda=form == "verl_patched"), named
    payload, buffer = flattened_payload(named, patched_cuda=form == "flattened_patched")
    return payload, buffer


@pytest.mark.parametrize("form", ["direct", "verl", "verl_patched", "flattened", "flattened_patched"])
def test_a_cuda_ipc_push_serves_like_the_checkpoint(engine: GpuEngine, on_gpu: dict[int, Named],
                                                   expected: dict[int, list[list[int]]], form: str) -> None:
    for seed in (9, 0):
        payload, keep = payload_of(form, on_gpu[seed])
        fields = {"load_format": "flattened_bucket"} if form.startswith("flattened") else {}
        r = push(engine, payload, weight_version=f"{form}-{seed}", **fields)
        assert r.status_code == 200, r.text
        assert r.json()["weights_valid"] is True
        del keep
        assert engine.greedy() == expected[seed], (form, seed)


def test_a_push_into_released_weights_takes_them_back_first(engine: GpuEngine, on_gpu: dict[int, Named],
                                                            expected: dict[int, list[list[int]]]) -> None:
    engine.release(["weights"])
    r = push(engine, serialize_named_tensors(on_gpu[9]))
    assert r.status_code == 200, r.text
    assert engine.occupation()["tags"]["weights"]["state"] == "resident"
    assert engine.greedy() == expected[9]
    assert push(engine, serialize_named_tensors(on_gpu[0])).status_code == 200
    assert engine.greedy() == expected[0]


def test_a_wrong_shape_is_refused_and_the_old_weights_serve(engine: GpuEngine, on_gpu: dict[int, Named],
                                                            expected: dict[int, list[list[int]]]) -> None:
    name = on_gpu[9][0][0]
    wrong = torch.zeros(3, device="cuda", dtype=torch.bfloat16)
    r = push(engine, serialize_named_tensors([*on_gpu[9][1:], (name, wrong)]))
    assert r.status_code == 400, r.text
    assert r.json()["error"]["type"] == "invalid_request"
    assert engine.greedy() == expected[0]


def test_pushed_tensors_are_let_go_of(engine: GpuEngine, on_gpu: dict[int, Named],
                                      expected: dict[int, list[list[int]]]) -> None:
    """The engine drops every opened handle after a push: the sender's memory can be freed again."""
    gc.collect()
    torch.cuda.ipc_collect()
    torch.cuda.empty_cache()
    free_before = free_gpu_bytes()
    for _ in range(4):
        fresh = [(name, t.clone()) for name, t in on_gpu[0]]  # new allocations each time, as a training step's
        assert push(engine, serialize_named_tensors(fresh)).status_code == 200
        del fresh
        gc.collect()
        torch.cuda.ipc_collect()
        torch.cuda.empty_cache()
    held = free_before - free_gpu_bytes()
    print(f"device memory held after 4 pushes of fresh tensors: {held / MiB:.1f} MiB")
    assert held < MAX_HELD_AFTER_PUSHES
    assert engine.greedy() == expected[0]


def test_a_gloo_broadcast_from_a_trainer_loads_into_the_gpu(engine: GpuEngine,
                                                            weights: dict[int, dict[str, torch.Tensor]],
                                                            expected: dict[int, list[list[int]]]) -> None:
    trainer = Trainer(engine.proc.url, world_size=2, rank_offset=1, group_name="gpu_gloo")
    joined = trainer.join(timeout_s=60)
    assert joined.status_code == 200, joined.text
    try:
        for seed in (9, 0):  # float32 on the wire; the engine converts as it copies into its bf16 weights
            r = trainer.push(list(weights[seed].items()), flush_cache=True)
            assert r.status_code == 200, r.text
            assert engine.greedy() == expected[seed], seed
    finally:
        assert trainer.leave().status_code == 200


@pytest.mark.parametrize("num_threads", [1, 4])
def test_a_read_onto_the_gpu_gives_what_is_on_disk(tmp_path: Path, num_threads: int) -> None:
    """What a reload stages on the device: every dtype and size, a tensor larger than the bounce buffer, tensors
    read in parallel slices alternating between the two buffers, an empty tensor and a scalar, each equal to the
    host read."""
    from safetensors.torch import save_file

    from node_engine.model.checkpoint_io import BOUNCE_BYTES, CheckpointReader

    gen = torch.Generator().manual_seed(5)
    tensors = {"big": torch.randn(BOUNCE_BYTES // 4 + 12345, generator=gen),
               "mid": torch.randn(5_000_001, generator=gen), "mid2": torch.randn(4_000_003, generator=gen),
               "half": torch.randn(33, 5, generator=gen).bfloat16(), "flag": torch.tensor([True, False, True]),
               "odd": torch.randint(-100, 100, (7,), dtype=torch.int8, generator=gen),
               "empty": torch.zeros(0, 4), "scalar": torch.tensor(2.5, dtype=torch.float64)}
    save_file(tensors, str(tmp_path / "model.safetensors"))
    reader = CheckpointReader()
    entries = reader.header(tmp_path / "model.safetensors")
    on_gpu = dict(reader.iter_tensors_on(torch.device("cuda", 0), entries, list(tensors), num_threads=num_threads))
    packed = packed_sample()  # back to back with no padding: a float32 tensor at an odd offset
    packed_entries = reader.header(save_packed_safetensors(tmp_path / "packed.safetensors", packed))
    on_gpu |= {f"packed.{key}": tensor for key, tensor in
               reader.iter_tensors_on(torch.device("cuda", 0), packed_entries, list(packed), num_threads=num_threads)}
    tensors |= {f"packed.{key}": tensor for key, tensor in packed.items()}
    for key, tensor in tensors.items():
        assert on_gpu[key].is_cuda and on_gpu[key].dtype == tensor.dtype and on_gpu[key].shape == tensor.shape, key
        assert torch.equal(on_gpu[key].cpu(), tensor), key
