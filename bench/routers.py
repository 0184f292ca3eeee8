"""The routers the LB benchmark compares: handoff's ``python -m lb``, sglang-router and vllm-router.

sglang-router (0.3.x) and vllm-router (0.1.x) are Rust routers with Python
launchers, installed with the ``bench`` extra; one that is not installed is
skipped. Each runs as its own process on a free loopback port, with the
cheapest routing policy it has (``round_robin``: the default ``cache_aware``
keeps a prefix tree per request, which would flatter handoff), its per-request
logging off, and its metrics on a port of its own. A router is ready when a
``POST /generate`` through it answers 200 (sglang-router registers its workers
after it starts listening).
"""

from __future__ import annotations

import importlib.util
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Sequence

import httpx
import psutil

from bench.common import start_server

HANDOFF = "handoff"
SGLANG_ROUTER = "sglang-router"
VLLM_ROUTER = "vllm-router"
_MODULES = {SGLANG_ROUTER: "sglang_router", VLLM_ROUTER: "vllm_router"}
READY_TIMEOUT_S = 120.0


def is_installed(name: str) -> bool:
    return name == HANDOFF or importlib.util.find_spec(_MODULES[name]) is not None


def process_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of the process, all its threads, and its children."""
    process = psutil.Process(pid)
    total = 0.0
    for each in (process, *process.children(recursive=True)):
        times = each.cpu_times()
        total += times.user + times.system
    return total


class Router:
    """One router process in front of some fake nodes; stop it with :meth:`stop`."""

    def __init__(self, name: str, url: str, pid: int, stop: Callable[[], object]) -> None:
        self.name = name
        self.url = url
        self.pid = pid
        self._stop = stop

    def cpu_seconds(self) -> float:
        return process_cpu_seconds(self.pid)

    def stop(self) -> None:
        self._stop()


def start_router(name: str, *, workers: Sequence[str] = (), prefill: str | None = None,
                 decode: str | None = None, bootstrap_port: int = 8998) -> Router:
    """``name`` in front of ``workers`` (regular mode), or of one ``prefill`` and one ``decode`` node (PD)."""
    if name == HANDOFF:
        if prefill is not None:
            args = ["--prefill", f"{prefill}@{bootstrap_port}", "--decode", str(decode)]
        else:
            args = [a for url in workers for a in ("--node", url)]
        lb = start_server("lb", [*args, "--log-level", "warning", "--health-interval", "60"], "lb")
        return Router(name, lb.url, lb.pid, lb.stop)
    port, metrics_port = _free_port(), _free_port()
    argv = [_executable(name), *(["launch"] if name == SGLANG_ROUTER else [])]
    if prefill is not None:
        pd_flag = "--pd-disaggregation" if name == SGLANG_ROUTER else "--vllm-pd-disaggregation"
        argv += [pd_flag, "--prefill", prefill, str(bootstrap_port), "--decode", str(decode)]
    else:
        argv += ["--worker-urls", *workers]
    argv += ["--host", "127.0.0.1", "--port", str(port), "--policy", "round_robin",
             "--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port),
             "--log-level", "warn" if name == SGLANG_ROUTER else "warning",
             "--worker-startup-check-interval", "1", "--health-check-interval-secs", "60"]
    log_path = Path(tempfile.mkdtemp(prefix=f"bench-{name}-")) / "router.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"

    def stop() -> None:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)

    try:
        _wait_ready(url, proc, log_path)
    except BaseException:
        stop()
        raise
    return Router(name, url, proc.pid, stop)


def _executable(name: str) -> str:
    beside = Path(sys.executable).parent / name
    found = str(beside) if beside.exists() else shutil.which(name)
    if found is None:
        raise RuntimeError(f"{name} is installed as a module but its launcher is not on PATH")
    return found


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _wait_ready(url: str, proc: subprocess.Popen[bytes], log_path: Path) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"router exited with {proc.returncode}; log: {log_path}")
        try:
            if httpx.post(url + "/generate", json={"text": "ready?"}, timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass  # not listening yet
        if time.monotonic() > deadline:
            raise RuntimeError(f"router at {url} not ready after {READY_TIMEOUT_S:g} s; log: {log_path}")
        time.sleep(0.2)
