"""Engines on a real GPU for tests/gpu: one process at a time, measured from outside.

Engines run ``builtin:tiny`` widened to ~0.51B parameters (random weights) with
the torch_memory_saver backend (the engine sets its own LD_PRELOAD). Each test
module starts its engines itself and stops them before the next module runs,
so no other engine holds device memory while one is measured.
"""

from __future__ import annotations

import contextlib
import json
import time
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest
import torch

from tests.support.procs import ServerProcess

MODEL = {"hidden_size": 1024, "intermediate_size": 4352, "num_layers": 32, "num_heads": 16, "num_kv_heads": 4,
         "head_dim": 64}
TAGS = ["weights", "kv_cache", "cuda_graph", "workspace"]
PROMPTS = [[256] + [(11 * n + 3 * i) % 256 for i in range(20 + 5 * n)] for n in range(4)]
MiB = 2**20


def require_memory_saver() -> None:
    pytest.importorskip("torch_memory_saver", reason="needs torch_memory_saver: pip install 'handoff[gpu]'")


def free_gpu_bytes() -> int:
    torch.cuda.synchronize()
    return torch.cuda.mem_get_info()[0]


class GpuEngine:
    def __init__(self, log_dir: Path, name: str, *extra: str, dtype: str | None = None) -> None:
        argv = ["--model-path", "builtin:tiny", "--model-override", json.dumps(MODEL), "--device", "cuda",
                *(["--dtype", dtype] if dtype else []), *extra]
        self.proc = ServerProcess("node_engine", argv, log_dir=log_dir, name=name).start(timeout=900)
        self.client = httpx.Client(base_url=self.proc.url, timeout=900)

    def stop(self) -> None:
        self.client.close()
        self.proc.stop(timeout=60)

    def post(self, path: str, tags: list[str] | None, *, status: int = 200) -> dict[str, Any]:
        r = self.client.post(path, json={"tags": tags})
        assert r.status_code == status, r.text
        return r.json()

    def release(self, tags: list[str] | None = None, **kw: Any) -> dict[str, Any]:
        return self.post("/release_memory_occupation", tags, **kw)

    def resume(self, tags: list[str] | None = None, **kw: Any) -> dict[str, Any]:
        return self.post("/resume_memory_occupation", tags, **kw)

    def greedy(self, max_new_tokens: int = 16) -> list[list[int]]:
        r = self.generate(max_new_tokens)
        assert r.status_code == 200, r.text
        return [item["output_ids"] for item in r.json()]

    def generate(self, max_new_tokens: int = 16, prompts: list[list[int]] | None = None) -> httpx.Response:
        return self.client.post("/generate", json={"input_ids": prompts or PROMPTS, "sampling_params": {
            "max_new_tokens": max_new_tokens, "temperature": 0, "ignore_eos": True}})

    def occupation(self) -> dict[str, Any]:
        return self.client.get("/memory_occupation").json()

    def rss(self) -> int:
        import psutil

        return psutil.Process(self.proc.pid).memory_info().rss


@contextlib.contextmanager
def started(log_dir: Path, name: str, *extra: str, dtype: str | None = None) -> Iterator[GpuEngine]:
    """An engine for the block, stopped (and its device memory given back) afterwards."""
    engine = GpuEngine(log_dir, name, *extra, dtype=dtype)
    try:
        yield engine
    finally:
        engine.stop()
        deadline = time.monotonic() + 60  # the driver frees a dead process's memory shortly after its exit
        while time.monotonic() < deadline and torch.cuda.mem_get_info()[0] < 0.9 * torch.cuda.mem_get_info()[1]:
            time.sleep(0.2)
