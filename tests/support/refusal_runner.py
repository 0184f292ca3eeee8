"""Run ``python -m <component> <args>`` many times without paying a fresh interpreter's imports each time.

``python -m tests.support.refusal_runner <component>`` imports what ``<component>/__main__.py`` imports (once), then
serves cases, one JSON line each on stdin: ``{"id": 1, "args": [...], "env": {...}, "cwd": "...", "timeout_s": 20}``.
For each it forks a child that runs the component exactly as ``python -m`` would (``runpy.run_module(<component>,
run_name="__main__", alter_sys=True)``) and answers one JSON line on stdout: ``{"id", "returncode",
"stderr", "timed_out"}``. The rules that keep a child equal to a fresh interpreter:

- the parent never runs the component's ``main`` (its ``__main__`` module is imported for its imports, then taken
  out of ``sys.modules``), so no logging handler, signal handler or socket of one case reaches the next;
- the parent is single-threaded when it forks, native threads included (checked after the imports: a thread would
  not exist in the child, and a lock it held would stay held there). So only the ``__main__`` module's own imports
  are made: ``import torch`` starts a native thread, and the engine's cases that get that far import it themselves;
- the child gets the case's environment whole (``os.environ`` cleared, then set), its ``cwd``, ``sys.argv``, fd 0 on
  /dev/null, fd 1 on /dev/null, fd 2 on a pipe; it exits as an interpreter does: non-daemon threads joined, atexit
  handlers run, then ``os._exit`` with the ``SystemExit`` code (0 when it returns, 1 and the traceback on fd 2 for
  any other exception);
- every wait is bounded: a child still running after ``timeout_s`` took the bad value and started; its process
  group is killed and the answer says ``timed_out``. Its stderr is kept up to 64 KiB at each end.

The runner exits when its stdin closes. The test side is :class:`tests.support.refusals.RefusalRunner`.
"""

from __future__ import annotations

import atexit
import ctypes
import importlib
import json
import os
import runpy
import selectors
import signal
import sys
import threading
import time
import traceback
from typing import Any, BinaryIO

STDERR_KEEP = 64 * 1024  # bytes kept at each end of a child's stderr
KILL_WAIT_S = 10.0  # how long a killed child may take to be reaped
_PR_SET_PDEATHSIG = 1


def preload(component: str) -> None:
    """Import what ``<component>.__main__`` imports, without keeping that module: ``runpy`` warns about (and would
    not re-run) a ``__main__`` already imported under its own name."""
    name = f"{component}.__main__"
    importlib.import_module(name)
    del sys.modules[name]
    if getattr(sys.modules[component], "__main__", None) is not None:
        delattr(sys.modules[component], "__main__")
    if _thread_count() != 1:
        raise RuntimeError(f"after importing {name}, {_thread_count()} threads run: forking would be unsafe")


def _thread_count() -> int:
    """This process's threads, native ones (torch's, OpenMP's) included where Linux's /proc tells."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return threading.active_count()


def _close_inherited_fds() -> None:
    try:
        fds = [int(name) for name in os.listdir("/proc/self/fd")]
    except OSError:
        fds = list(range(3, 1024))
    for fd in fds:
        if fd > 2:
            try:
                os.close(fd)
            except OSError:
                pass  # the directory's own fd, closed already


def _exit_code(code: object) -> int:
    """What the interpreter makes of ``SystemExit(code)``: None is 0, an int itself, anything else printed, 1."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


def _child(component: str, case: dict[str, Any], stderr_fd: int, parent_pid: int) -> None:
    """In the forked child: run the component as ``python -m`` would, then ``os._exit``. Never returns."""
    code = 1
    try:
        os.setpgid(0, 0)  # its own group: the parent kills whatever it started along with it
        if sys.platform.startswith("linux"):
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
            if os.getppid() != parent_pid:
                os._exit(1)
        null = os.open(os.devnull, os.O_RDWR)
        os.dup2(null, 0)
        os.dup2(null, 1)
        os.dup2(stderr_fd, 2)
        _close_inherited_fds()  # the protocol's and the pipe's copies: EOF must come when the child ends
        os.environ.clear()
        os.environ.update(case["env"])
        os.chdir(case["cwd"])
        sys.argv = [component, *case["args"]]
        try:
            runpy.run_module(component, run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as exc:
            code = _exit_code(exc.code)
        except BaseException:  # noqa: B036 - the interpreter reports any other exception the same way
            traceback.print_exc()
            code = 1
        threading._shutdown()  # type: ignore[attr-defined]  # as the interpreter's exit: non-daemon threads end
        atexit._run_exitfuncs()
    except BaseException:  # noqa: B036 - nothing may escape into the copy of the parent's loop
        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                code = code or 1
        os._exit(code)


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass  # the group is gone already


def _reap(pid: int, deadline: float) -> int | None:
    """The child's wait status once it has ended, or None past ``deadline``."""
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return status
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.01)


class _Tail:
    """The first and the last ``STDERR_KEEP`` bytes of a stream, and how many were left out between them."""

    def __init__(self) -> None:
        self.head = b""
        self.tail = b""
        self.dropped = 0

    def add(self, data: bytes) -> None:
        room = STDERR_KEEP - len(self.head)
        self.head, data = self.head + data[:room], data[room:]
        self.tail += data
        if len(self.tail) > STDERR_KEEP:
            self.dropped += len(self.tail) - STDERR_KEEP
            self.tail = self.tail[-STDERR_KEEP:]

    def text(self) -> str:
        gap = f"\n[... {self.dropped} bytes left out ...]\n".encode() if self.dropped else b""
        return (self.head + gap + self.tail).decode("utf-8", "replace")


def run_case(component: str, case: dict[str, Any]) -> dict[str, Any]:
    """Fork a child for ``case``, read its stderr until it ends or its time is up; the answer to send back."""
    read_fd, write_fd = os.pipe()
    sys.stdout.flush()
    sys.stderr.flush()
    parent_pid = os.getpid()
    pid = os.fork()
    if pid == 0:
        os.close(read_fd)
        _child(component, case, write_fd, parent_pid)
    os.close(write_fd)
    deadline = time.monotonic() + float(case["timeout_s"])
    err, ended, open_pipe = _Tail(), False, True
    with selectors.DefaultSelector() as sel, os.fdopen(read_fd, "rb", buffering=0) as pipe:
        pidfd = _pidfd(pid)
        try:
            sel.register(pipe, selectors.EVENT_READ)
            if pidfd is not None:
                sel.register(pidfd, selectors.EVENT_READ)
            while open_pipe or not ended:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                ready = {key.fileobj for key, _ in sel.select(left if pidfd is not None else min(left, 0.05))}
                if pipe in ready:
                    data = pipe.read(65536)
                    err.add(data)
                    if not data:
                        sel.unregister(pipe)
                        open_pipe = False
                if not ended and (pidfd in ready if pidfd is not None else _has_ended(pid)):
                    ended = True
                    deadline = min(deadline, time.monotonic() + 2.0)  # a grandchild may hold the pipe: bounded
        finally:
            if pidfd is not None:
                os.close(pidfd)
    _kill_group(pid)  # past its time, or whatever it left running
    status = _reap(pid, time.monotonic() + KILL_WAIT_S)
    returncode = -1 if status is None else os.waitstatus_to_exitcode(status)
    ended = ended or (status is not None and os.WIFEXITED(status))  # it exited as its time ran out
    return {"returncode": returncode, "stderr": err.text(), "timed_out": not ended}


def _pidfd(pid: int) -> int | None:
    """A file descriptor readable once ``pid`` ends (Linux 5.3), or None: then :func:`_has_ended` is polled."""
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):
        return None


def _has_ended(pid: int) -> bool:
    """Whether the child ended, leaving it to be reaped (``WNOWAIT``): its group is killed before the reap."""
    return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None


def serve(component: str, commands: BinaryIO, answers: BinaryIO) -> None:
    """Answer every case line of ``commands`` on ``answers`` until ``commands`` closes."""
    answers.write(b'{"ready": true}\n')
    answers.flush()
    for line in commands:
        case = json.loads(line)
        answer = {"id": case["id"], **run_case(component, case)}
        answers.write(json.dumps(answer).encode() + b"\n")
        answers.flush()


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m tests.support.refusal_runner <component>", file=sys.stderr)
        return 2
    answers = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # a stray print of an import goes to stderr, never into the answers
    preload(argv[0])
    with os.fdopen(os.dup(0), "rb") as commands, answers:
        try:
            serve(argv[0], commands, answers)
        except BrokenPipeError:
            return 0  # the test side is gone
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
