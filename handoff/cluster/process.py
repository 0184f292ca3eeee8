"""One service process (``python -m MODULE ...``) started for real, with deadlines.

Every service is started with ``--port 0 --port-file F`` (or a fixed port on a
restart, so peers find it again), its output captured to a log file whose tail
is shown when it fails. ``launch`` returns at once so many processes can start
in parallel; ``wait_ready`` waits for the port and a healthy ``/health``.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import os
import signal
import subprocess
import sys
import time
from functools import partial
from pathlib import Path
from typing import Callable, Sequence, TypeVar

import httpx

T = TypeVar("T")
log = logging.getLogger(__name__)

_SECRET_FLAGS = ("--admin-token", "--api-key")


def wait_until(predicate: Callable[[], T], *, timeout: float, interval: float = 0.02,
               what: str = "condition") -> T:
    """Poll ``predicate`` until it returns something truthy; raise ``TimeoutError`` on the deadline."""
    deadline = time.monotonic() + timeout
    last_exc: BaseException | None = None
    while True:
        try:
            value = predicate()
            if value:
                return value
        except (OSError, httpx.HTTPError, ValueError) as exc:  # polled predicates may fail until ready
            last_exc = exc
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout}s waiting for {what}"
                               + (f" (last error: {last_exc!r})" if last_exc else ""))
        time.sleep(interval)


def _is_secret_flag(name: str) -> bool:
    """``--admin-token`` or ``--api-key``, or a prefix argparse takes for one (``--admin-tok``)."""
    return len(name) > 2 and name.startswith("--") and any(flag.startswith(name) for flag in _SECRET_FLAGS)


def _redacted(argv: list[str]) -> list[str]:
    """The command line with token values hidden (``--api-key X``, ``--api-key=X``, ``--api-k X``), so a log
    holds only what the process itself wrote."""
    shown = []
    for i, arg in enumerate(argv):
        name, equals, _ = arg.partition("=")
        if i and _is_secret_flag(argv[i - 1]):
            shown.append("***")
        elif equals and _is_secret_flag(name):
            shown.append(f"{name}=***")
        else:
            shown.append(arg)
    return shown


def _die_with_parent(parent_pid: int) -> None:
    """In the child, before it runs: ask Linux for SIGTERM when the parent dies (``PR_SET_PDEATHSIG``). A parent
    that died between the fork and this call sends nothing (the child has a new parent by then): the child, seeing
    another parent than ``parent_pid``, exits at once."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent_pid:
            os._exit(1)


_PR_SET_PDEATHSIG = 1


class ProcessFailed(RuntimeError):
    """A service did not start, or exited; the message ends with the tail of its log."""


class ServerProcess:
    """One service process on ``host``, found through its port file.

    ``wrapper`` is a command the process is started under (``["ip", "netns", "exec", "ns1"]`` runs it in a
    network namespace); it must ``exec`` the service, so that the pid is the service's own.
    """

    def __init__(self, module: str, args: Sequence[str], *, log_dir: Path, name: str | None = None,
                 env: dict[str, str] | None = None, host: str = "127.0.0.1", health_path: str = "/health",
                 cwd: Path | None = None, wrapper: Sequence[str] = ()) -> None:
        self.module = module
        self.wrapper = list(wrapper)
        self.args = list(args)
        self.name = name or module
        self.host = host
        self.health_path = health_path
        self.log_dir = log_dir
        self.env = env
        self.cwd = cwd
        self.port: int | None = None
        self.proc: subprocess.Popen[bytes] | None = None
        # Linux: the process gets SIGTERM when the thread that started it ends (its parent died, even by
        # SIGKILL). Only for processes started from a thread that lives as long as they should.
        self.die_with_parent = False
        self.kill_wait_s = 5.0  # how long a SIGKILLed process is waited for
        self.env_unset: frozenset[str] = frozenset()  # variables of this process's environment the child goes without
        self._num_starts = 0

    @property
    def url(self) -> str:
        if self.port is None:
            raise RuntimeError(f"{self.name} has not started")
        return f"http://{self.host}:{self.port}"

    @property
    def log_path(self) -> Path:
        return self.log_dir / f"{self.name}.log"

    @property
    def _port_file(self) -> Path:
        return self.log_dir / f"{self.name}.port"

    def launch(self, *, port: int | None = None) -> "ServerProcess":
        """Start the process (on ``port``, or its previous port on a restart) without waiting."""
        self._num_starts += 1
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self._port_file.unlink(missing_ok=True)
        use_port = port if port is not None else (self.port or 0)
        argv = self.command(use_port)
        inherited = {name: value for name, value in os.environ.items() if name not in self.env_unset}
        env = {**inherited, "PYTHONUNBUFFERED": "1", **(self.env or {})}
        with open(self.log_path, "ab") as log:
            log.write(f"\n=== start #{self._num_starts}: {' '.join(_redacted(argv))}\n".encode())
            log.flush()
            self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=self.cwd,
                                         start_new_session=True,
                                         preexec_fn=partial(_die_with_parent, os.getpid())
                                         if self.die_with_parent else None)
        return self

    def command(self, port: int) -> list[str]:
        """The command line that starts the service on ``port`` (0: any, written to the port file)."""
        return [*self.wrapper, sys.executable, "-m", self.module, *self.args, "--host", self.host,
                "--port", str(port), "--port-file", str(self._port_file)]

    def wait_ready(self, *, timeout: float = 120.0) -> "ServerProcess":
        """Wait for the port file and a 200 on the health path; kill and raise on the deadline."""
        try:
            text = wait_until(self._read_port_file, timeout=timeout, what=f"{self.name} to bind")
            self.port = int(text)
            wait_until(self._is_healthy, timeout=timeout, what=f"{self.name} {self.health_path}")
        except TimeoutError as exc:
            self.kill()
            raise ProcessFailed(f"{self.name} did not start: {exc}\n{self.log_tail()}") from exc
        return self

    def start(self, *, timeout: float = 120.0, port: int | None = None) -> "ServerProcess":
        return self.launch(port=port).wait_ready(timeout=timeout)

    async def restart(self, timeout: float = 120.0) -> None:
        """Start again and wait for it without holding the event loop: a cancel (Ctrl-C) ends the wait at once,
        where :meth:`start` holds its caller until the model is loaded."""
        self.launch()
        deadline = time.monotonic() + timeout
        while not self.is_ready_now():  # ProcessFailed, with its log, if it exits
            if time.monotonic() > deadline:
                self.kill()
                raise ProcessFailed(f"{self.name} did not restart within {timeout:g} s\n{self.log_tail()}")
            await asyncio.sleep(0.05)

    def check_alive(self) -> None:
        """:class:`ProcessFailed` naming this process, with its log's tail, once it has exited."""
        if self.proc is not None and self.proc.poll() is not None:
            raise ProcessFailed(f"{self.name} exited with {self.proc.returncode}\n{self.log_tail()}")

    def is_ready_now(self) -> bool:
        """One look, without waiting: bound (its port file written) and healthy; :class:`ProcessFailed` once it
        has exited."""
        try:
            text = self._read_port_file()
            if not text:
                return False
            self.port = int(text)
            return self._is_healthy()
        except (OSError, httpx.HTTPError, ValueError):  # not bound or not answering yet
            return False

    def _read_port_file(self) -> str | None:
        self.check_alive()
        path = self._port_file
        return path.read_text().strip() if path.exists() else None

    def _is_healthy(self) -> bool:
        self.check_alive()
        return httpx.get(self.url + self.health_path, timeout=2.0).status_code == 200

    @property
    def pid(self) -> int:
        if self.proc is None:
            raise RuntimeError(f"{self.name} has not started")
        return self.proc.pid

    def is_running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def returncode(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def terminate(self) -> None:
        """Ask the process to stop (SIGTERM) without waiting."""
        if self.proc is not None and self.is_running():
            self.proc.send_signal(signal.SIGTERM)

    def stop(self, timeout: float = 10.0) -> int | None:
        """SIGTERM, then SIGKILL past ``timeout``; returns the exit code (None: it would not die, see
        :meth:`kill`)."""
        if self.proc is None:
            return None
        self.terminate()
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
        return self.proc.returncode

    def kill(self, *, wait: bool = True) -> None:
        """SIGKILL the process (a crash, as far as its peers can tell); ``wait``: and reap it. One that outlives
        the SIGKILL by :attr:`kill_wait_s` (stuck in the kernel: uninterruptible sleep on a hung disk or
        driver) is one warning naming it, never an exception: whoever stops many processes goes on."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            if wait:
                try:
                    self.proc.wait(self.kill_wait_s)
                except subprocess.TimeoutExpired:
                    log.warning("%s (pid %d) is still there %g s after SIGKILL (stuck in the kernel?); "
                                "left behind", self.name, self.proc.pid, self.kill_wait_s)

    def log_tail(self, num_lines: int = 40) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except FileNotFoundError:
            return f"(no log for {self.name})"
        return f"--- last lines of {self.log_path} ---\n" + "\n".join(lines[-num_lines:])


def wait_all_ready(timeouts: dict[ServerProcess, float], *, watched: Callable[[], list[ServerProcess]],
                   on_ready: Callable[[ServerProcess], None], interval: float = 0.05) -> None:
    """Wait for every process of ``timeouts`` (each its own timeout in seconds, from now) together, calling
    ``on_ready`` with each as soon as it is ready. :class:`ProcessFailed` naming the process at once when any of
    ``watched()`` exits, or when one is late (that one is killed): a process that failed is never noticed only
    after the others' waits."""
    started = time.monotonic()
    pending = dict(timeouts)
    while pending:
        for proc in list(pending):
            if proc.is_ready_now():
                del pending[proc]
                on_ready(proc)
        for proc in watched():
            proc.check_alive()
        late = [(proc, limit) for proc, limit in pending.items() if time.monotonic() - started > limit]
        if late:
            proc, limit = late[0]
            proc.kill()
            raise ProcessFailed(f"{proc.name} did not start within {limit:g} s\n{proc.log_tail()}")
        if pending:
            time.sleep(interval)
