"""Tests on a real vLLM server (CPU): run by ``make test-vllm`` in ``.venv-vllm``; skipped where vLLM is missing.

Each module starts one vLLM server (minutes on 2 cores) on a tiny local Llama
checkpoint written here, with a byte-level tokenizer vLLM loads offline.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from handoff.cluster.vllm import vllm_available

HAS_VLLM = vllm_available()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    skip = pytest.mark.skip(reason="vLLM is not installed here (make test-vllm)")
    for item in items:
        if here in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.vllm)
            item.add_marker(pytest.mark.timeout(900))
            if not HAS_VLLM:
                item.add_marker(skip)


def write_checkpoint(folder: Path, seed: int) -> Path:
    from node_engine.model.builtin import builtin_arch, builtin_weights, save_checkpoint

    arch = builtin_arch("builtin:tiny")
    save_checkpoint(folder, arch, builtin_weights(arch, seed))
    return folder


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """Two checkpoints of one shape: the one served at start (seed 0) and a "trained" one (seed 1)."""
    root = tmp_path_factory.mktemp("checkpoints")
    return write_checkpoint(root / "step-0", 0), write_checkpoint(root / "step-1", 1)


def tokens_lasting(generate_url: str, seconds: float, *, concurrency: int = 4, most: int = 4000,
                   least: int = 1000) -> int:
    """How many new tokens a request needs to run about ``seconds`` beside ``concurrency - 1`` others here and now
    (CPU speed varies by machine and load: a drain or an abort must find the requests still running). Each probe
    is ``concurrency`` requests run together, as the test will run them (how much a batch slows each request
    depends on the engine and the box); the fastest of two probes counts (one slowed by something else on the
    box would make the requests too short to be seen running together), and never fewer than ``least`` tokens."""
    import time
    from concurrent.futures import ThreadPoolExecutor

    import httpx

    probe = 128

    def one(_: int) -> None:
        r = httpx.post(generate_url, json={"input_ids": [1, 2, 3], "sampling_params": {
            "max_new_tokens": probe, "ignore_eos": True, "temperature": 0}}, timeout=300)
        assert r.status_code == 200, r.text

    one(0)  # the first request to a fresh engine also pays its warm-up: it is not counted
    fastest = float("inf")
    with ThreadPoolExecutor(concurrency) as pool:
        for _ in range(2):
            started = time.perf_counter()
            list(pool.map(one, range(concurrency)))
            fastest = min(fastest, time.perf_counter() - started)
    per_second = probe / max(fastest, 1e-3)  # tokens a second of each request, ``concurrency`` running
    return min(most, max(least, int(per_second * seconds)))
