"""The tests start services the way ``handoff up`` does: with the product's own launcher."""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, Mapping

from handoff.cluster import process
from handoff.cluster.process import ProcessFailed, wait_until

if TYPE_CHECKING:
    from tests.support.refusals import RefusalRunner

REPO_ROOT = Path(__file__).resolve().parents[2]

__all__ = ["ProcessFailed", "ServerProcess", "assert_refused_at_start", "sigint_by_default", "tiny_engine", "wait_until",
           "REPO_ROOT"]


def _below_ephemeral_range() -> range:
    """Ports under the kernel's ephemeral range (``ip_local_port_range``, 32768-60999 by default), which neither a
    ``bind`` to port 0 nor an outgoing connection is ever given."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    return range(20000, max(20000, min(low, 32768)))


_FIXED_PORTS = _below_ephemeral_range()


def free_fixed_port(host: str) -> int | None:
    """A free port on ``host`` below the ephemeral range, or None (then the service binds port 0). A service a
    test restarts on its port must find it free: one from the ephemeral range was, in a full run, meanwhile handed
    to another test's service binding port 0, and the restart failed with "Address already in use"."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    for _ in range(50 if _FIXED_PORTS else 0):
        port = random.choice(_FIXED_PORTS)
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            try:
                probe.bind((host, port))
            except OSError:
                continue
        return port
    return None


class ServerProcess(process.ServerProcess):
    """Runs from the repository root, so test-only modules (``tests.support.*``) can be started too; its first
    start takes a port below the ephemeral range (:func:`free_fixed_port`), kept for every restart."""

    def __init__(self, module: str, args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("cwd", REPO_ROOT)
        super().__init__(module, args, **kwargs)

    def launch(self, *, port: int | None = None) -> "ServerProcess":
        # A test run killed outright (a timeout's SIGKILL) leaves no service behind. Linux signals the death of
        # the *thread* that started the child, so only the main thread's children (the fixtures') get it.
        self.die_with_parent = threading.current_thread() is threading.main_thread()
        if port is None and self.port is None:
            port = free_fixed_port(self.host)
        return super().launch(port=port)


def tiny_engine(log_dir: Path, name: str) -> Iterator[ServerProcess]:
    """A ``builtin:tiny`` engine for a fixture's life: ``yield from tiny_engine(proc_log_dir, "name")``."""
    proc = ServerProcess("node_engine", ["--model-path", "builtin:tiny"], log_dir=log_dir, name=name)
    proc.start()
    yield proc
    proc.stop()


def sigint_by_default() -> None:
    """``preexec_fn`` of a process a test sends SIGINT: SIGINT at its default action in it. A test run started in
    the background of a shell without job control (``pytest ... &``) has SIGINT ignored, and every process it
    starts inherits that; ``handoff up`` and ``demo`` rightly keep an ignored SIGINT ignored, so such a test would
    wait for an exit that never comes."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


_TOKEN_VARS = ("HANDOFF_ADMIN_TOKEN", "HANDOFF_API_KEY")


def token_free_environ() -> dict[str, str]:
    """This process's environment without the tokens a service would take from it (a test's case sets them)."""
    return {k: v for k, v in os.environ.items() if k not in _TOKEN_VARS}


def assert_refused_at_start(argv: list[str], flag: str, *, env: Mapping[str, str] | None = None,
                            timeout_s: float = 60.0, runner: RefusalRunner | None = None) -> str:
    """``python -m *argv`` exits 2 with one last line on stderr naming ``flag`` and no traceback (its stderr is
    returned). A process still running after ``timeout_s`` took the bad value and started (it is killed).

    With ``runner`` (:mod:`tests.support.refusals`, for ``argv[0]``), the case runs in a fork of a process that
    imported the component once, with the same environment and folder a fresh interpreter gets here."""
    environ = token_free_environ()
    environ.update(env or {})
    if runner is not None:
        assert argv[0] == runner.component, (argv, runner.component)
        done = runner.run(argv[1:], env=environ, cwd=REPO_ROOT, timeout_s=timeout_s)
        returncode, stderr, timed_out = done.returncode, done.stderr, done.timed_out
    else:
        try:
            ran = subprocess.run([sys.executable, "-m", *argv], cwd=REPO_ROOT, env=environ, capture_output=True,
                                 text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"{argv} started: still running after {timeout_s:g} s") from None
        returncode, stderr, timed_out = ran.returncode, ran.stderr, False
    if timed_out:
        raise AssertionError(f"{argv} started: still running after {timeout_s:g} s; its stderr ends:\n"
                             f"{stderr[-2000:]}")
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert returncode == 2 and lines and flag in lines[-1] and "Traceback" not in stderr, \
        (argv, returncode, stderr[-2000:])
    return stderr
