"""The CUDA half of ``bench/memory_cycle.py --device cuda``: engine processes on a GPU, measured from outside.

Every figure comes from one run, against baselines taken in the same run:

- per tag and for all four: the bytes a release gives back, as the drop of the
  device's used memory (``torch.cuda.mem_get_info`` in this process), next to
  the bytes the engine says the tag holds;
- release and resume latency per tag (the engine's ``duration_s``; the first
  cycle apart: it allocates the retained pinned backup), with the CPU backup
  and without a backup, and releasing all four tags at once;
- weight staging bandwidth (the CPU backup's copy out on release and in on
  resume) against a plain pinned ``memcpy`` of the same bytes, made here
  while the weights are released;
- the residue outside every tag: the engine's footprint (free memory before it
  started minus after) minus what releasing all four tags gave back, listed
  by part (each part says how it was measured), and what no part explains;
- host memory of the retained pinned backup over cycles (the engine's RSS
  after each), which must stay flat;
- greedy outputs with CUDA graphs before and after a release/resume cycle
  (identical), and against an engine without graphs (float32 only: bf16
  kernels may round differently with a different batch shape).

Engines run one at a time: no other engine holds device memory while one is measured.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from node_engine.memory.tags import ALL_TAGS, MemoryTag
from node_engine.model.builtin import builtin_arch

REPO_ROOT = Path(__file__).resolve().parents[1]
# ~0.51B parameters: the GPU figures need a model of at least 0.5B.
CUDA_MODELS: dict[str, dict[str, int] | None] = {
    "0.5b": {"hidden_size": 1024, "intermediate_size": 4352, "num_layers": 32, "num_heads": 16, "num_kv_heads": 4,
             "head_dim": 64},
    "tiny": None,
}
PROMPTS = [[256] + [(11 * n + 3 * i) % 256 for i in range(20 + 5 * n)] for n in range(4)]
MiB = 2**20
TAGS = [t.value for t in ALL_TAGS]

# What the bench prints for each part of the residue, and how it was measured.
RESIDUE_PARTS = {
    "cuda_context": "a bare torch process's CUDA context: the drop of free memory while a child that did "
                    "torch.zeros(1, device='cuda') lives",
    "allocator_outside_tags": "torch's allocator segments outside every tag once released (engine: "
                              "memory_reserved() minus the tags' bytes): live tensors outside the tags",
    "cublas_workspace_main_stream": "engine at start: memory_allocated() left over by its first forward",
    "cublas_workspace_capture_stream": "engine at start: memory_allocated() left over by the graph warm-ups "
                                       "on the capture stream",
    "rotary_tables": "engine: the cos/sin tensors' bytes",
    "graph_instantiation": "engine at start: free-memory drop across the captures minus the graph pool's growth",
}
INSIDE_ALLOCATOR = ("cublas_workspace_main_stream", "cublas_workspace_capture_stream", "rotary_tables")


def free_bytes() -> int:
    torch.cuda.synchronize()
    return torch.cuda.mem_get_info()[0]


def bare_context_bytes() -> int:
    """Device memory a bare torch process takes for its CUDA context (a child process, measured from here)."""
    child = subprocess.Popen([sys.executable, "-c", "import sys, torch; torch.zeros(1, device='cuda'); "
                              "torch.cuda.synchronize(); print('ready', flush=True); sys.stdin.read()"],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    before = free_bytes()
    try:
        if child.stdout is None or child.stdout.readline().strip() != "ready":
            raise RuntimeError("the CUDA context probe did not start")
        during = free_bytes()
    finally:
        child.communicate(timeout=60)
    deadline = time.monotonic() + 30
    while free_bytes() < before - MiB and time.monotonic() < deadline:  # the driver frees it after the exit
        time.sleep(0.05)
    return max(0, before - during)


class Engine:
    """One engine process on the GPU, driven over HTTP (it arranges its own LD_PRELOAD)."""

    def __init__(self, log_dir: Path, model: str, dtype: str, name: str, *extra: str) -> None:
        import httpx

        from handoff.cluster.process import ServerProcess

        override = CUDA_MODELS[model]
        argv = ["--model-path", "builtin:tiny", "--device", "cuda", "--dtype", dtype, "--log-level", "warning",
                *(["--model-override", json.dumps(override)] if override else []), *extra]
        self.proc = ServerProcess("node_engine", argv, log_dir=log_dir, name=name, cwd=REPO_ROOT).start(timeout=900)
        self.client = httpx.Client(base_url=self.proc.url, timeout=900)

    def close(self) -> None:
        self.client.close()
        self.proc.stop(timeout=60)

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def control(self, path: str, tags: list[str] | None) -> dict[str, Any]:
        r = self.client.post(path, json={"tags": tags})
        r.raise_for_status()
        return r.json()

    def greedy(self) -> list[list[int]]:
        r = self.client.post("/generate", json={"input_ids": PROMPTS, "sampling_params": {
            "max_new_tokens": 16, "temperature": 0, "ignore_eos": True}})
        r.raise_for_status()
        return [item["output_ids"] for item in r.json()]

    def occupation(self) -> dict[str, Any]:
        return self.client.get("/memory_occupation").json()

    def rss(self) -> int:
        import psutil

        return psutil.Process(self.proc.pid).memory_info().rss


def tag_cycles(engine: Engine, repeats: int) -> dict[str, dict[str, float]]:
    """Each tag released and resumed alone, ``repeats`` times: bytes freed (device free memory) and latencies."""
    out = {}
    for tag in TAGS:
        runs = []
        for _ in range(repeats):
            before = free_bytes()
            released = engine.control("/release_memory_occupation", [tag])
            after = free_bytes()
            resumed = engine.control("/resume_memory_occupation", [tag])
            runs.append((after - before, released["duration_s"], resumed["duration_s"]))
        later = runs[1:] or runs
        out[tag] = {"freed": statistics.median(r[0] for r in runs),
                    "release_s": statistics.median(r[1] for r in later),
                    "resume_s": statistics.median(r[2] for r in later),
                    "first_release_s": runs[0][1], "first_resume_s": runs[0][2]}
    return out


def pinned_copy_s(num_bytes: int, repeats: int) -> tuple[float, float]:
    """Median seconds of a device-to-host and a host-to-device copy of ``num_bytes`` through pinned memory."""
    device = torch.empty(num_bytes, dtype=torch.uint8, device="cuda")
    host = torch.empty(num_bytes, dtype=torch.uint8, pin_memory=True)
    d2h, h2d = [], []
    for _ in range(repeats + 1):  # the first pair warms the copy engines up
        for times, dst, src in ((d2h, host, device), (h2d, device, host)):
            torch.cuda.synchronize()
            started = time.perf_counter()
            dst.copy_(src)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - started)
    del device, host
    torch.cuda.empty_cache()
    return statistics.median(d2h[1:]), statistics.median(h2d[1:])


def memset_s(num_bytes: int, repeats: int) -> float:
    """Median seconds to zero ``num_bytes`` of device memory (what a resume's KV zeroing costs per byte)."""
    buf = torch.empty(num_bytes, dtype=torch.uint8, device="cuda")
    times = []
    for _ in range(repeats + 1):
        torch.cuda.synchronize()
        started = time.perf_counter()
        buf.zero_()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - started)
    del buf
    torch.cuda.empty_cache()
    return statistics.median(times[1:])


def run_cuda(model: str, dtype: str, repeats: int) -> dict[str, Any]:
    torch.cuda.init()
    torch.zeros(1, device="cuda")  # this process's own context first: it is not the engine's
    result: dict[str, Any] = {"device": torch.cuda.get_device_name(), "model": model, "dtype": dtype,
                              "params": builtin_arch("builtin:tiny", CUDA_MODELS[model]).num_params(),
                              "cuda_context": bare_context_bytes()}
    with tempfile.TemporaryDirectory(prefix="handoff-memory-cycle-cuda-") as tmp:
        log_dir = Path(tmp)
        free_idle, total = torch.cuda.mem_get_info()
        with Engine(log_dir, model, dtype, "engine_cpu_backup", "--enable-memory-saver",
                    "--weights-backup", "cpu") as engine:
            free_started = free_bytes()
            view = engine.occupation()
            before = engine.greedy()
            result["with_backup"] = tag_cycles(engine, repeats)
            result["rss_per_cycle"] = []
            for _ in range(repeats):
                released = engine.control("/release_memory_occupation", None)
                free_released = free_bytes()
                released_view = engine.occupation()
                if "staging" not in result:
                    weights = view["tags"]["weights"]["bytes"]
                    d2h_s, h2d_s = pinned_copy_s(weights, repeats)  # in the room the engine gave back
                    result["staging"] = {"bytes": weights, "pinned_d2h_s": d2h_s, "pinned_h2d_s": h2d_s,
                                         "zero_kv_s": memset_s(view["tags"]["kv_cache"]["bytes"], repeats)}
                resumed = engine.control("/resume_memory_occupation", None)
                result["rss_per_cycle"].append(engine.rss())
            after = engine.greedy()
        staged = result["with_backup"]["weights"]
        result["staging"].update(release_s=staged["release_s"], resume_s=staged["resume_s"])
        result.update(total=total, footprint=free_idle - free_started, freed_all=free_released - free_started,
                      tag_bytes={t: view["tags"][t]["bytes"] for t in TAGS}, release_all_s=released["duration_s"],
                      resume_all_s=resumed["duration_s"], outside_tags=released_view.get("outside_tags", {}),
                      identical_after_cycle=after == before, graph_tokens=before)
        with Engine(log_dir, model, dtype, "engine_no_backup", "--enable-memory-saver") as engine:
            result["without_backup"] = tag_cycles(engine, repeats)
            result["release_all_no_backup_s"] = engine.control("/release_memory_occupation", None)["duration_s"]
        if dtype == "float32":
            with Engine(log_dir, model, dtype, "engine_eager", "--disable-cuda-graph") as engine:
                result["graph_equals_eager"] = engine.greedy() == result["graph_tokens"]
    return result


def residue_rows(r: dict[str, Any]) -> list[tuple[str, int, str]]:
    """The residue by part: (part, bytes, how measured); the last row is what no part explains."""
    parts = dict(r["outside_tags"])
    allocator = parts.pop("allocator_outside_tags", 0)
    rows = [("cuda_context", r["cuda_context"], RESIDUE_PARTS["cuda_context"]),
            ("allocator_outside_tags", allocator, RESIDUE_PARTS["allocator_outside_tags"])]
    for name in INSIDE_ALLOCATOR:  # already inside the allocator figure: listed for what they are
        rows.append((f"  of which {name}", parts.get(name, 0), RESIDUE_PARTS[name]))
    rows.append(("graph_instantiation", parts.get("graph_instantiation", 0), RESIDUE_PARTS["graph_instantiation"]))
    listed = r["cuda_context"] + allocator + parts.get("graph_instantiation", 0)
    residue = r["footprint"] - r["freed_all"]
    rows.append(("unexplained (kernels loaded, cuBLAS/cuDNN handles, driver)", residue - listed,
                 "footprint - freed - the parts above"))
    return rows


def print_cuda(r: dict[str, Any]) -> None:
    print(f"\nCUDA: {r['device']}, {r['params'] / 1e6:.0f}M-parameter model ({r['model']}) in {r['dtype']}\n")
    share = r["freed_all"] / r["footprint"]
    print(f"engine footprint {r['footprint'] / MiB:.0f} MiB of {r['total'] / 2**30:.1f} GiB; releasing all four "
          f"tags freed {r['freed_all'] / MiB:.0f} MiB = {100 * share:.2f}% in {r['release_all_s'] * 1e3:.1f} ms "
          f"(cpu backup), {r['release_all_no_backup_s'] * 1e3:.1f} ms without a backup (target < 100 ms); "
          f"resume all {r['resume_all_s'] * 1e3:.1f} ms")
    print("\n| tag | bytes (engine) | freed (device free memory) | release, cpu backup | resume, cpu backup "
          "| first cycle | release, no backup | resume, no backup |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for tag in TAGS:
        w, n = r["with_backup"][tag], r["without_backup"][tag]
        print(f"| {tag} | {r['tag_bytes'][tag] / MiB:.1f} MiB | {w['freed'] / MiB:.1f} MiB | {w['release_s'] * 1e3:.1f} ms "
              f"| {w['resume_s'] * 1e3:.1f} ms | {w['first_release_s'] * 1e3:.1f} / {w['first_resume_s'] * 1e3:.1f} ms "
              f"| {n['release_s'] * 1e3:.1f} ms | {n['resume_s'] * 1e3:.1f} ms |")
    print(f"| all four | {sum(r['tag_bytes'].values()) / MiB:.1f} MiB | {r['freed_all'] / MiB:.1f} MiB | "
          f"{r['release_all_s'] * 1e3:.1f} ms | {r['resume_all_s'] * 1e3:.1f} ms | | "
          f"{r['release_all_no_backup_s'] * 1e3:.1f} ms | |")
    s = r["staging"]
    out_share = s["pinned_d2h_s"] / s["release_s"]
    in_share = s["pinned_h2d_s"] / s["resume_s"]
    print(f"\nweights staging ({s['bytes'] / MiB:.0f} MiB): out {s['bytes'] / s['release_s'] / 1e9:.2f} GB/s = "
          f"{out_share:.2f} of a pinned D2H copy ({s['bytes'] / s['pinned_d2h_s'] / 1e9:.2f} GB/s); in "
          f"{s['bytes'] / s['resume_s'] / 1e9:.2f} GB/s = {in_share:.2f} of a pinned H2D copy "
          f"({s['bytes'] / s['pinned_h2d_s'] / 1e9:.2f} GB/s) (target >= 0.80)")
    mapped = r["without_backup"]["weights"]  # the same release and resume without the copy: pages unmapped, mapped
    copy_out_s, copy_in_s = s["release_s"] - mapped["release_s"], s["resume_s"] - mapped["resume_s"]
    if s["bytes"] >= 64 * MiB and copy_out_s > 0 and copy_in_s > 0:  # smaller copies are too short to time
        print(f"the copy alone (less the same tag's release / resume without a backup, {mapped['release_s'] * 1e3:.1f}"
              f" / {mapped['resume_s'] * 1e3:.1f} ms): out {s['pinned_d2h_s'] / copy_out_s:.2f}, in "
              f"{s['pinned_h2d_s'] / copy_in_s:.2f} of a pinned copy")
    print(f"zeroing the KV pool on resume: {r['tag_bytes']['kv_cache'] / MiB:.0f} MiB in "
          f"{s['zero_kv_s'] * 1e3:.2f} ms")
    print(f"engine RSS after each full cycle (retained pinned backup, must stay flat): "
          f"{', '.join(f'{b / MiB:.0f}' for b in r['rss_per_cycle'])} MiB")
    print("\nResidue outside every tag (released state):\n\n| part | bytes | how measured |\n|---|---:|---|")
    for name, num_bytes, how in residue_rows(r):
        print(f"| {name} | {num_bytes / MiB:.1f} MiB | {how} |")
    print(f"\ngreedy output identical after a release/resume cycle (CUDA graphs, CPU backup): "
          f"{r['identical_after_cycle']}")
    if "graph_equals_eager" in r:
        print(f"CUDA-graph decode equals --disable-cuda-graph decode (float32): {r['graph_equals_eager']}")
