"""``n`` samples of one prompt against ``n`` separate requests for it, same engine, same run.

One ``/generate`` with ``sampling_params.n = N`` prefills its prompt once (a
prefill-only request that leaves the prompt's KV to the prefix cache) and runs
the ``N`` samples from there; ``N`` separate requests for the same prompt, sent
together, each prefill it. The script runs both on one in-process engine
(``builtin:tiny`` or a ``bench.common.MODELS`` shape, CPU; the engine's own
request path, ``GenerationRun``, without HTTP), alternating the two so that both
see the same machine load, each trial on a fresh random prompt (nothing cached
from an earlier trial). It prints, per mode, the median wall time of a trial,
generated tokens/s (``N`` x ``--new-tokens`` over that time), the prompt tokens
the engine computed (from its ``prompt_tokens`` counter), and the ratio
``n`` / separate of tokens/s (median over the alternating pairs).

    .venv/bin/python bench/n_samples.py                       # the figure of docs/benchmarks.md
    .venv/bin/python bench/n_samples.py --prompt-len 512 --samples 8 --new-tokens 32 --repeats 5
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import random
import statistics
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from bench.common import MODELS  # noqa: E402
from node_engine.config import EngineConfig  # noqa: E402
from node_engine.engine import Engine  # noqa: E402
from node_engine.model.builtin import BYTE_BOS_ID  # noqa: E402
from node_engine.sampling import SamplingParams  # noqa: E402
from node_engine.server.generation_run import GenerationRun, SequenceSpec  # noqa: E402


def prompt_tokens_computed(engine: Engine) -> float:
    """The engine's ``handoff_engine_prompt_tokens_total``: prompt tokens it computed (cached ones excluded)."""
    [metric] = engine.metrics.prompt_tokens.collect()
    return next(sample.value for sample in metric.samples if sample.name.endswith("_total"))


async def trial(engine: Engine, prompt: list[int], num_samples: int, num_new: int, shared: bool) -> tuple[float, float]:
    """Seconds for ``num_samples`` sequences of ``prompt`` (one request with n, or separate requests), and the
    prompt tokens the engine computed meanwhile."""
    params = SamplingParams(max_new_tokens=num_new, temperature=1.0, ignore_eos=True)
    specs = [SequenceSpec(prompt, params, prompt_index=0 if shared else j) for j in range(num_samples)]
    before = prompt_tokens_computed(engine)
    started = time.perf_counter()
    answers = await GenerationRun(engine, specs).collect()
    elapsed = time.perf_counter() - started
    assert all(len(a.output_ids) == num_new for a in answers)
    return elapsed, prompt_tokens_computed(engine) - before


async def run(args: argparse.Namespace) -> dict:
    engine = Engine(EngineConfig(model_path="builtin:tiny", model_override=json.dumps(MODELS[args.model]) or None,
                                 max_total_tokens=args.samples * (args.prompt_len + args.new_tokens) * 2 + 64,
                                 max_batch_tokens=args.prompt_len * args.samples + 64,
                                 max_running_requests=max(16, args.samples + 1)))
    engine.start(asyncio.get_running_loop())
    rng = random.Random(0)
    rows: dict[str, list[tuple[float, float]]] = {"n": [], "separate": []}
    try:
        for index in range(args.repeats + 1):  # the first pair warms up
            for mode in ("n", "separate") if index % 2 == 0 else ("separate", "n"):
                prompt = [BYTE_BOS_ID] + [rng.randrange(0, 256) for _ in range(args.prompt_len - 1)]
                result = await trial(engine, prompt, args.samples, args.new_tokens, shared=mode == "n")
                if index:
                    rows[mode].append(result)
    finally:
        engine.stop()
    generated = args.samples * args.new_tokens
    summary = {mode: {"median_s": statistics.median(s for s, _ in results),
                      "tokens_per_s": statistics.median(generated / s for s, _ in results),
                      "prompt_tokens_computed": statistics.median(p for _, p in results)}
               for mode, results in rows.items()}
    ratios = [(generated / n_s) / (generated / sep_s) for (n_s, _), (sep_s, _) in zip(rows["n"], rows["separate"])]
    summary["ratio_tokens_per_s"] = statistics.median(ratios)
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=sorted(MODELS), default="100m")
    parser.add_argument("--prompt-len", type=int, default=1024)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    summary = asyncio.run(run(args))
    print(f"# {platform.processor() or platform.machine()}, {args.model}, prompt {args.prompt_len} tokens, "
          f"{args.samples} samples x {args.new_tokens} new tokens, median of {args.repeats}")
    print(f"{'mode':<10} {'trial s':>9} {'tokens/s':>10} {'prompt tokens computed':>24}")
    for mode in ("n", "separate"):
        row = summary[mode]
        print(f"{mode:<10} {row['median_s']:>9.3f} {row['tokens_per_s']:>10.1f} {row['prompt_tokens_computed']:>24.0f}")
    print(f"n / separate, tokens/s: {summary['ratio_tokens_per_s']:.2f}x")


if __name__ == "__main__":
    main()
