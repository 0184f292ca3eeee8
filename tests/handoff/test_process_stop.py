"""handoff/cluster: stopping a cluster goes on past a process that will not die, and names it."""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

import pytest

from handoff.cluster.local import ClusterSpec, LocalCluster
from handoff.cluster.process import ServerProcess

pytestmark = pytest.mark.timeout(60)

_IGNORES_SIGTERM = ("import signal, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('ready', "
                    "flush=True); time.sleep(60)")


class _KillNotDelivered(subprocess.Popen):  # type: ignore[type-arg]
    """A real process whose SIGKILL does not take: what its parent sees of a process stuck in the kernel
    (uninterruptible sleep on a hung disk or driver), which no signal ends until the kernel lets go."""

    def kill(self) -> None:
        pass


def _started(name: str, tmp_path: Path, popen: type[subprocess.Popen]) -> ServerProcess:  # type: ignore[type-arg]
    proc = ServerProcess("stub", [], log_dir=tmp_path, name=name)
    proc.proc = popen([sys.executable, "-c", _IGNORES_SIGTERM], stdout=subprocess.PIPE)
    assert proc.proc.stdout is not None and proc.proc.stdout.readline() == b"ready\n"  # SIGTERM ignored from here
    return proc


def test_a_process_that_will_not_die_is_one_line_and_the_others_still_stop(tmp_path: Path,
                                                                           caplog: pytest.LogCaptureFixture) -> None:
    """``proc.wait(5)`` after the SIGKILL raised ``TimeoutExpired``: a traceback at shutdown, and the processes
    after it in the stop order were never stopped."""
    stuck = _started("stuck", tmp_path, _KillNotDelivered)
    stuck.kill_wait_s = 0.5
    other = _started("other", tmp_path, subprocess.Popen)
    cluster = LocalCluster(ClusterSpec(num_mixed=1), tmp_path)
    cluster._launched += [stuck, other]  # what start() records, in its order
    try:
        with caplog.at_level(logging.WARNING, logger="handoff.cluster.process"):
            cluster.stop(timeout=0.5)
        assert other.proc is not None and other.proc.poll() is not None  # SIGKILLed after the stuck one
        assert stuck.returncode is None
        lines = [r.getMessage() for r in caplog.records if "stuck" in r.getMessage()]
        assert len(lines) == 1 and f"pid {stuck.pid}" in lines[0] and "SIGKILL" in lines[0], lines
    finally:
        for proc in (stuck, other):
            if proc.proc is not None:
                subprocess.Popen.kill(proc.proc)
                proc.proc.wait(10)
                proc.proc.stdout.close()  # type: ignore[union-attr]
