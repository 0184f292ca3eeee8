"""Memory of a vision-language engine: image bursts against the reservation, and the KV pool's size.

Part A: peak resident memory of 64 concurrent image requests (one large
image each), above what the engine held before them (weights, KV pool,
reservation), with and without the per-step visual budget and the
``--max-image-tokens`` clamp, against the vision reservation measured at start
for the guarded configuration. The model is ``builtin:tiny-vl`` saved with
Qwen2-VL-7B's processor bounds (up to 16384 tokens per image), so an
unclamped 1008 x 1008 image is 1296 tokens. The bound a step must stay within
is the reservation plus the text activation peak the KV sizing measures
(``ModelRunner.stress``: a full prefill chunk, the maximum decode batch).

Part B: the KV pool the engine sizes from measured peaks (``--memory-budget-mb``)
against the pool a fixed fraction of the free memory gives (0.85, as
``--mem-fraction`` and SGLang's ``mem_fraction_static`` do), for a tight and a
generous budget: each pool is allocated and driven through the same prefill and
decode stress, and its peak compared with the budget.

Every configuration runs in a fresh child process (no allocator history). CPU only.

    .venv/bin/python bench/vision_memory.py              # both parts
    .venv/bin/python bench/vision_memory.py --part a
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

MiB = 2**20
NUM_REQUESTS = 64
IMAGE_SIDE = 1008
MAX_BATCH_TOKENS = 8192
# (name, --max-image-tokens, --visual-batch-max-tokens, --vision-reserve-mb)
BURST_CONFIGS = [
    ("budget + clamp", 256, 1024, None),
    ("clamp only", 256, 0, 0),
    ("budget only", 16384, 1024, 0),
    ("neither", 16384, 0, 0),
]
KV_BUDGETS_MB = [900, 6000]
FRACTION = 0.85


def _vl_checkpoint(folder: Path) -> None:
    from node_engine.model.builtin import builtin_arch, builtin_weights, save_checkpoint
    from node_engine.vision.processor import ProcessorConfig

    arch = builtin_arch("builtin:tiny-vl")
    save_checkpoint(folder, arch, builtin_weights(arch, 0))
    large = ProcessorConfig(min_pixels=56 * 56, max_pixels=28 * 28 * 16384)  # Qwen2-VL-7B-Instruct's
    (folder / "preprocessor_config.json").write_text(json.dumps(large.to_json()))


def run_burst(folder: str, max_image_tokens: int, visual_budget: int, reserve_mb: int | None) -> dict[str, Any]:
    """In the child: 64 concurrent image requests on an in-process engine; the peak RSS above the start."""
    import numpy as np
    from PIL import Image

    from node_engine.config import EngineConfig
    from node_engine.engine import Engine
    from node_engine.memory.host_heap import trim_host_heap
    from node_engine.memory.peak import HostPeakMeter
    from node_engine.sampling import SamplingParams
    from node_engine.vision.placeholders import expand

    config = EngineConfig(model_path=folder, max_image_tokens=max_image_tokens, visual_batch_max_tokens=visual_budget,
                          vision_reserve_mb=reserve_mb, max_batch_tokens=MAX_BATCH_TOKENS,
                          max_total_tokens=NUM_REQUESTS * 2400, max_running_requests=NUM_REQUESTS)
    engine = Engine(config)
    vision = engine.vision
    rng = np.random.default_rng(0)
    prompts = []
    for n in range(NUM_REQUESTS):
        image = Image.fromarray(rng.integers(0, 256, (IMAGE_SIDE, IMAGE_SIDE, 3), dtype=np.uint8))
        prompt = [256] + list(b"describe ") + [258, 260, 259] + list(f" #{n}?".encode())
        prompts.append(expand(prompt, [vision.processor.resize(image)], engine.arch.vision, vision.processor))
    encoded: list[int] = []
    encode = vision.encoder.encode

    def counting_encode(images):
        encoded.append(sum(image.num_tokens for image in images))
        encode(images)

    vision.encoder.encode = counting_encode
    params = SamplingParams(max_new_tokens=8, temperature=0, ignore_eos=True)
    meter = HostPeakMeter()

    async def burst() -> float:
        engine.start(asyncio.get_running_loop())
        try:
            started = time.perf_counter()
            handles = [engine.submit(ids, params, mm=mm) for ids, mm in prompts]
            for handle in handles:
                while not (await asyncio.wait_for(handle.next(), timeout=1800)).is_final:
                    pass
            return time.perf_counter() - started
        finally:
            engine.stop()

    trim_host_heap()
    meter.reset()
    before = meter.current_bytes()
    seconds = asyncio.run(burst())
    peak = meter.peak_bytes() - before
    trim_host_heap()  # the text activation peak, measured as the KV sizing does
    meter.reset()
    activation_before = meter.current_bytes()
    engine.runner.stress(engine.runner.kv_plan.num_slots)
    activation = meter.peak_bytes() - activation_before
    reservation = vision.reservation.num_bytes if vision.reservation else 0
    return {"peak_above_start_mb": peak / MiB, "reservation_mb": reservation / MiB,
            "activation_mb": activation / MiB, "image_tokens": prompts[0][1].images[0].num_tokens,
            "max_step_image_tokens": max(encoded), "vision_steps": len(encoded), "seconds": seconds}


def run_kv(budget_mb: int, use_fraction: bool) -> dict[str, Any]:
    """In the child: the profiled pool (or the fixed-fraction one) and its stress peak against the budget."""
    from node_engine.config import EngineConfig
    from node_engine.memory.host_heap import trim_host_heap
    from node_engine.memory.peak import HostPeakMeter
    from node_engine.memory.saver import DisabledSaver
    from node_engine.model.source import load_model_source
    from node_engine.runner import ModelRunner

    meter = HostPeakMeter()
    if not use_fraction:
        config = EngineConfig(model_path="builtin:tiny-vl", memory_budget_mb=budget_mb)
        arch, _ = load_model_source(config)
        runner = ModelRunner(config, DisabledSaver(), arch)
        report = runner.kv_sizing
        num_slots = runner.kv_plan.num_slots
        extra = {"activation_peak_mb": report.activation_peak_bytes / MiB, "attempts": len(report.attempts),
                 "first_attempt": report.attempts[0].outcome}
    else:
        config = EngineConfig(model_path="builtin:tiny-vl", max_total_tokens=2048)
        arch, _ = load_model_source(config)
        runner = ModelRunner(config, DisabledSaver(), arch)  # weights, reservation and a small pool
        runner.bind_pool(None)
        runner.kv_cache = None
        trim_host_heap()
        free = budget_mb * MiB - meter.current_bytes()
        num_slots = int(FRACTION * free) // runner.bytes_per_slot
        runner.kv_cache = runner.allocate_pool(num_slots)
        runner.bind_pool(runner.kv_cache)
        extra = {}
    trim_host_heap()
    meter.reset()
    runner.stress(num_slots)
    peak = meter.peak_bytes()
    return {"slots": num_slots, "pool_mb": num_slots * runner.bytes_per_slot / MiB, "peak_mb": peak / MiB,
            "budget_mb": budget_mb, "over_budget_mb": (peak - budget_mb * MiB) / MiB, **extra}


def _child(args: list[str]) -> dict[str, Any]:
    out = subprocess.run([sys.executable, __file__, "--child", *args], capture_output=True, text=True, cwd=REPO_ROOT,
                         timeout=3600)
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-3000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def part_a() -> None:
    folder = Path(tempfile.mkdtemp(prefix="bench-vl-"))
    _vl_checkpoint(folder)
    print(f"## A. {NUM_REQUESTS} concurrent requests, one {IMAGE_SIDE} x {IMAGE_SIDE} image each "
          f"(--max-batch-tokens {MAX_BATCH_TOKENS})\n")
    print("| configuration | --max-image-tokens | --visual-batch-max-tokens | tokens per image | most image tokens "
          "in one step | peak RSS above start | / vision reservation | / (reservation + text activation peak) | "
          "time |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    bound = None
    for name, cap, budget, reserve in BURST_CONFIGS:
        r = _child(["burst", str(folder), str(cap), str(budget), "none" if reserve is None else str(reserve)])
        if bound is None:
            bound = (r["reservation_mb"], r["activation_mb"])
        peak = r["peak_above_start_mb"]
        print(f"| {name} | {cap} | {budget or 'off'} | {r['image_tokens']} | {r['max_step_image_tokens']} | "
              f"{peak:.1f} MiB | {peak / bound[0]:.2f} | {peak / sum(bound):.2f} | {r['seconds']:.1f} s |",
              flush=True)
    print(f"\nVision reservation (measured at the guarded configuration's start): {bound[0]:.1f} MiB; text "
          f"activation peak (the KV sizing's stress, same engine): {bound[1]:.1f} MiB. The other configurations "
          "start with --vision-reserve-mb 0.\n")


def part_b() -> None:
    print(f"## B. KV pool sized from measured peaks against {FRACTION} of the free memory (builtin:tiny-vl, "
          "context 4096, --max-batch-tokens 2048, --max-running-requests 64)\n")
    print("| budget | sizing | KV slots | pool | stress peak | peak - budget | outcome |")
    print("|---:|---|---:|---:|---:|---:|---|")
    for budget in KV_BUDGETS_MB:
        for use_fraction in (False, True):
            r = _child(["kv", str(budget), "fraction" if use_fraction else "profiled"])
            over = r["over_budget_mb"]
            outcome = "over the budget (an OOM on a device)" if over > 0 else f"{-over:.0f} MiB unused"
            sizing = f"fixed fraction {FRACTION}" if use_fraction else \
                f"profiled (activation peak {r['activation_peak_mb']:.0f} MiB, {r['attempts']} attempt(s): " \
                f"{r['first_attempt']})"
            print(f"| {budget} MiB | {sizing} | {r['slots']} | {r['pool_mb']:.0f} MiB | {r['peak_mb']:.0f} MiB | "
                  f"{over:+.0f} MiB | {outcome} |", flush=True)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        kind, rest = sys.argv[2], sys.argv[3:]
        if kind == "burst":
            result = run_burst(rest[0], int(rest[1]), int(rest[2]), None if rest[3] == "none" else int(rest[3]))
        else:
            result = run_kv(int(rest[0]), rest[1] == "fraction")
        print(json.dumps(result))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=("a", "b", "both"), default="both")
    args = parser.parse_args()
    if args.part in ("a", "both"):
        part_a()
    if args.part in ("b", "both"):
        part_b()


if __name__ == "__main__":
    main()
