"""Without a weights backup on a real GPU: per-tag latency, the refusal to generate on invalid weights and the
reload that ends it, and the 507 of a resume that does not fit (issue 18, item 8)."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Iterator

import pytest

from node_engine.model.builtin import builtin_arch, builtin_weights, save_checkpoint
from tests.gpu.engines import MODEL, TAGS, GpuEngine, require_memory_saver, started

pytestmark = [pytest.mark.gpu, pytest.mark.slow, pytest.mark.timeout(1800)]

# Issue 18's target (under 0.1 s for a release without backup) is checked by bench/memory_cycle.py; this bound
# only catches a release or resume that does far more than unmapping and mapping pages.
MAX_TAG_LATENCY_S = 1.0


@pytest.fixture(scope="module")
def override(proc_log_dir: Path) -> Path:
    return proc_log_dir / "free_bytes"


@pytest.fixture(scope="module")
def engine(proc_log_dir: Path, override: Path) -> Iterator[GpuEngine]:
    require_memory_saver()
    with started(proc_log_dir, "gpu_no_backup", "--enable-memory-saver", "--free-memory-override-file",
                 str(override)) as engine:
        yield engine


def test_release_and_resume_latency_per_tag(engine: GpuEngine) -> None:
    durations = {}
    for tag in TAGS:
        runs = [(engine.release([tag])["duration_s"], engine.resume([tag])["duration_s"]) for _ in range(3)]
        durations[tag] = (statistics.median(r for r, _ in runs), statistics.median(r for _, r in runs))
    print("release/resume seconds per tag:", durations)
    for tag, (release_s, resume_s) in durations.items():
        assert release_s < MAX_TAG_LATENCY_S and resume_s < MAX_TAG_LATENCY_S, (tag, release_s, resume_s)


def test_invalid_weights_refuse_generation_until_a_reload(engine: GpuEngine, tmp_path: Path) -> None:
    arch = builtin_arch("builtin:tiny", MODEL)
    save_checkpoint(tmp_path / "ckpt", arch, builtin_weights(arch, seed=0))  # the engine's own weights

    def reload() -> None:
        reloaded = engine.client.post("/update_weights_from_disk", json={"model_path": str(tmp_path / "ckpt")})
        assert reloaded.status_code == 200, reloaded.text
        assert engine.occupation()["weights_valid"] is True

    engine.resume(None)
    if not engine.occupation()["weights_valid"]:  # an earlier test released them without a backup
        reload()
    expected = engine.greedy()
    engine.release(None)
    assert engine.resume(None)["weights_valid"] is False
    refused = engine.generate()
    assert refused.status_code == 503 and refused.json()["error"]["type"] == "weights_not_loaded"
    reload()
    assert engine.greedy() == expected


def test_a_resume_that_does_not_fit_is_507_and_changes_nothing(engine: GpuEngine, override: Path) -> None:
    engine.release(["kv_cache"])
    override.write_text("1000")
    try:
        refused = engine.resume(None, status=507)
    finally:
        override.unlink()
    error = refused["error"]
    assert error["type"] == "insufficient_memory" and error["free_bytes"] == 1000
    assert error["step_headroom_bytes"] > 0  # the first step after it must fit too
    assert engine.occupation()["tags"]["kv_cache"]["state"] == "released"
    # workspace follows kv_cache when a release does not name it (handoff/protocol/tags.py)
    assert engine.resume(None)["resumed"] == ["kv_cache", "workspace"]
