"""The test side of :mod:`tests.support.refusal_runner`: a component's command line run many times from one process
that imported it once (a fork per case), instead of a fresh interpreter per case (~1.5 s of imports each).

A test module's fixture holds one runner for the module's life (per xdist worker)::

    @pytest.fixture(scope="module")
    def lb_runner() -> Iterator[RefusalRunner]:
        yield from refusal_runner("lb")

and passes it to :func:`tests.support.procs.assert_refused_at_start` (``runner=lb_runner``). Every wait is bounded;
the runner is closed (stdin closed, waited for, killed past ``CLOSE_WAIT_S``) however the module's tests end.
"""

from __future__ import annotations

import json
import os
import selectors
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Mapping

from tests.support.procs import REPO_ROOT, token_free_environ

START_TIMEOUT_S = 120.0  # the imports, on a loaded 2-core machine
ANSWER_MARGIN_S = 30.0  # past a case's own timeout: the kill, the reap and the answer
CLOSE_WAIT_S = 15.0  # a runner whose stdin closed ends its current case (bounded by its timeout) and exits
MAX_ANSWER_BYTES = 1 << 20  # an answer holds at most 2 x 64 KiB of stderr


@dataclass(frozen=True)
class Outcome:
    """What ``subprocess.run`` would have given: the exit code, stderr, and whether it ran past its time."""

    returncode: int
    stderr: str
    timed_out: bool


class RunnerFailed(RuntimeError):
    """The runner did not start, died, or did not answer in time; the message ends with its stderr's tail."""


class RefusalRunner:
    """One ``python -m tests.support.refusal_runner <component>`` process."""

    def __init__(self, component: str) -> None:
        self.component = component
        self._log = tempfile.TemporaryFile()
        self._proc: subprocess.Popen[bytes] | None = None
        self._buffer = b""
        self._cases = 0

    def start(self) -> "RefusalRunner":
        self._proc = subprocess.Popen([sys.executable, "-m", "tests.support.refusal_runner", self.component],
                                      cwd=REPO_ROOT, env=token_free_environ(), stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, stderr=self._log)
        self._buffer = b""
        try:
            if json.loads(self._read_line(time.monotonic() + START_TIMEOUT_S)) != {"ready": True}:
                raise ValueError("a first line that is not {\"ready\": true}")
        except BaseException as exc:
            message = self._failure(f"did not start: {exc}") if isinstance(exc, ValueError) else None
            self.close(kill=True)
            if message is not None:
                raise RunnerFailed(message) from None
            raise
        return self

    def run(self, args: list[str], *, env: Mapping[str, str], cwd: Path, timeout_s: float) -> Outcome:
        """``python -m <component> *args`` with exactly ``env`` in ``cwd``; killed past ``timeout_s``."""
        if self._proc is None or self._proc.poll() is not None:
            self.close()
            self.start()  # a runner broken by an earlier case serves the next one afresh
        assert self._proc is not None and self._proc.stdin is not None
        self._cases += 1
        case = {"id": self._cases, "args": args, "env": dict(env), "cwd": str(cwd), "timeout_s": timeout_s}
        try:
            self._proc.stdin.write(json.dumps(case).encode() + b"\n")
            self._proc.stdin.flush()
            answer = json.loads(self._read_line(time.monotonic() + timeout_s + ANSWER_MARGIN_S))
            if answer.get("id") != case["id"]:
                raise RunnerFailed(f"answered case {answer.get('id')} to case {case['id']}")
        except (OSError, ValueError, RunnerFailed) as exc:
            message = self._failure(f"no answer to {args}: {exc}")
            self.close(kill=True)
            raise RunnerFailed(message) from None
        except BaseException:
            self.close(kill=True)  # interrupted (a pytest-timeout): its answer must not be taken for the next case's
            raise
        return Outcome(int(answer["returncode"]), str(answer["stderr"]), bool(answer["timed_out"]))

    def _read_line(self, deadline: float) -> bytes:
        assert self._proc is not None and self._proc.stdout is not None
        fd = self._proc.stdout.fileno()
        with selectors.DefaultSelector() as sel:
            sel.register(fd, selectors.EVENT_READ)
            while b"\n" not in self._buffer:
                left = deadline - time.monotonic()
                if left <= 0 or not sel.select(left):
                    raise RunnerFailed(self._failure("no answer in time"))
                data = os.read(fd, 65536)
                if not data:
                    raise RunnerFailed(self._failure("exited"))
                self._buffer += data
                if len(self._buffer) > MAX_ANSWER_BYTES:
                    raise RunnerFailed(self._failure("answered more than a line"))
        line, self._buffer = self._buffer.split(b"\n", 1)
        return line

    def _failure(self, what: str) -> str:
        self._log.seek(0, os.SEEK_END)
        self._log.seek(max(0, self._log.tell() - 4000))
        tail = self._log.read().decode("utf-8", "replace")
        return f"refusal runner for {self.component} {what}; its stderr ends:\n{tail}"

    def close(self, *, kill: bool = False) -> None:
        """Close its stdin (it exits), wait for it; killed at once with ``kill``, else past ``CLOSE_WAIT_S`` (a
        killed runner's case dies with it: ``PR_SET_PDEATHSIG``)."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if kill:
            proc.kill()
        for stream in (proc.stdin, proc.stdout):
            try:
                if stream is not None:
                    stream.close()
            except OSError:
                pass  # a runner gone already: its pipe is broken
        try:
            proc.wait(timeout=CLOSE_WAIT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=CLOSE_WAIT_S)


def refusal_runner(component: str) -> Iterator[RefusalRunner]:
    """A fixture's body: ``yield from refusal_runner("lb")``; the runner is closed however its tests end."""
    runner = RefusalRunner(component)
    try:
        yield runner.start()
    finally:
        runner.close()
        runner._log.close()
