"""Weight sync without disk, and the bounded disk reload, against plain baselines measured in the same run.

On a local cluster (LB + 2 nodes, CPU) of the engine benchmarks' ~100M model
(``bench/common.py``, float32: ~416 MB of weights), with new weights of the same shape:

- **distributed**: ``update_weights_from_distributed`` through the LB (the trainer,
  this process, is rank 0 of a gloo group with both nodes; one broadcast per
  tensor, loaded and answered by both nodes) against a raw gloo broadcast of the
  same tensors from this process to two plain receiver processes (ending with a
  barrier, so the time covers the receivers). Target: 70% of the raw throughput.
- **tensor**: ``update_weights_from_tensor`` to one node (its payload the tensors'
  shared memory, already shared: the steady state of a trainer that keeps its
  weights there; the first sharing is reported apart) against a memcpy of the
  same bytes in this process. Target: 50%.
- **disk**: ``update_weights_from_disk`` on one node (through its sidecar)
  against loading the same checkpoint in this process: ``safetensors.torch.load_file``
  and a copy of each tensor into one that exists already, as a reload loads into
  the model's parameters (both from the page cache: the file is read once before
  timing). Target: 70%.

Each figure is the median of ``--repeats`` runs after one untimed run of each side (an RL loop pushes every
step: the first push also grows the engine's heap, as the baselines fault their targets in once); ratios are
baseline time over handoff time.

    .venv/bin/python bench/weight_sync.py                       # all three, 100m
    .venv/bin/python bench/weight_sync.py --model tiny --repeats 3 --only tensor
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

import httpx  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from bench.common import MODELS, median_s  # noqa: E402
from handoff.cluster.local import ClusterSpec, LocalCluster  # noqa: E402
from handoff.weight_sync import broadcast_named_tensors, join_weight_group, serialize_named_tensors  # noqa: E402
from node_engine.model.builtin import builtin_arch, builtin_weights, save_checkpoint  # noqa: E402
from tests.support.trainer import distributed_body, free_port  # noqa: E402

MB = 1e6
TARGETS = {"distributed": 0.7, "tensor": 0.5, "disk": 0.7}

# A plain receiver of the raw baseline: joins the group (rank 1 or 2 of 3), receives ``repeats`` rounds of the
# same tensors into buffers allocated once, ends each round with a barrier.
RECEIVER = """
import json, sys, torch, torch.distributed as dist
from handoff.weight_sync import join_weight_group
port, rank, repeats, specs = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), json.loads(sys.argv[4])
group = join_weight_group(master_address="127.0.0.1", master_port=port, rank=rank, world_size=3,
                          group_name="raw", backend="gloo", timeout_s=300)
buffers = [torch.empty(shape, dtype=getattr(torch, dtype)) for dtype, shape in specs]
for _ in range(repeats):
    handles = [dist.broadcast(b, src=0, group=group, async_op=True) for b in buffers]
    for h in handles:
        h.wait()
    dist.barrier(group=group)
dist.destroy_process_group(group)
"""


def bench_distributed(cluster: LocalCluster, named: list[tuple[str, torch.Tensor]], repeats: int) -> tuple[float, float]:
    port = free_port()
    init = {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 3,
            "group_name": "bench", "backend": "gloo"}
    with ThreadPoolExecutor(1) as pool:
        answer = pool.submit(httpx.post, cluster.url + "/init_weights_update_group", json=init, timeout=600)
        group = join_weight_group(master_address="127.0.0.1", master_port=port, rank=0, world_size=3,
                                  group_name="bench", backend="gloo", timeout_s=300)
        answer.result().raise_for_status()
    body = distributed_body(named, "bench", flush_cache=True)
    tensors = [t for _, t in named]
    answers: list[dict] = []

    def push() -> None:
        with ThreadPoolExecutor(1) as pool:
            call = pool.submit(httpx.post, cluster.url + "/update_weights_from_distributed", json=body, timeout=600)
            broadcast_named_tensors(group, tensors)
            answer = call.result()
            answer.raise_for_status()
            answers.append(answer.json())

    push()  # warm: an RL loop pushes every step; the first push also grows the engine's heap
    handoff_s = median_s(push, repeats)
    for result in answers[-1]["results"]:
        print(f"  {result['node']}: received in {result['body']['receive_s']:.3f} s, loaded and answered in "
              f"{result['body']['duration_s']:.3f} s (the engine thread held for {result['body']['commit_s']:.3f} s)")
    httpx.post(cluster.url + "/destroy_weights_update_group", json={"group_name": "bench"}, timeout=60)
    dist.destroy_process_group(group)

    port = free_port()
    specs = json.dumps([[str(t.dtype).removeprefix("torch."), list(t.shape)] for t in tensors])
    receivers = [subprocess.Popen([sys.executable, "-c", RECEIVER, str(port), str(rank), str(repeats + 1), specs],
                                  cwd=REPO_ROOT) for rank in (1, 2)]
    group = join_weight_group(master_address="127.0.0.1", master_port=port, rank=0, world_size=3,
                              group_name="raw", backend="gloo", timeout_s=300)

    def raw() -> None:
        broadcast_named_tensors(group, tensors)
        dist.barrier(group=group)

    raw()  # warm, as the pushes
    raw_s = median_s(raw, repeats)
    dist.destroy_process_group(group)
    for receiver in receivers:
        receiver.wait(60)
    return handoff_s, raw_s


def bench_tensor(cluster: LocalCluster, named: list[tuple[str, torch.Tensor]], repeats: int
                 ) -> tuple[float, float, float]:
    node = cluster.nodes[0].url
    started = time.perf_counter()
    payload = serialize_named_tensors(named)  # the first sharing moves the tensors into shared memory
    share_s = time.perf_counter() - started

    engine_s: list[float] = []
    commit_s: list[float] = []

    def push() -> None:
        answer = httpx.post(cluster.url + "/update_weights_from_tensor", params={"node": node},
                            json={"serialized_named_tensors": [serialize_named_tensors(named)]}, timeout=600)
        answer.raise_for_status()
        engine_s.append(answer.json()["results"][0]["body"]["duration_s"])
        commit_s.append(answer.json()["results"][0]["body"]["commit_s"])

    del payload
    push()  # warm, as the distributed pushes
    engine_s.clear()
    commit_s.clear()
    handoff_s = median_s(push, repeats)
    print(f"  tensor: the engine unpickled, checked and loaded in {statistics.median(engine_s):.3f} s, its "
          f"engine thread held for {statistics.median(commit_s):.3f} s (medians)")
    targets = [torch.empty_like(t) for _, t in named]

    def memcpy() -> None:
        for target, (_, tensor) in zip(targets, named):
            target.copy_(tensor)

    memcpy()  # the targets' pages faulted in once, as the engine's parameters are
    return handoff_s, median_s(memcpy, repeats), share_s


def bench_disk(cluster: LocalCluster, folder: Path, named: list[tuple[str, torch.Tensor]], repeats: int
               ) -> tuple[float, float]:
    """The reload against loading the same file into tensors that exist already (as a reload loads into the
    model's parameters): ``load_file`` (it maps the file; the copy reads it) and a copy into each tensor."""
    from safetensors.torch import load_file

    node = cluster.nodes[0].url
    files = sorted(folder.glob("*.safetensors"))
    for path in files:  # into the page cache, for both sides
        path.read_bytes()
    targets = {name: torch.empty_like(tensor) for name, tensor in named}

    answers: list[dict] = []

    def reload() -> None:
        answer = httpx.post(node + "/update_weights_from_disk", json={"model_path": str(folder)}, timeout=600)
        answer.raise_for_status()
        answers.append(answer.json())

    def plain() -> None:
        for path in files:
            for name, tensor in load_file(path).items():
                targets[name].copy_(tensor)

    plain()  # the targets' pages faulted in once
    reload()  # and the engine's heap grown once
    answers.clear()
    reload_s = median_s(reload, repeats)
    print(f"  disk: the engine read the checkpoint in {statistics.median(a['read_s'] for a in answers):.3f} s, "
          f"read and loaded it in {statistics.median(a['duration_s'] for a in answers):.3f} s, its engine thread "
          f"held for {statistics.median(a['commit_s'] for a in answers):.3f} s (medians)")
    return reload_s, median_s(plain, repeats)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=list(MODELS), default="100m")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--only", choices=list(TARGETS), action="append")
    args = parser.parse_args()
    only = args.only or list(TARGETS)
    override = MODELS[args.model]
    arch = builtin_arch("builtin:tiny", override)
    new = builtin_weights(arch, seed=9)
    named = list(new.items())
    num_bytes = sum(t.numel() * t.element_size() for _, t in named)
    print(f"model {args.model}: {arch.num_params() / 1e6:.1f}M parameters, {num_bytes / MB:.0f} MB of weights "
          f"(float32), {len(named)} tensors; medians of {args.repeats}\n")
    spec = ClusterSpec(num_mixed=2, model_override=json.dumps(override) if override else None)
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-weights-") as tmp, LocalCluster(spec, Path(tmp) / "logs") as cluster:
        if "distributed" in only:
            handoff_s, raw_s = bench_distributed(cluster, named, args.repeats)
            rows.append(("distributed, 2 nodes", "raw gloo broadcast to 2 receivers", handoff_s, raw_s,
                         "distributed"))
        if "tensor" in only:
            handoff_s, memcpy_s, share_s = bench_tensor(cluster, named, args.repeats)
            rows.append(("tensor, 1 node", "memcpy", handoff_s, memcpy_s, "tensor"))
            print(f"(first sharing of the tensors into shared memory: {share_s:.3f} s, "
                  f"{num_bytes / MB / share_s:.0f} MB/s)")
        if "disk" in only:
            folder = Path(tmp) / "ckpt"
            save_checkpoint(folder, arch, new)
            handoff_s, plain_s = bench_disk(cluster, folder, named, args.repeats)
            rows.append(("disk reload, 1 node", "safetensors load_file into tensors", handoff_s, plain_s, "disk"))
    print("\n| path | handoff | MB/s | baseline | baseline MB/s | ratio | target |")
    print("|---|---:|---:|---|---:|---:|---:|")
    for name, baseline, handoff_s, base_s, key in rows:
        print(f"| {name} | {handoff_s:.3f} s | {num_bytes / MB / handoff_s:.0f} | {baseline}: {base_s:.3f} s | "
              f"{num_bytes / MB / base_s:.0f} | {base_s / handoff_s:.0%} | {TARGETS[key]:.0%} |")


if __name__ == "__main__":
    main()
