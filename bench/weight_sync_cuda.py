"""Weight sync into a CUDA engine against plain baselines measured in the same run (issue 15 on a GPU).

One engine on the GPU (torch_memory_saver, CPU weights backup) of the ~0.51B model of ``tests/gpu`` in bf16
(~1 GB of weights); this process is the trainer, on the same GPU, holding the new weights there:

- **tensor, CUDA IPC**: ``update_weights_from_tensor`` with the tensors' CUDA IPC handles, per tensor (the
  ``direct`` form: serialized for every push, as a trainer does) and as one ``flattened_bucket`` (the buffer
  packed once, its handle serialized for every push), against a device-to-device copy of the same bytes
  into tensors that exist already (what loading them costs at the least). Target: 50%.
- **disk**: ``update_weights_from_disk`` of a float32 checkpoint (the engine's own dtype on disk, cast as it
  loads) against ``safetensors.torch.load_file`` and a copy of each tensor into a bf16 tensor on the GPU
  (both from the page cache). Target: 70%.
- **distributed (gloo)**: ``update_weights_from_distributed`` from this process as rank 0 of a gloo group with
  the engine, float32 on the wire, against a raw gloo broadcast of the same tensors to a plain receiver
  process that copies each into a bf16 tensor on the GPU. Target: 70%. (NCCL needs a second GPU: two ranks of
  one communicator cannot share a device.)

Each figure is the median of ``--repeats`` after one untimed run of each side; ratios are baseline time over
handoff time.

    python3 bench/weight_sync_cuda.py [--repeats 3] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from bench.common import median_s  # noqa: E402
from handoff.weight_sync import broadcast_named_tensors, join_weight_group, serialize_named_tensors  # noqa: E402
from node_engine.model.builtin import builtin_arch, builtin_weights, save_checkpoint  # noqa: E402
from tests.gpu.engines import MODEL, GpuEngine, started  # noqa: E402
from tests.support.sglang_payloads import b64, flatten_bucket, serialize  # noqa: E402
from tests.support.trainer import Trainer, free_port  # noqa: E402

MB = 1e6
TARGETS = {"tensor": 0.5, "disk": 0.7, "distributed": 0.7}

# The raw baseline's receiver: rank 1 of 2, receives ``repeats`` rounds into host buffers allocated once and
# copies each tensor into a bf16 tensor on the GPU, ending each round with a barrier.
RECEIVER = """
import json, sys, torch, torch.distributed as dist
from handoff.weight_sync import join_weight_group
port, repeats, shapes = int(sys.argv[1]), int(sys.argv[2]), json.loads(sys.argv[3])
group = join_weight_group(master_address="127.0.0.1", master_port=port, rank=1, world_size=2,
                          group_name="raw", backend="gloo", timeout_s=300)
host = [torch.empty(shape) for shape in shapes]
device = [torch.empty(shape, device="cuda", dtype=torch.bfloat16) for shape in shapes]
for _ in range(repeats):
    for h in [dist.broadcast(b, src=0, group=group, async_op=True) for b in host]:
        h.wait()
    for d, b in zip(device, host):
        d.copy_(b)
    torch.cuda.synchronize()
    dist.barrier(group=group)
dist.destroy_process_group(group)
"""


def timed(run: Callable[[], object], repeats: int) -> float:
    run()  # untimed: an RL loop pushes every step, and the first push also grows the engine's heaps
    return median_s(run, repeats)


def device_copy_s(named: list[tuple[str, torch.Tensor]], repeats: int) -> float:
    targets = [torch.empty_like(t) for _, t in named]

    def copy() -> None:
        for target, (_, tensor) in zip(targets, named):
            target.copy_(tensor)
        torch.cuda.synchronize()

    return timed(copy, repeats)


def bench_tensor(engine: GpuEngine, named: list[tuple[str, torch.Tensor]], repeats: int) -> dict[str, float]:
    answers: list[dict] = []

    def push(payload: Callable[[], str], **fields: object) -> Callable[[], None]:
        def run() -> None:
            r = engine.client.post("/update_weights_from_tensor",
                                   json={"serialized_named_tensors": [payload()], **fields})
            r.raise_for_status()
            answers.append(r.json())
        return run

    direct_s = timed(push(lambda: serialize_named_tensors(named)), repeats)
    print_breakdown("tensor, per tensor", answers[1:], "duration_s")
    answers.clear()
    bucket = flatten_bucket(named)  # packed once; its handle serialized for every push
    flat_s = timed(push(lambda: b64(serialize(bucket)), load_format="flattened_bucket"), repeats)
    print_breakdown("tensor, flattened_bucket", answers[1:], "duration_s")
    return {"direct": direct_s, "flattened_bucket": flat_s, "baseline": device_copy_s(named, repeats)}


def print_breakdown(what: str, answers: list[dict], *fields: str) -> None:
    """The engine's own timing of the timed calls (medians): what it answered in and its engine thread's share."""
    parts = ", ".join(f"{name} {statistics.median(a[name] for a in answers) * 1e3:.1f} ms"
                      for name in (*fields, "commit_s"))
    print(f"  {what}: the engine's {parts}", flush=True)


def bench_disk(engine: GpuEngine, folder: Path, host: dict[str, torch.Tensor], repeats: int) -> dict[str, float]:
    from safetensors.torch import load_file

    files = sorted(folder.glob("*.safetensors"))
    for path in files:  # into the page cache, for both sides
        path.read_bytes()
    targets = {name: torch.empty(t.shape, device="cuda", dtype=torch.bfloat16) for name, t in host.items()}

    answers: list[dict] = []

    def reload() -> None:
        r = engine.client.post("/update_weights_from_disk", json={"model_path": str(folder)})
        r.raise_for_status()
        answers.append(r.json())

    def plain() -> None:
        for path in files:
            for name, tensor in load_file(path).items():
                targets[name].copy_(tensor)
        torch.cuda.synchronize()

    reload_s = timed(reload, repeats)
    print_breakdown("disk reload", answers[1:], "read_s", "duration_s")
    return {"reload": reload_s, "baseline": timed(plain, repeats)}


def bench_gloo(engine: GpuEngine, host: dict[str, torch.Tensor], repeats: int) -> dict[str, float]:
    named = list(host.items())
    trainer = Trainer(engine.proc.url, world_size=2, rank_offset=1, group_name="bench_gloo")
    trainer.join(timeout_s=120).raise_for_status()
    handoff_s = timed(lambda: trainer.push(named, flush_cache=True).raise_for_status(), repeats)
    trainer.leave().raise_for_status()

    port = free_port()
    shapes = json.dumps([list(t.shape) for t in host.values()])
    receiver = subprocess.Popen([sys.executable, "-c", RECEIVER, str(port), str(repeats + 1), shapes], cwd=REPO_ROOT)
    group = join_weight_group(master_address="127.0.0.1", master_port=port, rank=0, world_size=2,
                              group_name="raw", backend="gloo", timeout_s=300)

    def raw() -> None:
        broadcast_named_tensors(group, list(host.values()))
        dist.barrier(group=group)

    raw_s = timed(raw, repeats)
    dist.destroy_process_group(group)
    receiver.wait(60)
    return {"distributed": handoff_s, "baseline": raw_s}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    arch = builtin_arch("builtin:tiny", MODEL)
    host = builtin_weights(arch, seed=9)
    named = [(name, t.to("cuda", torch.bfloat16)) for name, t in host.items()]
    num_bytes = sum(t.numel() * t.element_size() for _, t in named)
    print(f"{torch.cuda.get_device_name()}: {arch.num_params() / 1e6:.0f}M parameters, {num_bytes / MB:.0f} MB "
          f"of bf16 weights in {len(named)} tensors; medians of {args.repeats}\n", flush=True)
    started_at = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench-weights-cuda-") as tmp:
        tmp_path = Path(tmp)
        save_checkpoint(tmp_path / "ckpt", arch, host)
        with started(tmp_path / "logs", "bench_weights_cuda", "--enable-memory-saver", "--weights-backup", "cpu",
                     "--mem-fraction", "0.5") as engine:
            tensor = bench_tensor(engine, named, args.repeats)
            disk = bench_disk(engine, tmp_path / "ckpt", host, args.repeats)
            gloo = bench_gloo(engine, host, args.repeats)
    rows = [
        ("tensor, CUDA IPC per tensor (direct)", "device copy", tensor["direct"], tensor["baseline"], "tensor"),
        ("tensor, CUDA IPC flattened_bucket", "device copy", tensor["flattened_bucket"], tensor["baseline"],
         "tensor"),
        ("disk reload (float32 file)", "load_file + copy to GPU", disk["reload"], disk["baseline"], "disk"),
        ("distributed, gloo (float32)", "raw gloo + copy to GPU", gloo["distributed"], gloo["baseline"],
         "distributed"),
    ]
    print("\n| path | handoff | GB/s (bf16 bytes) | baseline | baseline time | ratio | target |")
    print("|---|---:|---:|---|---:|---:|---:|")
    for name, baseline, handoff_s, base_s, key in rows:
        print(f"| {name} | {handoff_s * 1e3:.1f} ms | {num_bytes / 1e9 / handoff_s:.1f} | {baseline} | "
              f"{base_s * 1e3:.1f} ms | {base_s / handoff_s:.0%} | {TARGETS[key]:.0%} |")
    print(f"\n({time.perf_counter() - started_at:.0f} s in all)")
    if args.json:
        args.json.write_text(json.dumps({"bytes": num_bytes, "rows": [
            {"path": r[0], "baseline": r[1], "handoff_s": r[2], "baseline_s": r[3]} for r in rows]}, indent=2))


if __name__ == "__main__":
    main()
