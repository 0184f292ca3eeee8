"""SIGTERM while the engine is still starting ends it (issue: a pod deleted while its model loads)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.timeout(120)

SIGTERM_BIT = 1 << (signal.SIGTERM - 1)


def catches_sigterm(pid: int) -> bool:
    with open(f"/proc/{pid}/status") as status:
        caught = next(line for line in status if line.startswith("SigCgt:"))
    return bool(int(caught.split()[1], 16) & SIGTERM_BIT)


def test_sigterm_before_serving_exits_143() -> None:
    """In a container the engine is PID 1, for which the kernel ignores a signal with no handler: a pod deleted
    while its model loaded waited out its whole grace period. The engine now handles SIGTERM from its start
    (exit 143) until uvicorn's graceful handlers take over. ``--enable-torch-compile`` keeps it starting for a
    while (the decode forward compiles before it serves)."""
    proc = subprocess.Popen([sys.executable, "-m", "node_engine", "--model-path", "builtin:tiny", "--port", "0",
                             "--enable-torch-compile"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 30
        while not catches_sigterm(proc.pid):
            assert proc.poll() is None and time.monotonic() < deadline, "the engine never handled SIGTERM"
            time.sleep(0.01)  # polling /proc with a deadline: nothing to wait on
        os.kill(proc.pid, signal.SIGTERM)
        assert proc.wait(60) == 128 + signal.SIGTERM
        assert b"SIGTERM before serving" in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
