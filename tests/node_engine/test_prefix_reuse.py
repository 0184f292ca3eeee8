"""Prefix reuse in a real engine: outputs never change, and the cache empties when its KV goes stale."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from node_engine.model.builtin import builtin_arch, builtin_weights, save_checkpoint
from tests.node_engine.test_server import metric
from tests.support.procs import ServerProcess

GREEDY = {"temperature": 0, "ignore_eos": True, "max_new_tokens": 12}
SYSTEM = "You are a careful assistant. Answer briefly. "
PROMPTS = [SYSTEM + q for q in ("What is 2+2?", "Name a colour.", "What is 2+3?", "Say hi.")] + [SYSTEM, "x"]


@pytest.fixture(scope="module")
def engines(proc_log_dir: Path):
    """The same model with and without the prefix cache; a small pool so the cache must evict."""
    common = ["--model-path", "builtin:tiny", "--max-total-tokens", "400", "--enable-memory-saver"]
    cached = ServerProcess("node_engine", common, log_dir=proc_log_dir, name="cached").start()
    plain = ServerProcess("node_engine", [*common, "--disable-prefix-cache"], log_dir=proc_log_dir,
                          name="uncached").start()
    yield cached, plain
    cached.stop()
    plain.stop()


def outputs(engine: ServerProcess, prompts: list[str], *, concurrent: bool = False) -> list[list[int]]:
    def one(prompt: str) -> list[int]:
        r = httpx.post(engine.url + "/generate", json={"text": prompt, "sampling_params": GREEDY}, timeout=30)
        assert r.status_code == 200, r.text
        return r.json()["output_ids"]
    if concurrent:
        with ThreadPoolExecutor(4) as pool:
            return list(pool.map(one, prompts))
    return [one(p) for p in prompts]


def test_reuse_never_changes_outputs(engines) -> None:
    cached, plain = engines
    expected = outputs(plain, PROMPTS)
    with httpx.Client(base_url=cached.url, timeout=10) as c:
        hits_before = metric(c, "handoff_engine_prefix_hit_tokens_total")
        for _ in range(2):
            assert outputs(cached, PROMPTS) == expected
            assert outputs(cached, PROMPTS * 3, concurrent=True) == expected * 3
        assert metric(c, "handoff_engine_prefix_hit_tokens_total") > hits_before + 10 * len(SYSTEM)
        # many distinct prompts through a 400-slot pool: the cache evicts, outputs stay right
        many = [f"{i} distinct prompt number {i} " * 3 for i in range(30)]
        assert outputs(cached, many, concurrent=True) == outputs(plain, many)
        assert metric(c, "handoff_engine_kv_slots_used") <= 400


def test_flush_resume_and_reload_empty_the_cache(engines, tmp_path: Path) -> None:
    cached, _ = engines
    with httpx.Client(base_url=cached.url, timeout=30) as c:
        outputs(cached, PROMPTS)
        assert metric(c, "handoff_engine_cached_tokens") > 0
        dropped = c.post("/flush_cache").json()["num_cached_tokens_dropped"]
        assert dropped > 0 and metric(c, "handoff_engine_cached_tokens") == 0
        outputs(cached, PROMPTS)
        assert c.post("/release_memory_occupation", json={"tags": ["kv_cache"]}).status_code == 200
        assert c.post("/resume_memory_occupation", json={"tags": ["kv_cache"]}).status_code == 200
        assert metric(c, "handoff_engine_cached_tokens") == 0  # the KV is gone, so is every cached prefix
        outputs(cached, PROMPTS)
        arch = builtin_arch("builtin:tiny")
        save_checkpoint(tmp_path / "same", arch, builtin_weights(arch, seed=0))
        assert c.post("/update_weights_from_disk", json={"model_path": str(tmp_path / "same"),
                                                         "weight_version": "default"}).status_code == 200
        assert metric(c, "handoff_engine_cached_tokens") == 0  # KV of old weights is never reused
