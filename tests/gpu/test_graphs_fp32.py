"""CUDA-graph decode after a release/resume cycle gives the tokens of eager decode (float32, where kernels of
different batch shapes agree exactly), with graphs per batch size and key-count bucket (issue 18, item 6)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.gpu.engines import require_memory_saver, started

pytestmark = [pytest.mark.gpu, pytest.mark.slow, pytest.mark.timeout(1800)]


def test_graph_decode_after_a_cycle_equals_eager_decode(proc_log_dir: Path) -> None:
    require_memory_saver()
    with started(proc_log_dir, "gpu_graphs", "--enable-memory-saver", "--weights-backup", "cpu",
                 dtype="float32") as engine:
        assert engine.client.get("/get_server_info").json()["cuda_graph"] is True
        before = engine.greedy(24)
        engine.release(None)
        engine.resume(None)
        after_resume = engine.greedy(24)
    assert after_resume == before
    with started(proc_log_dir, "gpu_eager", "--disable-cuda-graph", "--max-total-tokens", "65536",
                 dtype="float32") as eager:
        assert eager.client.get("/get_server_info").json()["cuda_graph"] is False
        assert eager.greedy(24) == after_resume
