"""``handoff up`` starts a working cluster, reports dead children, and leaves nothing behind, however it is
stopped (SIGTERM, SIGHUP, SIGKILL, Ctrl-C while starting); bad flags are one line and exit 2."""

from __future__ import annotations

import os
import re
import signal
import fcntl
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import httpx
import psutil
import pytest

from handoff.cli import LOCK_FILE, main as cli_main
from handoff.cluster.local import MAX_LOCAL_NODES, ClusterSpec, LocalCluster
from handoff.cluster.process import ProcessFailed, ServerProcess
from tests.support.procs import REPO_ROOT, assert_refused_at_start, sigint_by_default, wait_until
from tests.support.streams import GenerationClient


def test_up_starts_serves_and_stops_cleanly(tmp_path: Path) -> None:
    out = tmp_path / "up.out"
    with open(out, "wb") as sink:
        proc = subprocess.Popen([sys.executable, "-m", "handoff", "up", "--nodes", "2", "--port", "0",
                                 "--log-dir", str(tmp_path / "logs")], stdout=sink, stderr=subprocess.STDOUT,
                                cwd=REPO_ROOT)
    try:
        text = wait_until(lambda: (t := out.read_text()) and "Ctrl-C" in t and t, timeout=120,
                          what="the banner")
        lb = re.search(r"LB\s+(http://\S+)", text).group(1)
        assert "curl -s" in text and "/release_memory_occupation" in text and "/generate" in text
        children = psutil.Process(proc.pid).children(recursive=True)
        assert len(children) == 5  # 2 engines, 2 sidecars, 1 LB
        r = httpx.post(lb + "/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 3}}, timeout=30)
        assert r.status_code == 200
        # a child that dies is reported at once, with its log
        engine = next(c for c in children if "node_engine" in " ".join(c.cmdline()))
        engine.kill()
        wait_until(lambda: "exited with code" in out.read_text(), timeout=10, what="the death report")
        assert "last lines of" in out.read_text()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 1  # a process died while it ran
        alive = [c for c in children if c.is_running() and c.status() != psutil.STATUS_ZOMBIE]
        assert not alive, [c.cmdline() for c in alive]
    finally:
        if proc.poll() is None:
            proc.kill()


def start_up(tmp_path: Path, *args: str, wrapper: tuple[str, ...] = ()) -> tuple[subprocess.Popen[bytes], Path]:
    out = tmp_path / "up.out"
    with open(out, "wb") as sink:
        proc = subprocess.Popen([*wrapper, sys.executable, "-m", "handoff", "up", "--nodes", "1", "--port", "0",
                                 "--log-dir", str(tmp_path / "logs"), *args], stdout=sink, stderr=subprocess.STDOUT,
                                cwd=REPO_ROOT, preexec_fn=sigint_by_default)
    return proc, out


def no_child_left(children: list[psutil.Process]) -> bool:
    return not [c for c in children if c.is_running() and c.status() != psutil.STATUS_ZOMBIE]


def kill_all(proc: subprocess.Popen, children: list[psutil.Process]) -> None:
    """A test's cleanup: the command and whatever it started, if still there."""
    if proc.poll() is None:
        proc.kill()
    for child in children:
        if child.is_running():
            child.kill()


class DemoRun:
    """``handoff demo --nodes 1`` in a process of its own, started by ``command`` (``-m handoff`` or a script and
    its arguments), its output in a file; on leaving the block it and every process it started are killed if
    still there."""

    def __init__(self, tmp_path: Path, *command: str) -> None:
        self.out = tmp_path / "demo.out"
        with open(self.out, "wb") as sink:
            self.proc = subprocess.Popen([sys.executable, *command, "demo", "--nodes", "1",
                                          "--log-dir", str(tmp_path / "logs")], stdout=sink, stderr=subprocess.STDOUT,
                                         cwd=REPO_ROOT, preexec_fn=sigint_by_default)
        self.children: list[psutil.Process] = []

    def __enter__(self) -> DemoRun:
        return self

    def __exit__(self, *exc: object) -> None:
        kill_all(self.proc, self.children)

    def output(self) -> str:
        return self.out.read_text()

    def wait_for(self, ready: Callable[[], bool], what: str, timeout: float = 120) -> None:
        """Wait until ``ready`` (the cluster up: :meth:`has_cluster`), then note the processes the demo started."""
        wait_until(ready, timeout=timeout, what=what)
        self.children = psutil.Process(self.proc.pid).children(recursive=True)

    def has_cluster(self) -> bool:
        return "LB at" in self.output()

    def assert_exit(self, code: int, timeout: float) -> None:
        """The demo exits with ``code``, with no traceback, and leaves no process it started."""
        assert self.proc.wait(timeout) == code, self.output()[-2000:]
        assert "Traceback" not in self.output(), self.output()[-2000:]
        wait_until(lambda: no_child_left(self.children), timeout=30, what="every child gone")


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGHUP])
def test_no_process_outlives_up_however_it_dies(tmp_path: Path, sig: signal.Signals) -> None:
    proc, out = start_up(tmp_path)
    try:
        wait_until(lambda: "Ctrl-C" in out.read_text(), timeout=120, what="the banner")
        children = psutil.Process(proc.pid).children(recursive=True)
        assert len(children) == 3
        proc.send_signal(sig)
        proc.wait(30)
        wait_until(lambda: no_child_left(children), timeout=30, what="every child gone")
    finally:
        if proc.poll() is None:
            proc.kill()


def test_a_hangup_ignored_by_nohup_stays_ignored(tmp_path: Path) -> None:
    proc, out = start_up(tmp_path, wrapper=("nohup",))
    try:
        wait_until(lambda: "Ctrl-C" in out.read_text(), timeout=120, what="the banner")
        proc.send_signal(signal.SIGHUP)
        with pytest.raises(subprocess.TimeoutExpired):
            proc.wait(2)  # still up: the logout that sent it is what nohup is for
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()


def test_ctrl_c_while_starting_stops_at_once(tmp_path: Path) -> None:
    proc, out = start_up(tmp_path)
    try:
        wait_until(lambda: len(psutil.Process(proc.pid).children()) >= 1, timeout=30, what="an engine launched")
        children = psutil.Process(proc.pid).children(recursive=True)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(30) == 130
        assert "stopping while starting" in out.read_text() and "Ctrl-C stops" not in out.read_text()
        wait_until(lambda: no_child_left(children), timeout=30, what="every child gone")
    finally:
        if proc.poll() is None:
            proc.kill()


BAD_FLAGS = [  # (the flag the message must name, the arguments, the environment); {file}: a file, not a folder
    ("--log-dir", ["up", "--log-dir", "{file}"], {}),
    ("--log-dir", ["up", "--log-dir", "/proc/self"], {}),  # no file can be made in it, for root too
    ("--log-dir", ["demo", "--log-dir", "/proc/self"], {}),
    ("--log-dir", ["up", "--nodes", "0", "--log-dir", ""], {}),  # it was the current folder (--nodes 0: never up)
    ("--nodes", ["demo", "--nodes", "0"], {}),
    ("--nodes", ["up", "--nodes", "-1"], {}),
    ("--nodes", ["up", "--nodes", "1.5"], {}),
    ("--nodes", ["up", "--nodes", "100000"], {}),  # forked until the machine gave out (found by review)
    ("--nodes", ["demo", "--nodes", "65"], {}),
    ("--prefill", ["up", "--prefill", "40", "--decode", "40"], {}),
    ("--port", ["up", "--port", "70000"], {}),
    ("--port", ["up", "--port", ""], {}),
    # review, stop 42: digits of other scripts (int() reads them) were taken: "--nodes \u0663" started 3 nodes
    ("--nodes", ["up", "--nodes", "\u0663"], {}),
    ("--port", ["up", "--nodes", "1", "--port", "\u0668\u0660\u0660\u0660"], {}),
    ("--device", ["up", "--device", "CUDA"], {}),
    ("--engine-kind", ["up", "--engine-kind", "VLLM"], {}),
    ("--model", ["demo", "--model", "builtin:TINY"], {}),
    ("--admin-token", ["up", "--admin-token", " "], {}),
    ("--api-key", ["up"], {"HANDOFF_API_KEY": "t\u00f6k"}),
    ("HANDOFF_VLLM_PYTHON", ["up", "--engine-kind", "vllm"], {"HANDOFF_VLLM_PYTHON": "/nonexistent/python"}),
    # values the engines refused only once launched: exit 1 "cannot start the cluster" (found by review)
    ("--model-override", ["up", "--nodes", "1", "--model-override", "{bad"], {}),
    ("--model-override", ["up", "--nodes", "1", "--model-override", "[1]"], {}),
    ("--model-override", ["up", "--nodes", "1", "--model-override", '{"vocab_size": 5}'], {}),
    ("--model-override", ["up", "--nodes", "1", "--model-override", '{"num_layers": "four"}'], {}),
    ("--model-override", ["up", "--nodes", "1", "--model-path", "/nonexistent", "--model-override", "{}"], {}),
    ("--model-path", ["up", "--nodes", "1", "--model-path", "builtin:huge"], {}),
    ("--model-path", ["up", "--nodes", "1", "--model-path", "/nonexistent/model"], {}),
    ("--model-path", ["up", "--nodes", "1", "--model-path", "{file}"], {}),
    ("--model-path", ["up", "--nodes", "1", "--model-path", "/proc/self"], {}),  # a folder, no checkpoint in it
    # review G: the engines started, then refused every prompt (a context of 1 token)
    ("--model-override", ["up", "--nodes", "1", "--model-override", '{"max_position_embeddings": 1}'], {}),
]


@pytest.mark.parametrize(("flag", "args", "env"), BAD_FLAGS, ids=[" ".join(c[1]) for c in BAD_FLAGS])
def test_bad_flags_are_one_line_and_exit_2(flag: str, args: list[str], env: dict[str, str], tmp_path: Path) -> None:
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("x")
    assert_refused_at_start(["handoff", *(a.replace("{file}", str(not_a_dir)) for a in args)], flag, env=env)


def test_a_port_in_use_fails_before_any_engine_loads(tmp_path: Path) -> None:
    with socket.create_server(("127.0.0.1", 0)) as taken:
        done = subprocess.run([sys.executable, "-m", "handoff", "up", "--nodes", "1", "--port",
                               str(taken.getsockname()[1]), "--log-dir", str(tmp_path / "logs")], cwd=REPO_ROOT,
                              capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and "cannot be listened on" in done.stdout, done.stdout[-500:]
    assert not list((tmp_path / "logs").glob("*engine*.log"))  # nothing was started


@pytest.mark.parametrize("command", ["up", "demo"])
def test_a_log_folder_another_cluster_holds_is_refused_before_anything_starts(command: str, tmp_path: Path) -> None:
    """Two clusters in one log folder read each other's port files (a sidecar attached to the other cluster's
    engine) and mix their logs: the second is refused while the first holds the folder."""
    logs = tmp_path / "logs"
    logs.mkdir()
    with open(logs / LOCK_FILE, "a+") as held:  # what a running cluster holds
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        held.write("4242")
        held.flush()
        done = subprocess.run([sys.executable, "-m", "handoff", command, "--nodes", "1", "--log-dir", str(logs)],
                              cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stdout[-500:] + done.stderr[-500:]
    assert "in use by another handoff cluster (pid 4242)" in done.stderr, done.stderr
    assert not list(logs.glob("*.log"))  # nothing was started


@pytest.mark.parametrize("kind", ["folder", "fifo"])
def test_a_lock_file_that_cannot_be_one_is_refused_in_a_line(kind: str, tmp_path: Path) -> None:
    """A log folder whose lock file is a folder or a FIFO (a FIFO's open would wait for a writer) is exit 2
    naming --log-dir, not a traceback."""
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / LOCK_FILE).mkdir() if kind == "folder" else os.mkfifo(logs / LOCK_FILE)
    stderr = assert_refused_at_start(["handoff", "up", "--nodes", "1", "--log-dir", str(logs)], "--log-dir")
    assert LOCK_FILE in stderr and not list(logs.glob("*.log"))  # nothing was started


def test_ctrl_c_while_checking_for_vllm_exits_130_without_a_traceback(tmp_path: Path) -> None:
    """The check that HANDOFF_VLLM_PYTHON can import vLLM may take a minute; Ctrl-C during it ends the command
    as Ctrl-C ends a start (130), not in a KeyboardInterrupt traceback."""
    marker = tmp_path / "checking"
    python = tmp_path / "python"
    python.write_text(f"#!/bin/sh\ntouch {marker}\nexec sleep 60\n")
    python.chmod(0o755)
    proc = subprocess.Popen([sys.executable, "-m", "handoff", "up", "--engine-kind", "vllm"], cwd=REPO_ROOT,
                            env={**os.environ, "HANDOFF_VLLM_PYTHON": str(python)}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, preexec_fn=sigint_by_default)
    try:
        wait_until(marker.exists, timeout=30, what="the vLLM check running")
        proc.send_signal(signal.SIGINT)
        _, stderr = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130 and "Traceback" not in stderr and "interrupted" in stderr, stderr


def test_a_second_ctrl_c_kills_what_is_still_stopping(tmp_path: Path) -> None:
    """A stream in flight holds the LB in its graceful shutdown (5 s); a second Ctrl-C then did nothing more."""
    proc, out = start_up(tmp_path)
    try:
        text = wait_until(lambda: (t := out.read_text()) and "Ctrl-C" in t and t, timeout=120, what="the banner")
        lb = re.search(r"LB\s+(http://\S+)", text).group(1)
        children = psutil.Process(proc.pid).children(recursive=True)
        stream = GenerationClient(lb + "/generate", {"text": "go on", "stream": True, "sampling_params": {
            "max_new_tokens": 4000, "ignore_eos": True}}, timeout=60)
        stream.start()
        assert stream.started_streaming.wait(30) and stream.result.error is None, stream.result
        proc.send_signal(signal.SIGINT)
        wait_until(lambda: "\nstopping" in out.read_text(), timeout=10, what="the stop under way")
        proc.send_signal(signal.SIGINT)
        assert proc.wait(30) == 0
        assert "SIGINT again: killed every process still stopping" in out.read_text(), out.read_text()[-500:]
        assert "Application shutdown complete" not in (tmp_path / "logs" / "lb.log").read_text()  # cut short
        wait_until(lambda: no_child_left(children), timeout=30, what="every child gone")
        stream.finish(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_no_process_outlives_a_stopped_demo(tmp_path: Path, sig: signal.Signals) -> None:
    """``handoff demo`` stopped by SIGTERM died at once and left its LB, sidecar and engine running (its cluster
    had no parent-death signal); Ctrl-C ended in a KeyboardInterrupt traceback."""
    with DemoRun(tmp_path, "-m", "handoff") as demo:
        demo.wait_for(demo.has_cluster, "the demo's cluster")
        assert len(demo.children) == 3
        demo.proc.send_signal(sig)
        demo.assert_exit(130 if sig == signal.SIGINT else -signal.SIGTERM, 60)



# ``handoff demo`` whose step-1 checkpoint takes two minutes to write: the file is touched when the write starts
SLOW_CHECKPOINT_DEMO = """
import pathlib, sys, time
import node_engine.model.builtin as builtin
def slow_save(*args, **kwargs):
    pathlib.Path(sys.argv[1]).touch()
    time.sleep(120)
builtin.save_checkpoint = slow_save
from handoff.cli import main
sys.exit(main(sys.argv[2:]))
"""


# ``handoff demo`` whose engine, restarted in the last step, takes two minutes to come up again
SLOW_RESTART_DEMO = """
import pathlib, sys
from handoff.cluster.process import ServerProcess
launch = ServerProcess.launch
def slow_restart(self, **kwargs):
    if self._num_starts and self.module == "node_engine":
        pathlib.Path(sys.argv[1]).touch()
        self.wrapper = [sys.executable, "-c",
                        "import os, sys, time; time.sleep(120); os.execv(sys.argv[1], sys.argv[1:])"]
    return launch(self, **kwargs)
ServerProcess.launch = slow_restart
from handoff.cli import main
sys.exit(main(sys.argv[2:]))
"""


@pytest.mark.parametrize("script", [SLOW_CHECKPOINT_DEMO, SLOW_RESTART_DEMO], ids=["checkpoint", "restart"])
def test_ctrl_c_while_the_demo_waits_outside_its_event_loop_stops_at_once(script: str, tmp_path: Path) -> None:
    """Step 4 wrote its checkpoint (torch's import, the weights, the file) and the last step waited for the engine
    it restarted, both blocking the demo's event loop: Ctrl-C, a cancel of the steps, waited until they were done
    (tens of seconds on a loaded machine)."""
    marker = tmp_path / "slow-part"
    with DemoRun(tmp_path, "-c", script, str(marker)) as demo:
        demo.wait_for(marker.exists, "the slow part", timeout=180)
        demo.proc.send_signal(signal.SIGINT)
        demo.assert_exit(130, 30)
        assert "interrupted: stopping the cluster" in demo.output()



# ``handoff demo`` that gets Ctrl-C the moment numpy's import begins (torch's import brings it in, from C code)
CTRL_C_IN_NUMPY_IMPORT_DEMO = """
import signal, sys
class CtrlCAtNumpy:
    def find_spec(self, name, path=None, target=None):
        if name == "numpy" and not getattr(self, "fired", False):
            self.fired = True
            signal.raise_signal(signal.SIGINT)
        return None
sys.meta_path.insert(0, CtrlCAtNumpy())
from handoff.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_ctrl_c_during_the_import_of_numpy_stops_the_demo(tmp_path: Path) -> None:
    """torch's import loads numpy from C code that takes any exception there for a failed import and goes on: a
    Ctrl-C at that moment was lost (the demo played on, or failed on a half-made numpy: exit 1)."""
    with DemoRun(tmp_path, "-c", CTRL_C_IN_NUMPY_IMPORT_DEMO) as demo:
        demo.wait_for(demo.has_cluster, "the demo's cluster")
        demo.assert_exit(130, 60)
        assert "interrupted: stopping the cluster" in demo.output()



# ``handoff demo`` that gets Ctrl-C in step 2 once its streams are in flight
CTRL_C_WHILE_STREAMING_DEMO = """
import signal, sys
from handoff.demo import Demo
wait_in_flight = Demo.wait_in_flight
async def then_ctrl_c(self, minimum):
    await wait_in_flight(self, minimum)
    signal.raise_signal(signal.SIGINT)
Demo.wait_in_flight = then_ctrl_c
from handoff.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_ctrl_c_while_the_demo_streams_leaves_no_stream_behind(tmp_path: Path) -> None:
    """The streams of a step cut short by Ctrl-C were left running: each failed once the client closed, and its
    error came out as a "Task exception was never retrieved" traceback."""
    with DemoRun(tmp_path, "-c", CTRL_C_WHILE_STREAMING_DEMO) as demo:
        demo.wait_for(demo.has_cluster, "the demo's cluster")
        demo.assert_exit(130, 120)
        assert "interrupted: stopping the cluster" in demo.output()



# ``handoff demo`` whose LB has SIGTERM blocked (its graceful stop waits 10 s on it, and the parent-death signal does
# not end it); the file is touched when the stop begins
DEAF_LB_DEMO = """
import pathlib, sys
from handoff.cluster.local import LocalCluster
from handoff.cluster.process import ServerProcess
launch, terminate, stop = ServerProcess.launch, ServerProcess.terminate, LocalCluster.stop
def deaf_lb(self, **kwargs):
    if self.module == "lb":
        self.wrapper = [sys.executable, "-c", "import os, signal, sys; signal.pthread_sigmask(signal.SIG_BLOCK, "
                        "[signal.SIGTERM]); os.execv(sys.argv[1], sys.argv[1:])"]
    return launch(self, **kwargs)
def terminate_and_say(self):
    pathlib.Path(sys.argv[1]).touch()
    terminate(self)
ServerProcess.launch, ServerProcess.terminate = deaf_lb, terminate_and_say
LocalCluster.stop = lambda self, timeout=10.0: stop(self, 60.0)  # a graceful wait no slow machine comes near
from handoff.cli import main
sys.exit(main(sys.argv[2:]))
"""


def test_ctrl_c_again_while_the_demo_stops_kills_its_cluster(tmp_path: Path) -> None:
    """A second Ctrl-C while the demo stopped its cluster raised KeyboardInterrupt inside the stop, which ended
    there: the processes were left to their parent-death signal (SIGTERM), which one that ignores it outlived."""
    marker = tmp_path / "stopping"
    with DemoRun(tmp_path, "-c", DEAF_LB_DEMO, str(marker)) as demo:
        demo.wait_for(demo.has_cluster, "the demo's cluster")
        demo.proc.send_signal(signal.SIGINT)
        wait_until(marker.exists, timeout=30, what="the stop")
        started = time.monotonic()
        demo.proc.send_signal(signal.SIGINT)
        demo.assert_exit(130, 30)
        assert time.monotonic() - started < 25  # not the 60 s graceful wait on the deaf LB



def test_a_cluster_past_the_local_bound_is_refused_before_anything_starts(capsys: pytest.CaptureFixture[str]) -> None:
    """``--nodes 100000`` started launching 100000 engines (found by review)."""
    for argv in (["up", "--nodes", "100000"], ["demo", "--nodes", "65"], ["up", "--decode", "65"]):
        with pytest.raises(SystemExit) as info:
            cli_main(argv)
        assert info.value.code == 2 and argv[1] in capsys.readouterr().err
    with pytest.raises(ValueError, match=f"at most {MAX_LOCAL_NODES} nodes"):
        ClusterSpec(num_mixed=MAX_LOCAL_NODES - 10, num_prefill=10, num_decode=10)
    assert ClusterSpec(num_mixed=MAX_LOCAL_NODES).num_nodes == MAX_LOCAL_NODES


# a real engine that takes two minutes to come up: it sleeps, then becomes the engine (same pid)
SLOW_START = [sys.executable, "-c", "import os, sys, time; time.sleep(120); os.execv(sys.argv[1], sys.argv[1:])"]


class _SlowFirstEngine(LocalCluster):
    def _engine(self, index: int) -> ServerProcess:
        engine = super()._engine(index)
        if index == 0:
            engine.wrapper = list(SLOW_START)
        return engine


def test_an_engine_that_fails_is_reported_at_once_whatever_its_place(tmp_path: Path) -> None:
    """The engines were waited for in order: node1's engine, refused at once, was noticed only once node0's had
    loaded (minutes for a real model, or its whole timeout when it hangs) (found by review)."""
    folder = tmp_path / "a-folder"  # the engine's --free-memory-override-file must be a file: exit 2 at start
    folder.mkdir()
    spec = ClusterSpec(num_mixed=2, free_memory_override_files=(None, str(folder)))
    cluster = _SlowFirstEngine(spec, tmp_path / "logs")
    started = time.monotonic()
    with pytest.raises(ProcessFailed, match="node1-engine exited with 2") as info:
        cluster.start(timeout=100)
    assert time.monotonic() - started < 60 and "--free-memory-override-file" in str(info.value), str(info.value)
    assert not [p.name for p in cluster.processes() if p.is_running()]  # the slow one was stopped too


def test_token_variables_of_the_caller_reach_no_process_of_a_cluster_without_tokens(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``handoff demo`` run in a shell that had exported ``HANDOFF_API_KEY`` (for ``handoff up``, as the docs show)
    failed its first step with 401: the LB and the sidecars took the inherited variable for their token, the demo's
    client sent none (review F). A cluster's tokens are its spec's; the caller's variables reach no process."""
    monkeypatch.setenv("HANDOFF_API_KEY", "from-the-shell")
    monkeypatch.setenv("HANDOFF_ADMIN_TOKEN", "from-the-shell-too")
    with LocalCluster(ClusterSpec(num_mixed=1), tmp_path / "logs") as cluster:
        r = httpx.post(cluster.url + "/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 2}},
                       timeout=30)
        assert r.status_code == 200, r.text
        assert httpx.post(cluster.url + "/flush_cache", timeout=30).status_code == 200
        for proc in cluster.processes():
            leaked = {"HANDOFF_API_KEY", "HANDOFF_ADMIN_TOKEN"} & set(psutil.Process(proc.pid).environ())
            assert not leaked, (proc.name, leaked)


def test_a_node_that_never_serves_is_named_not_a_traceback(tmp_path: Path) -> None:
    """A node up but never serving (here its sidecar takes handoff's engine for a vLLM one and never syncs) ended the
    start in a bare ``TimeoutError``: ``handoff up`` printed a traceback naming no node (review F). It is the start
    failure ``up`` and the demo report, naming the node, the reason its ``/ready`` gives, and its sidecar's log."""
    cluster = LocalCluster(ClusterSpec(num_mixed=1, sidecar_args=("--engine-kind", "vllm")), tmp_path / "logs")
    with pytest.raises(ProcessFailed, match=r"node0 is not serving after 30 s \(its /ready: 503 \w+\)") as info:
        cluster.start(timeout=30)
    assert "last lines of" in str(info.value) and "node0-sidecar.log" in str(info.value)
    assert not [p.name for p in cluster.processes() if p.is_running()]
