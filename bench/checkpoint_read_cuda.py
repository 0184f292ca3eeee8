"""The engine's checkpoint read onto a GPU against ``safetensors`` in the same run, by reader threads.

The disk reload's read half (issue 15's disk target on a GPU): the float32 checkpoint of ``tests/gpu``'s
~0.51B model (2 GB) is read from the page cache onto the GPU and copied into bf16 tensors there, by

- ``safetensors.torch.load_file`` and a copy of each tensor into its bf16 tensor (the baseline), and
- :meth:`CheckpointReader.iter_tensors_on` (the engine's reader: pinned bounce buffers, ``os.preadv``) with
  1, 2, 4 and 8 reader threads (and, with ``--min-slice-mb``, other smallest slices), then the same copy into
  bf16.

Medians of ``--repeats`` after one untimed run of each; ratios are baseline time over the reader's.

    python3 bench/checkpoint_read_cuda.py [--repeats 3] [--threads 1 2 4 8] [--min-slice-mb 4] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

import torch  # noqa: E402

from bench.common import median_s  # noqa: E402
from handoff.checkpoint import read_crew  # noqa: E402
from node_engine.model.builtin import builtin_arch, builtin_weights, save_checkpoint  # noqa: E402
from node_engine.model.checkpoint_io import CheckpointReader  # noqa: E402
from node_engine.model.loader import read_header  # noqa: E402
from tests.gpu.engines import MODEL  # noqa: E402


MiB = 1024 * 1024


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--min-slice-mb", type=float, nargs="+", default=[read_crew.MIN_SLICE_BYTES / MiB],
                        help="the crew's smallest slice (MiB), each tried with every --threads")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    device = torch.device("cuda", 0)
    arch = builtin_arch("builtin:tiny", MODEL)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "ckpt"
        save_checkpoint(folder, arch, builtin_weights(arch, seed=9))
        files = sorted(folder.glob("*.safetensors"))
        num_bytes = sum(path.stat().st_size for path in files)
        for path in files:  # into the page cache, for every side
            path.read_bytes()
        reader = CheckpointReader()
        entries = read_header(folder, reader)
        targets = {name: torch.empty(e.shape, device=device, dtype=torch.bfloat16) for name, e in entries.items()}

        def baseline() -> None:
            from safetensors.torch import load_file
            for path in files:
                for name, tensor in load_file(path).items():
                    targets[name].copy_(tensor)
            torch.cuda.synchronize()

        def engine_reader(num_threads: int) -> None:
            for name, tensor in reader.iter_tensors_on(device, entries, list(entries), num_threads=num_threads):
                targets[name].copy_(tensor)
            torch.cuda.synchronize()

        results = {"bytes": num_bytes, "baseline_s": _timed(baseline, args.repeats)}
        print(f"{num_bytes / 1e6:.0f} MB in {len(entries)} tensors; load_file + copy to bf16: "
              f"{results['baseline_s'] * 1e3:.1f} ms", flush=True)
        for min_slice_mb in args.min_slice_mb:
            read_crew.MIN_SLICE_BYTES = int(min_slice_mb * MiB)  # a module constant: swept here, nowhere else
            for num_threads in args.threads:
                took = _timed(lambda: engine_reader(num_threads), args.repeats)
                results[f"slice_{min_slice_mb:g}MiB_threads_{num_threads}_s"] = took
                print(f"  engine reader, {num_threads} thread(s), slices of {min_slice_mb:g} MiB and more: "
                      f"{took * 1e3:.1f} ms ({num_bytes / took / 1e9:.2f} GB/s), "
                      f"ratio {results['baseline_s'] / took:.0%}", flush=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


def _timed(run, repeats: int) -> float:
    run()
    return median_s(run, repeats)


if __name__ == "__main__":
    raise SystemExit(main())
