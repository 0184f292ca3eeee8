"""What each memory tag of node_engine holds, and what releasing and resuming it costs.

CPU (always; the project's CPU backend, ``--weights-backup disk``), for
``builtin:tiny`` and a ~100M-parameter random Llama, each in a fresh child
process: per-tag bytes; process RSS before and after releasing each tag and
after resuming it; release/resume latency per tag; the disk backup's spill and
restore bandwidth against a plain write and read of the same bytes to the same
directory in the same run; and what stays outside every region (the Python and
torch runtime, the tokenizer, the rotary tables, per-step tensors). Logits are
checked bit for bit after a full cycle.

CUDA (only when ``torch.cuda.is_available()``), on engine processes running a
~0.5B-parameter random Llama with the torch_memory_saver backend: the share of
the engine's GPU footprint freed by releasing all four tags (``mem_get_info``
before the engine starts, after it started, after the release; target 99.5%),
release/resume latency per tag with and without a weights backup (target
under 0.1 s without one), weight staging bandwidth of ``--weights-backup cpu``
against a plain pinned-memory copy of the same bytes measured in the same run
(target 80%), identical greedy output after a release/resume cycle with the CPU
backup, and CUDA graphs replaying correctly after resume (the same tokens as an
engine started with ``--disable-cuda-graph``). The CUDA branch was written on a
machine without a GPU and has not been run yet; docs/memory.md says which
figures are pending.

    .venv/bin/python bench/memory_cycle.py                  # CPU tables (and CUDA ones on a GPU box)
    .venv/bin/python bench/memory_cycle.py --models tiny --repeats 5
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

import psutil  # noqa: E402
import torch  # noqa: E402

from bench.common import MODELS  # noqa: E402
from node_engine.memory.tags import ALL_TAGS, MemoryTag  # noqa: E402
from node_engine.model.arch import ModelArch  # noqa: E402
from node_engine.model.builtin import builtin_arch  # noqa: E402

# ~0.51B parameters: the GPU figures need a model of at least 0.5B.
CUDA_MODEL = {"hidden_size": 1024, "intermediate_size": 4352, "num_layers": 32, "num_heads": 16, "num_kv_heads": 4,
              "head_dim": 64}
PROMPT = [256] + [(7 * i) % 256 for i in range(63)]
CUDA_PROMPTS = [[256] + [(11 * n + 3 * i) % 256 for i in range(20 + 5 * n)] for n in range(4)]
MiB = 2**20


def rss() -> int:
    return psutil.Process().memory_info().rss


def trim_heap() -> None:
    """Give free malloc arenas back to the OS, so RSS deltas show what really changed."""
    name = ctypes.util.find_library("c")
    if name is not None:
        libc = ctypes.CDLL(name)
        if hasattr(libc, "malloc_trim"):
            libc.malloc_trim(0)


def per_step_bytes(arch: ModelArch, *, num_tokens: int, num_seqs: int, num_keys: int, itemsize: int) -> int:
    """Upper bound of the tensors one forward step makes, outside every region (computed from the shapes).

    Counts everything a decoder layer allocates as alive at once (the allocator reuses
    a layer's blocks for the next), plus the step's index tensors and the logits of
    ``num_seqs`` sampled positions.
    """
    h, q, kv, inter = arch.hidden_size, arch.q_size, arch.kv_size, arch.intermediate_size
    qk = q + kv
    per_token = (2 * h                 # norm output and its temporaries
                 + (q + 2 * kv)         # fused qkv
                 + 4 * qk               # rotation: x*cos, roll, *sin, sum
                 + q + 2 * h            # attention output, o_proj, residual
                 + 2 * h                # second norm
                 + 2 * inter + 2 * inter + h + h)  # gate_up, silu and product, down, residual
    gathered = 2 * num_seqs * num_keys * kv  # keys and values gathered for attention
    tables = 2 * num_tokens * arch.head_dim + num_tokens * h  # cos/sin rows, hidden state
    layer = (num_tokens * per_token + gathered + tables) * itemsize
    indices = 8 * (4 * num_tokens) + 4 * num_seqs * num_keys + num_seqs * num_keys  # ids, slots, kv_indices, mask
    logits = 4 * num_seqs * arch.vocab_size
    return layer + indices + logits


# -- CPU, one model per child process --------------------------------------------------------
def cpu_child(model: str, repeats: int) -> dict[str, Any]:
    from node_engine.config import EngineConfig
    from node_engine.engine import Engine
    from node_engine.memory.tags import BackupMode
    from node_engine.tokenizer import Tokenizer

    trim_heap()
    rss_runtime = rss()
    tokenizer = Tokenizer.builtin_bytes()
    trim_heap()
    rss_tokenizer = rss() - rss_runtime
    del tokenizer
    overrides = MODELS[model]
    with tempfile.TemporaryDirectory(prefix="handoff-memory-cycle-") as tmp:
        backup_dir = Path(tmp) / "backup"
        config = EngineConfig(model_path="builtin:tiny", model_override=json.dumps(overrides) if overrides else None,
                              enable_memory_saver=True, weights_backup=BackupMode.DISK, backup_dir=backup_dir)
        trim_heap()
        rss_before_engine = rss()
        engine = Engine(config)
        trim_heap()
        rss_engine = rss() - rss_before_engine
        arch = engine.arch
        tag_bytes = {t.value: engine.saver.tag_bytes(t) for t in ALL_TAGS}
        reference_logits = engine.runner.score(PROMPT)

        per_tag: dict[str, dict[str, float]] = {}
        for tag in ALL_TAGS:
            runs = []
            for _ in range(repeats):
                before = rss()
                released = engine.control.release([tag], stage_to_cpu=None)
                after_release = rss()
                resumed = engine.control.resume([tag])
                after_resume = rss()
                runs.append({"dropped": before - after_release, "regained": after_resume - after_release,
                             "release_s": released["duration_s"], "resume_s": resumed["duration_s"]})
            per_tag[tag.value] = {k: statistics.median(r[k] for r in runs) for k in runs[0]}

        before = rss()
        released = engine.control.release(None, stage_to_cpu=None)
        all_dropped = before - rss()
        engine.control.resume(None)
        is_restored = bool(torch.equal(engine.runner.score(PROMPT), reference_logits))

        weights_bytes = tag_bytes[MemoryTag.WEIGHTS.value]
        no_backup = []
        for _ in range(repeats):
            released = engine.control.release([MemoryTag.WEIGHTS], stage_to_cpu=False)
            resumed = engine.control.resume([MemoryTag.WEIGHTS])
            no_backup.append((released["duration_s"], resumed["duration_s"]))
        plain_write_s, plain_read_s = plain_file_copy(Path(tmp), weights_bytes, repeats)
        weights_with_backup = per_tag[MemoryTag.WEIGHTS.value]
        return {
            "model": model, "params": arch.num_params(), "tag_bytes": tag_bytes, "per_tag": per_tag,
            "all_bytes": sum(tag_bytes.values()), "all_dropped": all_dropped, "is_restored": is_restored,
            "weights_no_backup_release_s": statistics.median(r for r, _ in no_backup),
            "weights_no_backup_resume_s": statistics.median(r for _, r in no_backup),
            "spill_gb_s": weights_bytes / weights_with_backup["release_s"] / 1e9,
            "restore_gb_s": weights_bytes / weights_with_backup["resume_s"] / 1e9,
            "plain_write_gb_s": weights_bytes / plain_write_s / 1e9,
            "plain_read_gb_s": weights_bytes / plain_read_s / 1e9,
            "backup_fs": filesystem_of(backup_dir),
            "rss_runtime": rss_runtime, "rss_tokenizer": rss_tokenizer, "rss_engine": rss_engine,
            "rotary_bytes": engine.runner.rotary.nbytes,
            "decode_step_bytes": per_step_bytes(arch, num_tokens=8, num_seqs=8, num_keys=128,
                                                itemsize=engine.runner.dtype.itemsize),
            "prefill_step_bytes": per_step_bytes(arch, num_tokens=config.max_batch_tokens, num_seqs=1,
                                                 num_keys=config.max_batch_tokens,
                                                 itemsize=engine.runner.dtype.itemsize),
        }


def plain_file_copy(folder: Path, num_bytes: int, repeats: int) -> tuple[float, float]:
    """Median seconds to write ``num_bytes`` as one file in ``folder``, then read it into fresh memory.

    The read lands in newly allocated pages, as a restore does (page faults included);
    both go through the page cache, without fsync, as the spill does.
    """
    data = torch.ones(num_bytes, dtype=torch.uint8).numpy()
    path = folder / "plain.bin"
    writes, reads = [], []
    for _ in range(repeats):
        started = time.perf_counter()
        with open(path, "wb") as f:
            f.write(memoryview(data))
        writes.append(time.perf_counter() - started)
        fresh = torch.empty(num_bytes, dtype=torch.uint8).numpy()
        started = time.perf_counter()
        with open(path, "rb") as f:
            f.readinto(memoryview(fresh))
        reads.append(time.perf_counter() - started)
        del fresh
        path.unlink()
    return statistics.median(writes), statistics.median(reads)


def filesystem_of(path: Path) -> str:
    best = ""
    fstype = "?"
    for part in psutil.disk_partitions(all=True):
        if str(path).startswith(part.mountpoint) and len(part.mountpoint) > len(best):
            best, fstype = part.mountpoint, part.fstype
    return fstype


def run_cpu(models: list[str], repeats: int) -> list[dict[str, Any]]:
    results = []
    for model in models:
        out = subprocess.run([sys.executable, __file__, "--cpu-child", model, "--repeats", str(repeats)],
                             capture_output=True, text=True, cwd=REPO_ROOT, check=False)
        if out.returncode != 0:
            raise RuntimeError(f"CPU measurement of {model} failed:\n{out.stderr[-3000:]}")
        results.append(json.loads(out.stdout.strip().splitlines()[-1]))
    return results


def print_cpu(results: list[dict[str, Any]]) -> None:
    print("\nPer tag (CPU backend, --weights-backup disk; medians):\n")
    print("| model | tag | bytes | RSS drop on release | drop / bytes | RSS regained on resume | release | resume |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for r in results:
        for tag in (t.value for t in ALL_TAGS):
            nbytes, m = r["tag_bytes"][tag], r["per_tag"][tag]
            share = f"{m['dropped'] / nbytes:.2f}" if nbytes else "-"
            print(f"| {r['model']} | {tag} | {nbytes / MiB:.2f} MiB | {m['dropped'] / MiB:.2f} MiB | {share} "
                  f"| {m['regained'] / MiB:.2f} MiB | {m['release_s'] * 1e3:.2f} ms | {m['resume_s'] * 1e3:.2f} ms |")
        print(f"| {r['model']} | all four | {r['all_bytes'] / MiB:.2f} MiB | {r['all_dropped'] / MiB:.2f} MiB "
              f"| {r['all_dropped'] / r['all_bytes']:.2f} | | | |")
    print("\nWeights backup (disk spill, same directory as the plain copy, page cache, no fsync):\n")
    print("| model | weights | spill (release) | plain write | spill / plain | restore (resume) | plain read "
          "| restore / plain | release, resume without backup | logits identical after a full cycle |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for r in results:
        w = r["tag_bytes"][MemoryTag.WEIGHTS.value]
        print(f"| {r['model']} | {w / MiB:.1f} MiB | {r['spill_gb_s']:.2f} GB/s | {r['plain_write_gb_s']:.2f} GB/s "
              f"| {r['spill_gb_s'] / r['plain_write_gb_s']:.2f} | {r['restore_gb_s']:.2f} GB/s "
              f"| {r['plain_read_gb_s']:.2f} GB/s | {r['restore_gb_s'] / r['plain_read_gb_s']:.2f} "
              f"| {r['weights_no_backup_release_s'] * 1e3:.1f} ms, {r['weights_no_backup_resume_s'] * 1e3:.1f} ms "
              f"| {'yes' if r['is_restored'] else 'NO'} |")
    print(f"\n(backup directory filesystem: {results[0]['backup_fs']})")
    print("\nOutside every region (RSS measured in a fresh process; per-step tensors computed from shapes):\n")
    print("| model | params | Python + torch + node_engine | tokenizer | engine RSS | of which in tags "
          "| rotary tables | decode step, 8 seqs x 128 keys | prefill chunk, 2048 tokens |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in results:
        print(f"| {r['model']} | {r['params'] / 1e6:.1f}M | {r['rss_runtime'] / MiB:.0f} MiB "
              f"| {r['rss_tokenizer'] / MiB:.2f} MiB | {r['rss_engine'] / MiB:.1f} MiB "
              f"| {r['all_bytes'] / MiB:.1f} MiB "
              f"| {r['rotary_bytes'] / MiB:.2f} MiB | {r['decode_step_bytes'] / MiB:.2f} MiB "
              f"| {r['prefill_step_bytes'] / MiB:.1f} MiB |")


# -- CUDA -------------------------------------------------------------------------------------
class CudaRun:
    """Engine processes on the GPU, driven over HTTP (the engine arranges its own LD_PRELOAD)."""

    def __init__(self, log_dir: Path, dtype: str) -> None:
        self.log_dir = log_dir
        self.dtype = dtype

    def start(self, name: str, *extra: str) -> Any:
        from handoff.cluster.process import ServerProcess

        argv = ["--model-path", "builtin:tiny", "--model-override", json.dumps(CUDA_MODEL), "--device", "cuda",
                "--dtype", self.dtype, "--log-level", "warning", *extra]
        return ServerProcess("node_engine", argv, log_dir=self.log_dir, name=name, cwd=REPO_ROOT).start(timeout=900)


def greedy(client: Any, max_new_tokens: int = 16) -> list[list[int]]:
    r = client.post("/generate", json={"input_ids": CUDA_PROMPTS, "sampling_params": {
        "max_new_tokens": max_new_tokens, "temperature": 0, "ignore_eos": True}})
    r.raise_for_status()
    return [item["output_ids"] for item in r.json()]


def control(client: Any, path: str, tags: list[str] | None) -> dict[str, Any]:
    started = time.perf_counter()
    r = client.post(path, json={"tags": tags})
    wall = time.perf_counter() - started
    r.raise_for_status()
    return {**r.json(), "wall_s": wall}


def pinned_copy_s(num_bytes: int, repeats: int) -> tuple[float, float]:
    """Median seconds of a plain device-to-host and host-to-device copy of ``num_bytes`` through pinned memory."""
    device = torch.empty(num_bytes, dtype=torch.uint8, device="cuda")
    host = torch.empty(num_bytes, dtype=torch.uint8, pin_memory=True)
    d2h, h2d = [], []
    for _ in range(repeats + 1):  # the first pair warms the copy engines up
        torch.cuda.synchronize()
        started = time.perf_counter()
        host.copy_(device)
        torch.cuda.synchronize()
        d2h.append(time.perf_counter() - started)
        started = time.perf_counter()
        device.copy_(host)
        torch.cuda.synchronize()
        h2d.append(time.perf_counter() - started)
    del device, host
    torch.cuda.empty_cache()
    return statistics.median(d2h[1:]), statistics.median(h2d[1:])


def tag_cycles(client: Any, repeats: int) -> dict[str, dict[str, float]]:
    """Release then resume each tag alone, ``repeats`` times; medians of the engine-reported durations."""
    out = {}
    for tag in (t.value for t in ALL_TAGS):
        runs = [(control(client, "/release_memory_occupation", [tag]),
                 control(client, "/resume_memory_occupation", [tag])) for _ in range(repeats)]
        out[tag] = {"release_s": statistics.median(r["duration_s"] for r, _ in runs),
                    "resume_s": statistics.median(r["duration_s"] for _, r in runs),
                    "first_release_s": runs[0][0]["duration_s"], "first_resume_s": runs[0][1]["duration_s"]}
    return out


def run_cuda(repeats: int, dtype: str) -> dict[str, Any]:
    import httpx

    result: dict[str, Any] = {"params": builtin_arch("builtin:tiny", CUDA_MODEL).num_params(), "dtype": dtype,
                              "device": torch.cuda.get_device_name()}
    with tempfile.TemporaryDirectory(prefix="handoff-memory-cycle-cuda-") as tmp:
        run = CudaRun(Path(tmp), dtype)
        torch.cuda.init()
        free_before, total = torch.cuda.mem_get_info()  # this process's own context is already counted
        engine = run.start("engine_cpu_backup", "--enable-memory-saver", "--weights-backup", "cpu")
        try:
            with httpx.Client(base_url=engine.url, timeout=900) as client:
                free_started, _ = torch.cuda.mem_get_info()
                occupation = client.get("/memory_occupation").json()
                tag_bytes = {tag: info["bytes"] for tag, info in occupation["tags"].items()}
                before = greedy(client)
                result["with_backup"] = tag_cycles(client, repeats)
                released = control(client, "/release_memory_occupation", None)
                free_released, _ = torch.cuda.mem_get_info()
                control(client, "/resume_memory_occupation", None)
                after = greedy(client)
        finally:
            engine.stop(timeout=60)
        footprint = free_before - free_started
        result.update(total=total, footprint=footprint, freed=free_released - free_started,
                      share_freed=(free_released - free_started) / footprint, tag_bytes=tag_bytes,
                      release_all_s=released["duration_s"], is_identical_after_cycle=after == before,
                      graph_tokens=before)

        weights_bytes = tag_bytes[MemoryTag.WEIGHTS.value]
        d2h_s, h2d_s = pinned_copy_s(weights_bytes, repeats)
        staged = result["with_backup"][MemoryTag.WEIGHTS.value]
        result.update(pinned_d2h_gb_s=weights_bytes / d2h_s / 1e9, pinned_h2d_gb_s=weights_bytes / h2d_s / 1e9,
                      stage_out_gb_s=weights_bytes / staged["release_s"] / 1e9,
                      stage_in_gb_s=weights_bytes / staged["resume_s"] / 1e9)

        engine = run.start("engine_no_backup", "--enable-memory-saver")
        try:
            with httpx.Client(base_url=engine.url, timeout=900) as client:
                result["without_backup"] = tag_cycles(client, repeats)
        finally:
            engine.stop(timeout=60)

        engine = run.start("engine_eager", "--disable-cuda-graph")
        try:
            with httpx.Client(base_url=engine.url, timeout=900) as client:
                result["is_graph_equal_to_eager"] = greedy(client) == result["graph_tokens"]
        finally:
            engine.stop(timeout=60)
    return result


def print_cuda(r: dict[str, Any]) -> None:
    print(f"\nCUDA: {r['device']}, {r['params'] / 1e9:.2f}B-parameter random Llama in {r['dtype']}\n")
    print(f"engine footprint {r['footprint'] / 2**30:.2f} GiB of {r['total'] / 2**30:.1f} GiB; releasing all four tags "
          f"freed {r['freed'] / 2**30:.2f} GiB = {100 * r['share_freed']:.2f}% (target >= 99.5%) "
          f"in {r['release_all_s'] * 1e3:.1f} ms")
    print("\n| tag | bytes | release (cpu backup) | resume (cpu backup) | release (no backup) | resume (no backup) |")
    print("|---|---:|---:|---:|---:|---:|")
    for tag in (t.value for t in ALL_TAGS):
        w, n = r["with_backup"][tag], r["without_backup"][tag]
        print(f"| {tag} | {r['tag_bytes'][tag] / MiB:.0f} MiB | {w['release_s'] * 1e3:.1f} ms "
              f"(first {w['first_release_s'] * 1e3:.1f}) | {w['resume_s'] * 1e3:.1f} ms "
              f"| {n['release_s'] * 1e3:.1f} ms "
              f"| {n['resume_s'] * 1e3:.1f} ms |")
    print(f"\nweights staging: out {r['stage_out_gb_s']:.2f} GB/s vs pinned D2H {r['pinned_d2h_gb_s']:.2f} GB/s "
          f"= {r['stage_out_gb_s'] / r['pinned_d2h_gb_s']:.2f}; in {r['stage_in_gb_s']:.2f} GB/s vs pinned H2D "
          f"{r['pinned_h2d_gb_s']:.2f} GB/s = {r['stage_in_gb_s'] / r['pinned_h2d_gb_s']:.2f} (target >= 0.80)")
    print(f"greedy output identical after a release/resume cycle with CPU backup: {r['is_identical_after_cycle']}")
    print(f"CUDA-graph decode after resume equals --disable-cuda-graph decode: {r['is_graph_equal_to_eager']}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="tiny,100m", help=f"CPU models, from {sorted(MODELS)}")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--cuda-dtype", default="float32", choices=("float32", "bfloat16"),
                   help="dtype of the CUDA engines (float32 lets graph and eager decode agree exactly)")
    p.add_argument("--skip-cuda", action="store_true")
    p.add_argument("--cpu-child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = p.parse_args()
    if args.cpu_child:
        print(json.dumps(cpu_child(args.cpu_child, args.repeats)))
        return 0
    models = args.models.split(",")
    unknown = [m for m in models if m not in MODELS]
    if unknown:
        p.error(f"unknown models {unknown}; known: {sorted(MODELS)}")
    for m in models:
        arch = builtin_arch("builtin:tiny", MODELS[m])
        print(f"{m}: {arch.num_params() / 1e6:.1f}M parameters")
    results: dict[str, Any] = {"cpu": run_cpu(models, args.repeats)}
    print_cpu(results["cpu"])
    if torch.cuda.is_available() and not args.skip_cuda:
        results["cuda"] = run_cuda(args.repeats, args.cuda_dtype)
        print_cuda(results["cuda"])
    else:
        print("\nCUDA: not available here; the CUDA figures are pending a GPU run.")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
