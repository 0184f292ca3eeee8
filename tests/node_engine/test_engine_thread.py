"""The engine thread computes with the thread count the process asked for."""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

import pytest
import torch

from node_engine.config import EngineConfig
from tests.node_engine.engine_harness import running_engine


def loaded_openmp() -> ctypes.CDLL | None:
    """The OpenMP runtime torch loaded (libgomp or libiomp), if this platform shows it."""
    maps = Path(f"/proc/{os.getpid()}/maps")
    if not maps.is_file():
        return None
    paths = sorted({line.split()[-1] for line in maps.read_text().splitlines()
                    if "omp" in line.rsplit("/", 1)[-1] and line.split()[-1].startswith("/")})
    return ctypes.CDLL(paths[0]) if paths else None


async def test_openmp_in_the_engine_thread_uses_the_process_thread_count() -> None:
    openmp = loaded_openmp()
    if openmp is None or (os.cpu_count() or 1) < 2:
        pytest.skip("needs a visible OpenMP runtime and at least 2 cores to tell the counts apart")
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        async with running_engine(EngineConfig(model_path="builtin:tiny", max_total_tokens=256)) as engine:
            # A fresh thread starts at OpenMP's default (all cores); the engine thread must not.
            in_engine = await engine.call(openmp.omp_get_max_threads)
        assert in_engine == 1
    finally:
        torch.set_num_threads(before)


async def test_a_call_is_no_longer_pending_once_its_caller_has_the_answer() -> None:
    """``control_calls_pending`` tells a sidecar whose call got no answer in time to wait before it reads the
    state: a call must stop counting before its answer can reach the caller, or a sidecar that reads the
    state right after a refused call takes the engine for busy and stops serving (CI found this under load)."""
    async with running_engine(EngineConfig(model_path="builtin:tiny", max_total_tokens=256)) as engine:
        for _ in range(300):
            assert await engine.call(lambda: engine.num_calls_pending) == 1  # counted while it runs
            assert engine.num_calls_pending == 0

            def refused() -> None:
                raise ValueError("refused")

            with pytest.raises(ValueError):
                await engine.call(refused)
            assert engine.num_calls_pending == 0
