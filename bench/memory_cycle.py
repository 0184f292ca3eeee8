"""What each memory tag of node_engine holds, and what releasing and resuming it costs.

CPU (always; the project's CPU backend, ``--weights-backup disk``), for
``builtin:tiny`` and a ~100M-parameter random Llama, each in a fresh child
process: per-tag bytes; process RSS before and after releasing each tag and
after resuming it; release/resume latency per tag; the disk backup's spill and
restore bandwidth against a plain write and read of the same bytes to the same
directory in the same run; and what stays outside every region (the Python and
torch runtime, the tokenizer, the rotary tables, per-step tensors). Logits are
checked bit for bit after a full cycle.

CUDA (``--device cuda``, or by default when ``torch.cuda.is_available()``): engine
processes with the torch_memory_saver backend, measured from outside; see
``bench/memory_cycle_cuda.py`` for what is printed (bytes freed per tag from
device free memory, latencies, staging against a pinned memcpy, the residue
by part, outputs after a cycle with graphs).

    .venv/bin/python bench/memory_cycle.py                  # CPU tables (and CUDA ones on a GPU box)
    .venv/bin/python bench/memory_cycle.py --models tiny --repeats 5
    .venv/bin/python bench/memory_cycle.py --device cuda --cuda-model 0.5b --cuda-dtype bfloat16
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
from bench.memory_cycle_cuda import CUDA_MODELS, print_cuda, run_cuda  # noqa: E402
from node_engine.memory.headroom import step_bytes  # noqa: E402
from node_engine.memory.tags import ALL_TAGS, MemoryTag  # noqa: E402
from node_engine.model.builtin import builtin_arch  # noqa: E402

PROMPT = [256] + [(7 * i) % 256 for i in range(63)]
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
            "decode_step_bytes": step_bytes(arch, num_tokens=8, num_seqs=8, total_keys=8 * 128,
                                            itemsize=engine.runner.dtype.itemsize),
            "prefill_step_bytes": step_bytes(arch, num_tokens=config.max_batch_tokens, num_seqs=1,
                                             total_keys=config.max_batch_tokens, itemsize=engine.runner.dtype.itemsize),
            "step_headroom_bytes": engine.runner.step_headroom_bytes,
            "kv_bytes": engine.runner.kv_cache.nbytes, "zero_kv_s": zero_kv_s(engine, repeats),
        }


def zero_kv_s(engine: Any, repeats: int) -> float:
    """Median seconds to zero the whole KV pool, what a resume costs where the saver gives undefined pages
    (CUDA); the CPU backend's resume zeroes as it takes the pages back."""
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        engine.runner.kv_cache.zero_()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


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
          "| rotary tables | decode step, 8 seqs x 128 keys | prefill chunk, 2048 tokens | resume headroom |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in results:
        print(f"| {r['model']} | {r['params'] / 1e6:.1f}M | {r['rss_runtime'] / MiB:.0f} MiB "
              f"| {r['rss_tokenizer'] / MiB:.2f} MiB | {r['rss_engine'] / MiB:.1f} MiB "
              f"| {r['all_bytes'] / MiB:.1f} MiB "
              f"| {r['rotary_bytes'] / MiB:.2f} MiB | {r['decode_step_bytes'] / MiB:.2f} MiB "
              f"| {r['prefill_step_bytes'] / MiB:.1f} MiB | {r['step_headroom_bytes'] / MiB:.1f} MiB |")
    print("\nZeroing the whole KV pool (what a CUDA resume of kv_cache adds; medians):\n")
    print("| model | KV pool | zero_() | bandwidth |")
    print("|---|---:|---:|---:|")
    for r in results:
        print(f"| {r['model']} | {r['kv_bytes'] / MiB:.1f} MiB | {r['zero_kv_s'] * 1e3:.2f} ms "
              f"| {r['kv_bytes'] / r['zero_kv_s'] / 1e9:.1f} GB/s |")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("cpu", "cuda"), default=None,
                   help="measure only this backend (default: CPU, and CUDA when a GPU is visible)")
    p.add_argument("--models", default="tiny,100m", help=f"CPU models, from {sorted(MODELS)}")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--cuda-model", default="0.5b", choices=sorted(CUDA_MODELS), help="model of the CUDA engines")
    p.add_argument("--cuda-dtype", default="bfloat16", choices=("float32", "bfloat16"),
                   help="dtype of the CUDA engines (bfloat16 is the CUDA default; float32 also compares CUDA-graph "
                        "decode with eager decode token for token)")
    p.add_argument("--cpu-child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = p.parse_args()
    if args.cpu_child:
        print(json.dumps(cpu_child(args.cpu_child, args.repeats)))
        return 0
    results: dict[str, Any] = {}
    if args.device in (None, "cpu"):
        models = args.models.split(",")
        unknown = [m for m in models if m not in MODELS]
        if unknown:
            p.error(f"unknown models {unknown}; known: {sorted(MODELS)}")
        for m in models:
            arch = builtin_arch("builtin:tiny", MODELS[m])
            print(f"{m}: {arch.num_params() / 1e6:.1f}M parameters")
        results["cpu"] = run_cpu(models, args.repeats)
        print_cpu(results["cpu"])
    if args.device == "cuda" or (args.device is None and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            p.error("--device cuda: CUDA is not available on this machine")
        results["cuda"] = run_cuda(args.cuda_model, args.cuda_dtype, max(2, args.repeats))
        print_cuda(results["cuda"])
    elif args.device is None:
        print("\nCUDA: not available here; on a GPU, bench/memory_cycle.py --device cuda (the H200 figures are in "
              "docs/benchmarks.md).")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
