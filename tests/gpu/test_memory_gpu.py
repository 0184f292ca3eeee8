"""Release and resume on a real GPU, issue 3's GPU list (SPEC section 2), with a ~0.5B-parameter model.

Engines run as processes with the torch_memory_saver backend (the engine sets up
its own LD_PRELOAD) on a random Llama built from ``builtin:tiny`` with overrides,
in float32 so that CUDA-graph and eager decode can be compared token for token.
Skipped without CUDA (tests/conftest.py) or without torch_memory_saver.

The share-freed test reads free GPU memory before the first engine starts, so it
runs first and no other engine process is alive while it measures.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Iterator

import httpx
import pytest
import torch

from node_engine.model.builtin import builtin_arch
from tests.support.procs import ServerProcess

pytestmark = [pytest.mark.gpu, pytest.mark.slow, pytest.mark.timeout(1800)]

MODEL = {"hidden_size": 1024, "intermediate_size": 4352, "num_layers": 32, "num_heads": 16, "num_kv_heads": 4,
         "head_dim": 64}
TAGS = ["weights", "kv_cache", "cuda_graph", "workspace"]
PROMPTS = [[256] + [(11 * n + 3 * i) % 256 for i in range(20 + 5 * n)] for n in range(4)]
MIN_SHARE_FREED = 0.995
MIN_STAGING_SHARE_OF_PINNED = 0.80
# Issue 3's target is 0.1 s per tag without a backup for a 1.5B model; bench/memory_cycle.py reports the figure.
# This bound only catches a release or resume that does far more work than unmapping and mapping pages.
MAX_TAG_LATENCY_S = 1.0


def engine_args(*extra: str) -> list[str]:
    return ["--model-path", "builtin:tiny", "--model-override", json.dumps(MODEL), "--device", "cuda",
            "--dtype", "float32", *extra]


def greedy(client: httpx.Client) -> list[list[int]]:
    r = client.post("/generate", json={"input_ids": PROMPTS, "sampling_params": {
        "max_new_tokens": 16, "temperature": 0, "ignore_eos": True}})
    assert r.status_code == 200, r.text
    return [item["output_ids"] for item in r.json()]


def post(client: httpx.Client, path: str, tags: list[str] | None) -> dict:
    r = client.post(path, json={"tags": tags})
    assert r.status_code == 200, r.text
    return r.json()


def free_gpu_bytes() -> int:
    torch.cuda.synchronize()
    return torch.cuda.mem_get_info()[0]


def test_model_is_at_least_half_a_billion_parameters() -> None:
    assert builtin_arch("builtin:tiny", MODEL).num_params() >= 500_000_000


@pytest.fixture(scope="module")
def saver_available() -> None:
    pytest.importorskip("torch_memory_saver", reason="needs torch_memory_saver: pip install 'handoff[gpu]'")


@pytest.fixture(scope="module")
def backup_engine(saver_available: None, proc_log_dir: Path) -> Iterator[tuple[ServerProcess, int, int]]:
    """Saver on, CPU weights backup, CUDA graphs on; with free GPU bytes before and after it started."""
    torch.cuda.init()
    free_before = free_gpu_bytes()  # after this process's own CUDA context exists
    proc = ServerProcess("node_engine", engine_args("--enable-memory-saver", "--weights-backup", "cpu"),
                         log_dir=proc_log_dir, name="gpu_backup_engine").start(timeout=900)
    free_started = free_gpu_bytes()
    yield proc, free_before, free_started
    proc.stop(timeout=60)


@pytest.fixture
def backup_client(backup_engine: tuple[ServerProcess, int, int]) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=backup_engine[0].url, timeout=900) as client:
        yield client
        # every test leaves the engine resident and serving
        post(client, "/resume_memory_occupation", None)


def test_releasing_all_tags_frees_the_engine_footprint(backup_engine, backup_client) -> None:
    _, free_before, free_started = backup_engine
    footprint = free_before - free_started
    body = post(backup_client, "/release_memory_occupation", None)
    assert body["released"] == TAGS
    freed = free_gpu_bytes() - free_started
    share = freed / footprint
    print(f"footprint {footprint / 2**30:.2f} GiB, freed {freed / 2**30:.2f} GiB = {100 * share:.3f}%")
    assert share >= MIN_SHARE_FREED, (footprint, freed)
    post(backup_client, "/resume_memory_occupation", None)
    # Resumed: the engine holds its footprint again (less the allocator cache the release emptied).
    assert free_gpu_bytes() - free_started < 0.01 * footprint


def test_greedy_output_is_identical_after_a_cycle_with_cpu_backup(backup_client) -> None:
    before = greedy(backup_client)
    post(backup_client, "/release_memory_occupation", None)
    resumed = post(backup_client, "/resume_memory_occupation", None)
    assert resumed["weights_valid"] is True
    assert greedy(backup_client) == before


def test_weight_staging_is_as_fast_as_a_pinned_copy(backup_client) -> None:
    weights_bytes = backup_client.get("/memory_occupation").json()["tags"]["weights"]["bytes"]
    assert weights_bytes >= 4 * 500_000_000  # float32 weights of a 0.5B model
    stage_out, stage_in, pinned_out, pinned_in = [], [], [], []
    for _ in range(3):
        stage_out.append(post(backup_client, "/release_memory_occupation", ["weights"])["duration_s"])
        # The baseline runs while the weights are released, in the room they left.
        device = torch.empty(weights_bytes, dtype=torch.uint8, device="cuda")
        host = torch.empty(weights_bytes, dtype=torch.uint8, pin_memory=True)
        for copies, dst, src in ((pinned_out, host, device), (pinned_in, device, host)):
            torch.cuda.synchronize()
            started = time.perf_counter()
            dst.copy_(src)
            torch.cuda.synchronize()
            copies.append(time.perf_counter() - started)
        del device, host
        torch.cuda.empty_cache()
        stage_in.append(post(backup_client, "/resume_memory_occupation", ["weights"])["duration_s"])
    # The first round pays for allocating the pinned backup and warming the copy engines up.
    out_share = statistics.median(pinned_out[1:]) / statistics.median(stage_out[1:])
    in_share = statistics.median(pinned_in[1:]) / statistics.median(stage_in[1:])
    print(f"staging out {out_share:.2f}, in {in_share:.2f} of a pinned copy; durations out {stage_out}, "
          f"in {stage_in}, pinned out {pinned_out}, in {pinned_in}")
    assert out_share >= MIN_STAGING_SHARE_OF_PINNED
    assert in_share >= MIN_STAGING_SHARE_OF_PINNED


def test_cuda_graphs_replay_correctly_after_resume(backup_client, proc_log_dir: Path) -> None:
    assert backup_client.get("/get_server_info").json()["cuda_graph"] is True
    post(backup_client, "/release_memory_occupation", None)
    post(backup_client, "/resume_memory_occupation", None)
    after_resume = greedy(backup_client)
    eager = ServerProcess("node_engine", engine_args("--disable-cuda-graph", "--max-total-tokens", "65536"),
                          log_dir=proc_log_dir, name="gpu_eager_engine").start(timeout=900)
    try:
        with httpx.Client(base_url=eager.url, timeout=900) as client:
            assert client.get("/get_server_info").json()["cuda_graph"] is False
            assert greedy(client) == after_resume
    finally:
        eager.stop(timeout=60)


def test_release_and_resume_latency_per_tag_without_backup(saver_available: None, proc_log_dir: Path) -> None:
    proc = ServerProcess("node_engine", engine_args("--enable-memory-saver", "--max-total-tokens", "131072"),
                         log_dir=proc_log_dir, name="gpu_no_backup_engine").start(timeout=900)
    try:
        with httpx.Client(base_url=proc.url, timeout=900) as client:
            durations = {}
            for tag in TAGS:
                runs = [(post(client, "/release_memory_occupation", [tag])["duration_s"],
                         post(client, "/resume_memory_occupation", [tag])["duration_s"]) for _ in range(3)]
                durations[tag] = (statistics.median(r for r, _ in runs), statistics.median(r for _, r in runs))
            print("release/resume seconds per tag:", durations)
            assert client.get("/memory_occupation").json()["weights_valid"] is False  # no backup: contents gone
    finally:
        proc.stop(timeout=60)
    for tag, (release_s, resume_s) in durations.items():
        assert release_s < MAX_TAG_LATENCY_S, (tag, release_s)
        assert resume_s < MAX_TAG_LATENCY_S, (tag, resume_s)
