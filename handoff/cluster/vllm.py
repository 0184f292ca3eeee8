"""A vLLM OpenAI server started for a local cluster or a test: a node's engine, behind a sidecar.

vLLM has no port file, so a free port is picked first; its dev endpoints
(sleep, wake-up, weight reload) are switched on (``VLLM_SERVER_DEV_MODE=1``);
nothing is fetched from a hub (``HF_HUB_OFFLINE=1``: the model must be a local
folder). On CPU: ``VLLM_CPU_KVCACHE_SPACE`` GiB of KV cache, threads not
pinned to cores (several engines share the machine), eager mode (no compile
at start). vLLM's engine sockets (``VLLM_RPC_BASE_PATH``) go in a folder of
their own, removed when the process is stopped or killed (vLLM leaves them in
the temporary folder when its group is signalled). The distribution is ``vllm-cpu``, whose ``vllm serve`` entry point
does not start: the server module is run instead. handoff's worker extension
is loaded (``--worker-extension-cls``, :data:`~handoff.protocol.engines.VLLM_WORKER_EXTENSION`): with it the
sidecar serves SGLang's tensor and broadcast weight updates on this node
(handoff must be installed in vLLM's environment, as it is here).

Start-up takes minutes on a small machine (1.5 to 4.5 on 2 cores).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Sequence

from handoff.cluster.process import ServerProcess
from handoff.protocol.engines import VLLM_WORKER_EXTENSION

VLLM_MODULE = "vllm.entrypoints.openai.api_server"
VLLM_START_TIMEOUT_S = 600.0


def vllm_available(python: str | None = None) -> bool:
    """Whether ``python`` (default: this interpreter, or ``HANDOFF_VLLM_PYTHON``) can import vLLM; False when it
    cannot be run at all."""
    python = python or vllm_python()
    if python == sys.executable:
        import importlib.util

        return importlib.util.find_spec("vllm") is not None
    check = "import importlib.util as u; raise SystemExit(u.find_spec('vllm') is None)"
    try:
        result = subprocess.run([python, "-c", check], capture_output=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):  # not a program, not runnable, or hung: no vLLM to be had from it
        return False
    return result.returncode == 0


def vllm_python() -> str:
    return os.environ.get("HANDOFF_VLLM_PYTHON") or sys.executable


def vllm_env(device: str, *, kv_cache_gib: int = 1) -> dict[str, str]:
    env = {"VLLM_SERVER_DEV_MODE": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
    if device == "cpu":
        env.update(VLLM_CPU_KVCACHE_SPACE=str(kv_cache_gib), VLLM_CPU_OMP_THREADS_BIND="nobind",
                   VLLM_CPU_NUM_OF_RESERVED_CPU="0")
    return env


class VllmProcess(ServerProcess):
    """``python -m vllm.entrypoints.openai.api_server --model PATH`` on a free loopback port."""

    def __init__(self, model_path: str, *, log_dir: Path, name: str = "vllm", device: str = "cpu",
                 host: str = "127.0.0.1", args: Sequence[str] = (), env: dict[str, str] | None = None,
                 python: str | None = None, weight_sync: bool = True) -> None:
        cpu_args = ["--enforce-eager", "--dtype", "float32"] if device == "cpu" else ["--enable-sleep-mode"]
        extension = ["--worker-extension-cls", VLLM_WORKER_EXTENSION] if weight_sync else []
        super().__init__(VLLM_MODULE, ["--model", model_path, *cpu_args, *extension, *args], log_dir=log_dir, name=name,
                         env={**vllm_env(device), **(env or {})}, host=host)
        self.python = python or vllm_python()
        self.owns_rpc_dir = "VLLM_RPC_BASE_PATH" not in (env or {})  # else the caller's folder is used as is
        self.rpc_dir: str | None = None  # the folder of this run's engine sockets, while it runs

    def launch(self, *, port: int | None = None) -> "VllmProcess":
        self.port = port or self.port or _free_port(self.host)  # no port file: the port is chosen here
        if self.owns_rpc_dir:
            self._remove_rpc_dir()
            self.rpc_dir = tempfile.mkdtemp(prefix="handoff-vllm-")
            self.env = {**(self.env or {}), "VLLM_RPC_BASE_PATH": self.rpc_dir}
        super().launch(port=self.port)
        return self

    def command(self, port: int) -> list[str]:
        return [self.python, "-m", self.module, *self.args, "--host", self.host, "--port", str(port)]

    def wait_ready(self, *, timeout: float = VLLM_START_TIMEOUT_S) -> "VllmProcess":
        super().wait_ready(timeout=timeout)
        return self

    def start(self, *, timeout: float = VLLM_START_TIMEOUT_S, port: int | None = None) -> "VllmProcess":
        return self.launch(port=port).wait_ready(timeout=timeout)

    def _read_port_file(self) -> str | None:
        self.check_alive()
        return str(self.port)

    def stop(self, timeout: float = 30.0) -> int | None:
        """SIGTERM, then SIGKILL, to the whole process group (vLLM's engine core and workers are its children)."""
        if self.proc is None:
            return None
        self._signal_group(signal.SIGTERM)
        code = super().stop(timeout)
        self._signal_group(signal.SIGKILL)  # a child that outlived its parent
        self._remove_rpc_dir()
        return code

    def kill(self, *, wait: bool = True) -> None:
        self._signal_group(signal.SIGKILL)
        super().kill(wait=wait)
        if wait:
            self._remove_rpc_dir()

    def _remove_rpc_dir(self) -> None:
        if self.rpc_dir is not None:
            shutil.rmtree(self.rpc_dir, ignore_errors=True)  # sockets only: nothing in it is worth an error
            self.rpc_dir = None

    def _signal_group(self, sig: signal.Signals) -> None:
        if self.proc is not None:
            try:
                os.killpg(self.proc.pid, sig)  # the group this process leads (start_new_session)
            except ProcessLookupError:
                pass


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]
