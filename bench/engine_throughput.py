"""Decode throughput of node_engine against transformers ``generate``, same weights, same run.

For each model (``builtin:tiny`` and a ~100M-parameter random Llama built from
it with overrides) the script writes a Hugging Face folder, loads it once into
the engine (in-process: ``Engine`` on an asyncio loop, no HTTP) and once into
``transformers.LlamaForCausalLM`` (float32, CPU), and runs the same greedy
batches on both: ``batch`` prompts of ``--prompt-len`` tokens, ``--new-tokens``
new tokens each, EOS ignored.

Decode tokens/s counts only what is generated after every sequence has its
first token, over the time it took: prefill and the first token are excluded
on both sides. The engine's time is a full run's minus that of a run of the
same prompts for 1 new token (prefill and the first token); transformers' is
read by a logits processor called once per generated token, from the first
token's logits to the last's. Every
figure is the median of ``--repeats`` runs after one warm-up run; runs
alternate engine, transformers, engine, ... and the ratio is the median over
those pairs of engine / transformers, so both sides of a ratio saw the same
machine load. Each engine mode of ``--modes`` gets its own rows: ``eager`` (the
default engine) and ``compile`` (``--enable-torch-compile``: decode through a
graph compiled at start, whose compile time is not counted). With
``--http-batch`` the engine is also started as a server process, in each mode,
and measured through ``POST /generate`` at that batch size (decode rate from
the difference between ``--new-tokens`` and 1 new token).

    .venv/bin/python bench/engine_throughput.py            # the table of docs/benchmarks.md
    .venv/bin/python bench/engine_throughput.py --models tiny --batch-sizes 8 --repeats 5
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

import httpx  # noqa: E402
import torch  # noqa: E402

from bench.common import MODELS  # noqa: E402
from handoff.cluster.process import ServerProcess  # noqa: E402
from node_engine.config import EngineConfig  # noqa: E402
from node_engine.engine import Engine  # noqa: E402
from node_engine.model.builtin import BYTE_BOS_ID, builtin_arch, builtin_weights, save_checkpoint  # noqa: E402
from node_engine.sampling import SamplingParams  # noqa: E402



@dataclass
class Measurement:
    num_decode_tokens: int
    decode_s: float
    output_ids: list[list[int]]

    @property
    def tokens_per_s(self) -> float:
        return self.num_decode_tokens / self.decode_s


def make_prompts(batch: int, prompt_len: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [[BYTE_BOS_ID] + torch.randint(0, 256, (prompt_len - 1,), generator=gen).tolist() for _ in range(batch)]


def write_model(folder: Path, overrides: dict[str, Any]) -> int:
    """Save the built-in model with ``overrides`` as a HF folder; returns its parameter count."""
    arch = builtin_arch("builtin:tiny", overrides)
    save_checkpoint(folder, arch, builtin_weights(arch, seed=0))
    return arch.num_params()


# -- engine, in-process ------------------------------------------------------------
async def _engine_run(engine: Engine, prompts: list[list[int]], params: SamplingParams) -> tuple[float, list[list[int]]]:
    """Seconds from submitting ``prompts`` (non-streaming) until the last answer, and the answers."""
    for ids in prompts:
        engine.gate.check(ids, params)
    started = time.perf_counter()
    handles = [engine.submit(ids, params) for ids in prompts]
    output_ids: list[list[int]] = [[] for _ in prompts]

    async def follow(index: int) -> None:
        while True:
            out = await handles[index].next()
            output_ids[index].extend(out.token_ids_delta)
            if out.is_final:
                if out.error is not None:
                    raise RuntimeError(f"engine request failed: {out.error}")
                return

    await asyncio.gather(*(follow(i) for i in range(len(prompts))))
    return time.perf_counter() - started, output_ids


async def engine_decode(engine: Engine, prompts: list[list[int]], num_new: int) -> Measurement:
    """Decode tokens/s: a full run minus a 1-token run (prefill and first token), as RL rollouts use it
    (non-streaming requests, which the engine answers once, when they finish)."""
    greedy = dict(temperature=0.0, ignore_eos=True)
    first_s, _ = await _engine_run(engine, prompts, SamplingParams(max_new_tokens=1, **greedy))
    total_s, output_ids = await _engine_run(engine, prompts, SamplingParams(max_new_tokens=num_new, **greedy))
    return Measurement(len(prompts) * (num_new - 1), max(total_s - first_s, 1e-9), output_ids)


# -- transformers ---------------------------------------------------------------------
class StepClock:
    """A logits processor that only records when each generation step's logits are ready."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self.times.append(time.perf_counter())
        return scores


def hf_decode(model: Any, prompts: list[list[int]], num_new: int) -> Measurement:
    from transformers import LogitsProcessorList

    clock = StepClock()
    input_ids = torch.tensor(prompts)
    with torch.inference_mode():
        out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=num_new,
                             min_new_tokens=num_new, do_sample=False, eos_token_id=None, pad_token_id=0,
                             logits_processor=LogitsProcessorList([clock]))
    if len(clock.times) != num_new:
        raise RuntimeError(f"transformers ran {len(clock.times)} steps, expected {num_new}")
    return Measurement(len(prompts) * (num_new - 1), clock.times[-1] - clock.times[0],
                       out[:, input_ids.shape[1]:].tolist())


# -- engine over HTTP -------------------------------------------------------------------
def http_generate_s(client: httpx.Client, prompts: list[list[int]], num_new: int) -> float:
    body = {"input_ids": prompts,
            "sampling_params": {"max_new_tokens": num_new, "temperature": 0, "ignore_eos": True}}
    started = time.perf_counter()
    r = client.post("/generate", json=body)
    elapsed = time.perf_counter() - started
    if r.status_code != 200:
        raise RuntimeError(f"/generate answered {r.status_code}: {r.text[:500]}")
    return elapsed


def http_decode_rate(folder: Path, prompts: list[list[int]], num_new: int, repeats: int,
                     num_threads: int | None, mode: str) -> float:
    """Decode tokens/s through HTTP: (time for num_new tokens - time for 1) over the tokens in between."""
    with tempfile.TemporaryDirectory() as log_dir:
        argv = ["--model-path", str(folder), "--log-level", "warning",
                "--max-running-requests", str(max(64, len(prompts)))]
        if num_threads:
            argv += ["--num-threads", str(num_threads)]
        if mode == "compile":
            argv.append("--enable-torch-compile")
        server = ServerProcess("node_engine", argv, log_dir=Path(log_dir), name="engine",
                               cwd=REPO_ROOT).start(timeout=300)
        try:
            with httpx.Client(base_url=server.url, timeout=600) as client:
                http_generate_s(client, prompts, num_new)  # warm-up
                rates = []
                for _ in range(repeats):
                    one = http_generate_s(client, prompts, 1)
                    full = http_generate_s(client, prompts, num_new)
                    rates.append(len(prompts) * (num_new - 1) / (full - one))
        finally:
            server.stop()
    return statistics.median(rates)


# -- driver -----------------------------------------------------------------------------
def median_rate(runs: list[Measurement]) -> float:
    return statistics.median(m.tokens_per_s for m in runs)


async def bench_engine_mode(name: str, mode: str, folder: Path, num_params: int, reference: Any,
                            args: argparse.Namespace, rows: list[dict[str, Any]]) -> None:
    """The in-process rows of one engine mode (eager, or decode through torch.compile)."""
    max_batch = max(args.batch_sizes)
    engine = Engine(EngineConfig(model_path=str(folder), max_running_requests=max(64, max_batch),
                                 max_batch_tokens=max(2048, max_batch * args.prompt_len),
                                 enable_torch_compile=mode == "compile"))
    engine.start(asyncio.get_running_loop())
    try:
        for batch in args.batch_sizes:
            prompts = make_prompts(batch, args.prompt_len, seed=batch)
            await engine_decode(engine, prompts, args.new_tokens)  # warm-up
            hf_decode(reference, prompts, args.new_tokens)
            ours, theirs = [], []
            for _ in range(args.repeats):
                ours.append(await engine_decode(engine, prompts, args.new_tokens))
                theirs.append(hf_decode(reference, prompts, args.new_tokens))
            num_same = sum(a == b for a, b in zip(ours[-1].output_ids, theirs[-1].output_ids, strict=True))
            row = {"model": name, "params_m": num_params / 1e6, "batch": batch, "mode": mode,
                   "engine_tok_s": median_rate(ours), "hf_tok_s": median_rate(theirs),
                   "same_greedy": f"{num_same}/{batch}",
                   "engine_runs": [round(m.tokens_per_s, 1) for m in ours],
                   "hf_runs": [round(m.tokens_per_s, 1) for m in theirs]}
            # Each engine run is paired with the transformers run right after it: the median of the
            # pairs' ratios cancels most of the load the machine's other users put on both.
            row["ratio"] = statistics.median(a.tokens_per_s / b.tokens_per_s for a, b in zip(ours, theirs))
            rows.append(row)
            print(f"  {name} {mode} batch {batch}: engine {row['engine_runs']} tok/s, "
                  f"transformers {row['hf_runs']} tok/s", flush=True)
    finally:
        engine.stop()


async def bench_model(name: str, args: argparse.Namespace, rows: list[dict[str, Any]]) -> None:
    from transformers import LlamaForCausalLM

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / name
        num_params = write_model(folder, MODELS[name])
        reference = LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        for mode in args.modes:
            await bench_engine_mode(name, mode, folder, num_params, reference, args, rows)
        if args.http_batch:
            prompts = make_prompts(args.http_batch, args.prompt_len, seed=args.http_batch)
            for mode in args.modes:
                in_process = next((r for r in rows if r["model"] == name and r["batch"] == args.http_batch
                                   and r["mode"] == mode and not r.get("http")), None)
                rate = http_decode_rate(folder, prompts, args.new_tokens, args.repeats, args.threads, mode)
                hf_tok_s = in_process["hf_tok_s"] if in_process else float("nan")
                rows.append({"model": name, "params_m": num_params / 1e6, "batch": args.http_batch, "http": True,
                             "mode": mode, "engine_tok_s": rate, "hf_tok_s": hf_tok_s,
                             "ratio": rate / hf_tok_s, "same_greedy": "-"})


def print_table(rows: list[dict[str, Any]]) -> None:
    print()
    print("| model | params | batch | path | engine decode tok/s | transformers decode tok/s | engine / transformers "
          "| same greedy tokens |")
    print("|---|---:|---:|---|---:|---:|---:|---:|")
    for r in rows:
        path = "HTTP /generate" if r.get("http") else "in-process"
        if r["mode"] == "compile":
            path += ", torch.compile"
        print(f"| {r['model']} | {r['params_m']:.1f}M | {r['batch']} | {path} | {r['engine_tok_s']:.0f} "
              f"| {r['hf_tok_s']:.0f} | {r['ratio']:.2f}x | {r['same_greedy']} |")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="tiny,100m", help=f"comma-separated, from {sorted(MODELS)}")
    p.add_argument("--batch-sizes", default="1,8,32")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--modes", default="eager,compile",
                   help="engine modes, comma-separated: eager, compile (decode through torch.compile)")
    p.add_argument("--http-batch", type=int, default=8, help="batch size measured through HTTP; 0: skip")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    p.add_argument("--json", type=Path, default=None, help="also write the rows here")
    args = p.parse_args()
    args.batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    models = args.models.split(",")
    args.modes = args.modes.split(",")
    if not set(args.modes) <= {"eager", "compile"}:
        p.error(f"--modes takes eager and compile, got {args.modes}")
    unknown = [m for m in models if m not in MODELS]
    if unknown:
        p.error(f"unknown models {unknown}; known: {sorted(MODELS)}")
    if args.threads:
        torch.set_num_threads(args.threads)
    import transformers

    print(f"torch {torch.__version__} ({torch.get_num_threads()} threads), transformers {transformers.__version__}, "
          f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs; prompt {args.prompt_len} tokens, "
          f"{args.new_tokens} new tokens, median of {args.repeats} runs after a warm-up", flush=True)
    rows: list[dict[str, Any]] = []
    started = time.perf_counter()

    async def run_all() -> None:
        for name in models:
            await bench_model(name, args, rows)

    asyncio.run(run_all())
    print_table(rows)
    print(f"\n(total {time.perf_counter() - started:.0f}s)")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
