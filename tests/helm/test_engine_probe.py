"""The engine's exec probes as the chart renders them, run for real against a real engine on loopback.

The kubelet runs them inside the engine container, with that container's environment: an ``http_proxy`` there
(set in ``node.engine.extraEnv`` to fetch models) must not carry the check to the proxy, and a check may take
the probe's ``timeoutSeconds``.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helm.chart import container, render
from tests.support.procs import ServerProcess

ENV_PROXIES = ("http_proxy", "HTTP_PROXY", "https_proxy", "HTTPS_PROXY", "all_proxy", "ALL_PROXY",
               "no_proxy", "NO_PROXY")


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    proc = ServerProcess("node_engine", ["--model-path", "builtin:tiny", "--device", "cpu",
                                         "--max-total-tokens", "256"], log_dir=tmp_path_factory.mktemp("engine"))
    proc.start()
    yield proc
    proc.stop()


def _probe_commands(values: dict) -> dict[str, list[str]]:
    (sts,) = render(values).of_kind("StatefulSet")
    engine = container(sts, "engine")
    return {name: engine[name]["exec"]["command"] for name in ("startupProbe", "livenessProbe")}


def _run(command: list[str], env: dict[str, str], timeout_s: float) -> subprocess.CompletedProcess[str]:
    assert command[0] == "python"
    return subprocess.run([sys.executable, *command[1:]], env=env, capture_output=True, text=True,
                          timeout=timeout_s)


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_engine_probes_ignore_a_proxy_in_the_containers_environment(engine: ServerProcess, tmp_path: Path) -> None:
    """Before: urllib sent the check to the proxy; the startup probe never passed and the engine was restarted
    every node.engine.startupTimeoutSeconds, forever."""
    proxy = f"http://127.0.0.1:{_closed_port()}"
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path),
           **{name: proxy for name in ENV_PROXIES if "no_" not in name.lower()}}
    commands = _probe_commands({"node": {"engine": {"port": engine.port}}})
    for name, command in commands.items():
        done = _run(command, env, 30)
        assert done.returncode == 0, (name, done.stderr[-1000:])
    # The probe does check the engine: on another port (nothing there) it fails.
    elsewhere = _probe_commands({"node": {"engine": {"port": _closed_port()}}})
    for name, command in elsewhere.items():
        assert _run(command, env, 30).returncode != 0, name


class _LateHealth:
    """A node whose /health answers 200 after ``delay_s``: a loaded engine, late but alive (fault injection)."""

    def __init__(self, delay_s: float) -> None:
        self.delay_s = delay_s
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(4)
        self.port = int(self.sock.getsockname()[1])
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                conn.recv(4096)
                if self._stop.wait(self.delay_s):
                    return
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok")

    def close(self) -> None:
        self._stop.set()
        self.sock.close()
        self._thread.join(timeout=5)


def test_engine_liveness_check_waits_its_timeout_seconds() -> None:
    """Before: the check gave up after 5 s whatever node.engine.livenessProbe.timeoutSeconds said (10 by
    default), so raising it for an engine that answers late under load changed nothing."""
    late = _LateHealth(delay_s=6.5)
    try:
        commands = _probe_commands({"node": {"engine": {"port": late.port, "livenessProbe": {"timeoutSeconds": 9}}}})
        done = _run(commands["livenessProbe"], {"PATH": "/usr/bin:/bin"}, 30)
        assert done.returncode == 0, done.stderr[-1000:]
        quick = _probe_commands({"node": {"engine": {"port": late.port, "livenessProbe": {"timeoutSeconds": 2}}}})
        assert _run(quick["livenessProbe"], {"PATH": "/usr/bin:/bin"}, 30).returncode != 0
    finally:
        late.close()
