"""Release and resume on a real GPU in bf16 (the CUDA default) with the CPU weights backup (issue 18, item 8).

The share-freed test reads free device memory before the engine starts, so the module's engine is the only
one alive. Skipped without CUDA (tests/conftest.py) or torch_memory_saver.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Iterator

import pytest
import torch

from bench.memory_cycle_cuda import bare_context_bytes, pinned_copy_s, residue_rows
from node_engine.model.builtin import builtin_arch
from tests.gpu.engines import MODEL, TAGS, MiB, GpuEngine, free_gpu_bytes, require_memory_saver, started

pytestmark = [pytest.mark.gpu, pytest.mark.slow, pytest.mark.timeout(1800)]

MIN_SHARE_FREED = 0.99            # of the engine's steady-state footprint; the rest is the listed residue
MAX_ALLOCATOR_OUTSIDE_TAGS = 256 * MiB  # tensors outside every tag once released: cuBLAS workspaces, rotary tables
# Issue 18's target (staging at 80% of a pinned memcpy) is about the copy, which bench/memory_cycle.py times alone
# (the release or resume less the same one without a backup: 0.94-0.98 on an H200). A release or resume also
# unmaps or maps the pages, one after the other with the copy in torch_memory_saver (about 4-5 ms for 1 GiB), so
# end to end it reached 0.70-0.83 of a bare pinned copy in three runs. This bound catches a copy that is no longer
# one pinned transfer per segment.
MIN_STAGING_SHARE_OF_PINNED = 0.65


def test_model_is_at_least_half_a_billion_parameters() -> None:
    assert builtin_arch("builtin:tiny", MODEL).num_params() >= 500_000_000


@pytest.fixture(scope="module")
def node(proc_log_dir: Path) -> Iterator[tuple[GpuEngine, int, int, int]]:
    """(engine, free bytes before it started, after, a bare process's CUDA context bytes)."""
    require_memory_saver()
    torch.zeros(1, device="cuda")  # this process's own context first: it is not the engine's
    context = bare_context_bytes()
    free_before = free_gpu_bytes()
    with started(proc_log_dir, "gpu_cpu_backup", "--enable-memory-saver", "--weights-backup", "cpu") as engine:
        yield engine, free_before, free_gpu_bytes(), context


@pytest.fixture
def engine(node) -> Iterator[GpuEngine]:
    yield node[0]
    node[0].resume(None)  # every test leaves the engine resident


def test_releasing_everything_frees_all_but_the_listed_residue(node, engine: GpuEngine) -> None:
    _, free_before, free_started, context = node
    footprint = free_before - free_started
    assert engine.release(None)["released"] == TAGS
    freed = free_gpu_bytes() - free_started
    view = engine.occupation()
    rows = residue_rows({"outside_tags": view["outside_tags"], "cuda_context": context, "footprint": footprint,
                         "freed_all": freed})
    print(f"footprint {footprint / MiB:.0f} MiB, freed {freed / MiB:.0f} MiB = {100 * freed / footprint:.2f}%")
    for name, num_bytes, how in rows:
        print(f"  {name}: {num_bytes / MiB:.1f} MiB ({how})")
    assert freed >= MIN_SHARE_FREED * footprint, (footprint, freed, rows)
    assert view["outside_tags"]["allocator_outside_tags"] <= MAX_ALLOCATOR_OUTSIDE_TAGS, view["outside_tags"]
    engine.resume(None)
    assert free_gpu_bytes() - free_started < 0.01 * footprint  # the footprint is back (less the emptied cache)


def test_each_tag_frees_its_own_bytes_on_the_device(engine: GpuEngine) -> None:
    tag_bytes = {tag: info["bytes"] for tag, info in engine.occupation()["tags"].items()}
    for tag in TAGS:
        before = free_gpu_bytes()
        engine.release([tag])
        freed = free_gpu_bytes() - before
        engine.resume([tag])
        print(f"{tag}: {tag_bytes[tag] / MiB:.1f} MiB held, {freed / MiB:.1f} MiB freed")
        # at least what the tag holds; more only by the allocator cache the release empties
        assert freed >= tag_bytes[tag] - 2 * MiB, (tag, tag_bytes[tag], freed)


def test_greedy_output_is_identical_after_a_cycle_in_bf16(engine: GpuEngine) -> None:
    assert engine.client.get("/get_server_info").json()["dtype"] == "bfloat16"
    before = engine.greedy()
    engine.release(None)
    assert engine.resume(None)["weights_valid"] is True
    assert engine.greedy() == before


def test_weight_staging_is_as_fast_as_a_pinned_copy(engine: GpuEngine) -> None:
    weights_bytes = engine.occupation()["tags"]["weights"]["bytes"]
    stage_out, stage_in, pinned_out, pinned_in = [], [], [], []
    for _ in range(4):
        stage_out.append(engine.release(["weights"])["duration_s"])
        d2h_s, h2d_s = pinned_copy_s(weights_bytes, 1)  # in the room the released weights left
        pinned_out.append(d2h_s)
        pinned_in.append(h2d_s)
        stage_in.append(engine.resume(["weights"])["duration_s"])
    # The first round allocates the pinned backup (kept from then on) and warms the copy engines up.
    out_share = statistics.median(pinned_out[1:]) / statistics.median(stage_out[1:])
    in_share = statistics.median(pinned_in[1:]) / statistics.median(stage_in[1:])
    print(f"staging out {out_share:.2f}, in {in_share:.2f} of a pinned copy; out {stage_out}, in {stage_in}, "
          f"pinned out {pinned_out}, in {pinned_in}")
    assert out_share >= MIN_STAGING_SHARE_OF_PINNED
    assert in_share >= MIN_STAGING_SHARE_OF_PINNED


def test_the_pinned_backup_does_not_grow_cycle_after_cycle(engine: GpuEngine) -> None:
    weights_bytes = engine.occupation()["tags"]["weights"]["bytes"]
    rss = []
    for _ in range(6):
        engine.release(None)
        engine.resume(None)
        rss.append(engine.rss())
    print("engine RSS after each cycle (MiB):", [round(r / MiB) for r in rss])
    assert max(rss[1:]) - min(rss[1:]) < 0.02 * weights_bytes + 32 * MiB, rss


def test_a_first_step_that_finds_no_memory_fails_alone(engine: GpuEngine) -> None:
    """Another process takes the memory between the resume and the first step: that step's requests fail
    with engine_failed; the engine goes on and serves once the memory is back (issue 18, item 4)."""
    expected = engine.greedy()
    engine.release(None)
    engine.resume(None)
    hog = []
    chunk = 1 << 30
    while chunk >= MiB:  # everything the device has left, but a few MiB
        try:
            hog.append(torch.empty(chunk, dtype=torch.uint8, device="cuda"))
        except torch.OutOfMemoryError:
            chunk //= 2
    long_prompt = [[256] + [(5 * i) % 256 for i in range(2000)]]
    failed = engine.generate(4, long_prompt)
    del hog
    torch.cuda.empty_cache()
    assert failed.status_code == 500, failed.text
    error = failed.json()["error"]
    assert error["type"] == "engine_failed" and "out of memory" in error["message"].lower()
    assert engine.client.get("/health").status_code == 200
    assert engine.greedy() == expected
