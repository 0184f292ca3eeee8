"""Soak of a whole cluster (issue 8): load through the LB during many release/resume cycles.

    .venv/bin/python bench/soak.py                       # 100 cycles, 16 clients (8 streaming)
    .venv/bin/python bench/soak.py --cycles 10 --clients 8

An LB and two nodes (``builtin:tiny`` engines on CPU with ``--weights-backup
disk``, each behind its sidecar), all on loopback. The clients send generation
requests through the LB without pause while this script drives the cycles
through the LB, alternating ``wait`` / ``abort`` releases and backup (``stage_to_cpu:
true``, resume all) / reload (resume ``weights``, ``update_weights_from_disk`` from a
checkpoint of the initial weights, resume the rest). Every request is counted
(completed, aborted, refused with 503 + ``Retry-After``, lost); greedy probe outputs
are compared after every cycle; RSS and open fds of every process are sampled after
every cycle. Prints the tables; exits 1 if any promise was broken (lost requests,
changed probe outputs, RSS moving more than 5%, fds growing, a failed control call).
What is run and checked lives in ``tests/support/soak.py`` (the test suite runs a
short soak with the same code).
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from tests.support.soak import SoakConfig, run_soak  # noqa: E402


def machine() -> str:
    try:
        model = next((line.split(":", 1)[1].strip() for line in subprocess.run(
            ["lscpu"], capture_output=True, text=True, check=False).stdout.splitlines()
            if line.startswith("Model name")), platform.processor())
    except OSError:
        model = platform.processor()
    return f"{platform.machine()}, {model}, nproc {os.cpu_count()}, Python {platform.python_version()}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cycles", type=int, default=100)
    p.add_argument("--clients", type=int, default=16, help="concurrent generation clients (half of them stream)")
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--work-dir", type=Path, default=None, help="logs and checkpoint (default: a temporary dir)")
    args = p.parse_args(argv)
    config = SoakConfig(num_cycles=args.cycles, num_clients=args.clients, max_new_tokens=args.max_new_tokens)
    print(f"{datetime.datetime.now().isoformat(timespec='minutes')} on {machine()}", flush=True)
    with tempfile.TemporaryDirectory(prefix="handoff-soak-") as tmp:
        work_dir = args.work_dir or Path(tmp)
        report = run_soak(config, work_dir, say=lambda line: print(line, flush=True))
    print()
    print(report.table())
    problems = report.problems()
    print()
    print("PASS: every promise held" if not problems else "FAIL:\n" + "\n".join(f"- {p}" for p in problems))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
