"""SIGTERM while the engine is still starting ends it (issue: a pod deleted while its model loads)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

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


# the engine, given SIGTERM the moment numpy's import begins (torch's import brings it in, from C code)
SIGTERM_AT_NUMPY = """
import runpy, signal, sys
class SigtermAtNumpy:
    def find_spec(self, name, path=None, target=None):
        if name == "numpy" and not getattr(self, "fired", False):
            self.fired = True
            signal.raise_signal(signal.SIGTERM)
        return None
sys.meta_path.insert(0, SigtermAtNumpy())
runpy.run_module("node_engine", run_name="__main__")
"""


def test_sigterm_while_numpy_is_imported_exits_143(tmp_path: Path) -> None:
    """torch's import loads numpy from C code that takes any exception there for a failed import and goes on: the
    exit of a SIGTERM at that moment was lost, the engine loaded its model and served (``handoff up`` stopped while
    starting waited 10 s to SIGKILL it)."""
    port_file = tmp_path / "port"
    proc = subprocess.Popen([sys.executable, "-c", SIGTERM_AT_NUMPY, "--model-path", "builtin:tiny", "--port", "0",
                             "--port-file", str(port_file)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        try:
            code = proc.wait(30)
        except subprocess.TimeoutExpired:
            code = None
        assert code == 128 + signal.SIGTERM and not port_file.exists(), (code, port_file.exists())
        assert b"SIGTERM before serving" in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
