"""A cluster on this machine: N nodes (engine + sidecar) and one LB, all on loopback.

Engines (handoff's, or vLLM servers) start in parallel (loading a model is the slow part), then their
sidecars, then the LB with every sidecar as a node. ``stop`` stops the LB, the
sidecars and the engines in that order and leaves no process behind.
"""

from __future__ import annotations

import logging
import os
import socket
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from handoff.cluster.process import ProcessFailed, ServerProcess, wait_all_ready, wait_until
from handoff.cluster.vllm import VLLM_START_TIMEOUT_S, VllmProcess

log = logging.getLogger(__name__)

ENGINE_KINDS = ("handoff", "vllm")  # what a local cluster can start (SGLang needs a GPU and its own launcher)
# Each node is two processes and an engine's memory on one machine: past this, a typo (--nodes 1000) would fork
# until the machine gives out; a larger cluster is a Kubernetes one (docs/kubernetes.md).
MAX_LOCAL_NODES = 64
# A cluster's tokens are its spec's (``handoff up`` reads these variables into it): inherited, they made the LB and
# the sidecars of a cluster with none (``handoff demo``) ask for a token its client never sends.
TOKEN_VARIABLES = frozenset({"HANDOFF_ADMIN_TOKEN", "HANDOFF_API_KEY"})


@dataclass(frozen=True)
class ClusterSpec:
    """What to start. ``free_memory_override_files``: a fault-drill hook, one entry per node (by index,
    ``None`` for none): the engine of that node is started with ``--free-memory-override-file PATH``, so
    writing a small number of bytes to the file makes its next resume see too little free memory (507)
    and emptying the file restores the real figure. Shorter than the node count: the rest get none."""

    num_mixed: int = 2
    num_prefill: int = 0
    num_decode: int = 0
    model_path: str = "builtin:tiny"
    model_override: str | None = None
    device: str = "cpu"
    weights_backup: str = "none"
    lb_port: int = 0
    admin_token: str | None = field(default=None, repr=False)
    api_key: str | None = field(default=None, repr=False)
    hold_requests: bool = False
    engine_args: tuple[str, ...] = ()
    sidecar_args: tuple[str, ...] = ()
    lb_args: tuple[str, ...] = ()
    host: str = "127.0.0.1"
    free_memory_override_files: tuple[str | None, ...] = ()
    engine_kinds: tuple[str, ...] = ()   # per node, by index: "handoff" (the default) or "vllm" (a local folder)

    def __post_init__(self) -> None:
        for name in ("num_mixed", "num_prefill", "num_decode"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0")
        if self.num_nodes == 0:
            raise ValueError("a cluster needs at least one node")
        if self.num_nodes > MAX_LOCAL_NODES:
            raise ValueError(f"a local cluster has at most {MAX_LOCAL_NODES} nodes (--nodes, --prefill and --decode "
                             f"together), got {self.num_nodes}")
        if (self.num_prefill == 0) != (self.num_decode == 0):
            raise ValueError("prefill and decode nodes come together: give both --prefill and --decode")
        if self.weights_backup not in ("none", "cpu", "disk"):
            raise ValueError(f"weights_backup must be none, cpu or disk, got {self.weights_backup!r}")
        if len(self.engine_kinds) > self.num_nodes or set(self.engine_kinds) - set(ENGINE_KINDS):
            raise ValueError(f"engine_kinds {list(self.engine_kinds)}: at most one per node, each one of "
                             f"{', '.join(ENGINE_KINDS)}")
        if "vllm" in self.engine_kinds and not Path(self.model_path).is_dir():
            raise ValueError(f"vLLM nodes need a local model folder (--model-path DIR), got {self.model_path!r}")
        if len(self.free_memory_override_files) > self.num_nodes:
            raise ValueError(f"free_memory_override_files has {len(self.free_memory_override_files)} entries "
                             f"for {self.num_nodes} nodes")

    @property
    def num_nodes(self) -> int:
        return self.num_mixed + self.num_prefill + self.num_decode

    def roles(self) -> list[str]:
        return ["mixed"] * self.num_mixed + ["prefill"] * self.num_prefill + ["decode"] * self.num_decode

    def engine_kind(self, index: int) -> str:
        return self.engine_kinds[index] if index < len(self.engine_kinds) else "handoff"


@dataclass
class NodeProcesses:
    name: str
    role: str
    engine: ServerProcess
    sidecar: ServerProcess

    @property
    def url(self) -> str:
        return self.sidecar.url


class LocalCluster:
    def __init__(self, spec: ClusterSpec, log_dir: Path, *, die_with_parent: bool = False) -> None:
        """``die_with_parent``: every process gets SIGTERM when the one that started it dies, however (see
        :attr:`ServerProcess.die_with_parent`); for ``handoff up``, which starts them from its main thread."""
        self.spec = spec
        self.log_dir = log_dir
        self.die_with_parent = die_with_parent
        self.nodes: list[NodeProcesses] = []
        self.lb: ServerProcess | None = None
        self._launched: list[ServerProcess] = []  # everything started, in start order

    @property
    def url(self) -> str:
        if self.lb is None:
            raise RuntimeError("the cluster is not started")
        return self.lb.url

    def processes(self) -> list[ServerProcess]:
        return list(self._launched)

    def _token_env(self) -> dict[str, str]:
        env = {}
        if self.spec.admin_token:
            env["HANDOFF_ADMIN_TOKEN"] = self.spec.admin_token
        if self.spec.api_key:
            env["HANDOFF_API_KEY"] = self.spec.api_key
        return env

    def _engine_args(self, index: int) -> tuple[list[str], dict[str, str]]:
        spec = self.spec
        args = ["--model-path", spec.model_path, "--device", spec.device, "--enable-memory-saver",
                "--weights-backup", spec.weights_backup]
        if spec.weights_backup != "none":
            args += ["--backup-dir", str(self.log_dir / f"backup-node{index}")]
        if spec.model_override:
            args += ["--model-override", spec.model_override]
        drills = spec.free_memory_override_files
        if index < len(drills) and drills[index] is not None:
            args += ["--free-memory-override-file", str(drills[index])]
        env: dict[str, str] = {}
        if spec.device == "cpu":
            # N engines on one machine: split the cores instead of each taking them all.
            args += ["--num-threads", str(max(1, (os.cpu_count() or 1) // spec.num_nodes))]
        else:
            env["CUDA_VISIBLE_DEVICES"] = str(index % max(1, _num_gpus()))
        return args + list(spec.engine_args), env

    def _engine(self, index: int) -> ServerProcess:
        spec = self.spec
        name = f"node{index}-engine"
        if spec.engine_kind(index) == "vllm":
            env = {} if spec.device == "cpu" else {"CUDA_VISIBLE_DEVICES": str(index % max(1, _num_gpus()))}
            return VllmProcess(spec.model_path, log_dir=self.log_dir, name=name, device=spec.device, host=spec.host,
                               env=env)
        args, env = self._engine_args(index)
        return ServerProcess("node_engine", args, log_dir=self.log_dir, name=name, env=env, host=spec.host)

    def start(self, *, timeout: float = 300.0) -> "LocalCluster":
        spec = self.spec
        if spec.lb_port:
            _check_port_free(spec.host, spec.lb_port)  # before minutes of model loading, not after
        try:
            engines: dict[ServerProcess, float] = {}  # each engine and its start timeout
            indexes: dict[ServerProcess, int] = {}
            for index in range(spec.num_nodes):
                engine = self._launch(self._engine(index))
                self._launched.append(engine)
                indexes[engine] = index
                engines[engine] = max(timeout, VLLM_START_TIMEOUT_S) if isinstance(engine, VllmProcess) else timeout
            # every process watched at once: one that failed is reported at once, not after the others' loads;
            # each engine's sidecar starts as soon as that engine is up
            wait_all_ready(engines, watched=self.processes,
                           on_ready=lambda engine: self._start_sidecar(indexes[engine], engine))
            self.nodes.sort(key=lambda node: indexes[node.engine])
            wait_all_ready({node.sidecar: timeout for node in self.nodes}, watched=self.processes,
                           on_ready=lambda _sidecar: None)
            # serving, not only up: the sidecars have read their engines' state (seconds for a vLLM engine)
            try:
                wait_until(self._all_serving, timeout=timeout, what="every node serving")
            except TimeoutError:  # not ProcessFailed: ``handoff up`` showed a traceback naming no node
                raise ProcessFailed(self._not_serving(timeout)) from None
            lb_args = ["--health-interval", "1", *spec.lb_args]
            for node in self.nodes:
                flag = {"mixed": "--node", "prefill": "--prefill", "decode": "--decode"}[node.role]
                lb_args += [flag, node.url]
            self.lb = ServerProcess("lb", lb_args, log_dir=self.log_dir, name="lb", env=self._token_env(),
                                    host=spec.host)
            self._launched.append(self._launch(self.lb, port=spec.lb_port or None))
            self.lb.wait_ready(timeout=timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def _all_serving(self) -> bool:
        """Every node's ``/ready`` is 200; :class:`ProcessFailed` as soon as any process has exited."""
        for proc in self.processes():
            proc.check_alive()
        return all(httpx.get(node.url + "/ready", timeout=5).status_code == 200 for node in self.nodes)

    def _not_serving(self, timeout: float) -> str:
        """The nodes whose ``/ready`` is still not 200, each with the reason it gives and its sidecar's log."""
        parts = []
        for node in self.nodes:
            try:
                answer = httpx.get(node.url + "/ready", timeout=5)
                if answer.status_code == 200:
                    continue
                why = f"{answer.status_code} {answer.json().get('reason')}"
            except (httpx.HTTPError, ValueError, AttributeError) as exc:  # not answering, or not a JSON object
                why = repr(exc)
            parts.append(f"{node.name} is not serving after {timeout:g} s (its /ready: {why})\n"
                         f"{node.sidecar.log_tail(10)}")
        return "\n".join(parts) or f"the nodes were not all serving within {timeout:g} s"

    def _start_sidecar(self, index: int, engine: ServerProcess) -> None:
        """Launch the sidecar of node ``index``, whose ``engine`` is now up."""
        spec = self.spec
        role = spec.roles()[index]
        sidecar_args = ["--engine-url", engine.url, "--engine-kind", spec.engine_kind(index), "--role", role,
                        *spec.sidecar_args]
        if spec.hold_requests:
            sidecar_args.append("--hold-requests")
        sidecar = ServerProcess("node_sidecar", sidecar_args, log_dir=self.log_dir, name=f"node{index}-sidecar",
                                env=self._token_env(), host=spec.host)
        self._launched.append(self._launch(sidecar))
        self.nodes.append(NodeProcesses(f"node{index}", role, engine, sidecar))

    def _launch(self, proc: ServerProcess, *, port: int | None = None) -> ServerProcess:
        proc.die_with_parent = self.die_with_parent
        proc.env_unset = TOKEN_VARIABLES
        return proc.launch(port=port)

    def dead_processes(self) -> list[ServerProcess]:
        """Processes that were started and are no longer running."""
        return [p for p in self.processes() if p.proc is not None and not p.is_running()]

    def stop(self, timeout: float = 10.0) -> None:
        """Stop everything, front to back (LB, sidecars, engines); SIGKILL whatever outlives ``timeout``."""
        rank = {"lb": 0, "node_sidecar": 1}
        for level in range(3):
            group = [p for p in self._launched if rank.get(p.module, 2) == level]  # engines of any kind last
            for proc in group:
                proc.terminate()
            for proc in group:
                proc.stop(timeout)

    def kill(self, *, wait: bool = True) -> None:
        """SIGKILL every process still running (``wait=False``: without waiting for them to end; safe in a signal
        handler that interrupted :meth:`stop`, which then sees them end)."""
        for proc in self._launched:
            proc.kill(wait=wait)

    def __enter__(self) -> "LocalCluster":
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


def _num_gpus() -> int:
    try:
        import torch

        return torch.cuda.device_count()
    except ImportError:
        return 0


def _check_port_free(host: str, port: int) -> None:
    """:class:`ProcessFailed` naming the LB's port when something already listens there."""
    try:
        with socket.create_server((host, port)):
            pass
    except OSError as exc:
        raise ProcessFailed(f"the LB's port {host}:{port} cannot be listened on: {exc.strerror or exc}") from None
