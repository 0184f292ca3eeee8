"""Start the project's processes for real on loopback, and wait on them with deadlines.

Every server is started with ``--port 0 --port-file F`` (or a fixed port on a
restart), its output captured to a log file whose tail is shown when it fails.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Sequence, TypeVar

import httpx

T = TypeVar("T")

REPO_ROOT = Path(__file__).resolve().parents[2]


def wait_until(predicate: Callable[[], T], *, timeout: float, interval: float = 0.02,
               what: str = "condition") -> T:
    """Poll ``predicate`` until it returns something truthy; raise on the deadline."""
    deadline = time.monotonic() + timeout
    last_exc: BaseException | None = None
    while True:
        try:
            value = predicate()
            if value:
                return value
        except Exception as exc:  # noqa: BLE001 - polled predicates may fail until ready
            last_exc = exc
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout}s waiting for {what}"
                               + (f" (last error: {last_exc!r})" if last_exc else ""))
        time.sleep(interval)


_SECRET_FLAGS = ("--admin-token", "--api-key")


def _redacted(argv: list[str]) -> list[str]:
    """The command line with token values hidden, so logs searched for tokens see only the process's own."""
    return ["***" if i and argv[i - 1] in _SECRET_FLAGS else arg for i, arg in enumerate(argv)]


class ServerProcess:
    """One project server (``python -m MODULE ...``) running as a real process."""

    def __init__(self, module: str, args: Sequence[str], *, log_dir: Path, name: str | None = None,
                 env: dict[str, str] | None = None, host: str = "127.0.0.1",
                 health_path: str = "/health") -> None:
        self.module = module
        self.args = list(args)
        self.name = name or module
        self.host = host
        self.health_path = health_path
        self.log_dir = log_dir
        self.env = env
        self.port: int | None = None
        self.proc: subprocess.Popen[bytes] | None = None
        self._num_starts = 0

    @property
    def url(self) -> str:
        if self.port is None:
            raise RuntimeError(f"{self.name} has not started")
        return f"http://{self.host}:{self.port}"

    @property
    def log_path(self) -> Path:
        return self.log_dir / f"{self.name}.log"

    def start(self, *, timeout: float = 60.0, port: int | None = None) -> "ServerProcess":
        """Start the process (on ``port``, or the previous port on a restart) and wait for health."""
        self._num_starts += 1
        port_file = self.log_dir / f"{self.name}.port"
        port_file.unlink(missing_ok=True)
        use_port = port if port is not None else (self.port or 0)
        argv = [sys.executable, "-m", self.module, *self.args, "--host", self.host,
                "--port", str(use_port), "--port-file", str(port_file)]
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **(self.env or {})}
        log = open(self.log_path, "ab")
        log.write(f"\n=== start #{self._num_starts}: {' '.join(_redacted(argv))}\n".encode())
        log.flush()
        self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO_ROOT,
                                     start_new_session=True)
        log.close()
        try:
            text = wait_until(lambda: self._read_port_file(port_file), timeout=timeout,
                              what=f"{self.name} to bind")
            self.port = int(text)
            wait_until(self._is_healthy, timeout=timeout, what=f"{self.name} {self.health_path}")
        except TimeoutError as exc:
            self.kill()
            raise RuntimeError(f"{self.name} did not start: {exc}\n{self.log_tail()}") from exc
        return self

    def _read_port_file(self, path: Path) -> str | None:
        if self.proc is not None and self.proc.poll() is not None:
            raise RuntimeError(f"{self.name} exited with {self.proc.returncode}\n{self.log_tail()}")
        return path.read_text().strip() if path.exists() else None

    def _is_healthy(self) -> bool:
        if self.proc is not None and self.proc.poll() is not None:
            raise RuntimeError(f"{self.name} exited with {self.proc.returncode}\n{self.log_tail()}")
        return httpx.get(self.url + self.health_path, timeout=2.0).status_code == 200

    @property
    def pid(self) -> int:
        if self.proc is None:
            raise RuntimeError(f"{self.name} has not started")
        return self.proc.pid

    def is_running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, timeout: float = 10.0) -> int | None:
        """SIGTERM, then SIGKILL past ``timeout``; returns the exit code."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        return self.proc.returncode

    def kill(self) -> None:
        """SIGKILL the process (a crash, as far as its peers can tell)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(5)

    def log_tail(self, num_lines: int = 40) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except FileNotFoundError:
            return f"(no log for {self.name})"
        return f"--- last lines of {self.log_path} ---\n" + "\n".join(lines[-num_lines:])
