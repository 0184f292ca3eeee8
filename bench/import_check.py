"""Import every module of the engine and the shared plumbing (and the GPU tests' helpers): on a machine whose
packages were assembled by hand (the GPU image plus carried wheels), a missing one shows here in seconds."""

from __future__ import annotations

import importlib
import pkgutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

EXTRA = ["uvicorn.loops.uvloop", "uvicorn.protocols.http.httptools_impl", "pytest_asyncio", "pytest_timeout",
         "torch_memory_saver", "tests.gpu.engines", "bench.memory_cycle_cuda", "bench.weight_sync_cuda",
         "bench.checkpoint_read_cuda"]


def main() -> int:
    names = list(EXTRA)
    for package in ("handoff", "node_engine", "node_sidecar", "lb"):
        module = importlib.import_module(package)
        names += [info.name for info in pkgutil.walk_packages(module.__path__, prefix=f"{package}.")
                  if not info.name.endswith("__main__")]
    failed = 0
    for name in names:
        try:
            importlib.import_module(name)
        except Exception as exc:  # report every module that cannot load, then fail once
            failed += 1
            print(f"cannot import {name}: {type(exc).__name__}: {exc}")
    print(f"{len(names) - failed} of {len(names)} modules import")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
