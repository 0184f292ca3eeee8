"""Every bad flag value of ``python -m node_engine`` is a one-line error naming the flag, exit 2, before a
model loads."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterator

import pytest

from tests.support.procs import assert_refused_at_start
from tests.support.refusals import RefusalRunner, refusal_runner

# (the flag the message must name, the arguments); {tmp} is a folder of the test's own, {file} a file in it
CASES = [
    ("--num-threads", ["--num-threads", "0"]),
    ("--num-threads", ["--num-threads", "-1"]),
    ("--num-threads", ["--num-threads", str((os.cpu_count() or 1) + 1)]),
    ("--num-threads", ["--num-threads", "1.5"]),
    ("--max-body-bytes", ["--max-body-bytes", "0"]),
    ("--max-body-bytes", ["--max-body-bytes", "-5"]),
    ("--body-timeout", ["--body-timeout", "0"]),
    ("--body-timeout", ["--body-timeout", "nan"]),
    ("--header-timeout", ["--header-timeout", "0"]),
    ("--reload-timeout", ["--reload-timeout", "inf"]),
    ("--weight-sync-timeout", ["--weight-sync-timeout", "nan"]),
    ("--weight-sync-timeout", ["--weight-sync-timeout", "1e300"]),  # overflowed a group join's timedelta
    ("--mem-fraction", ["--mem-fraction", "1.5"]),
    ("--schedule-conservativeness", ["--schedule-conservativeness", "-1"]),
    ("--schedule-conservativeness", ["--schedule-conservativeness", "nan"]),
    ("--max-total-tokens", ["--max-total-tokens", "1"]),
    ("--max-total-tokens", ["--max-total-tokens", "7"]),  # started, then refused every prompt (found by review)
    ("--max-batch-tokens", ["--max-batch-tokens", "0"]),
    ("--context-length", ["--context-length", "1e30"]),
    ("--max-image-pixels", ["--max-image-pixels", "0"]),
    ("--backup-dir", ["--enable-memory-saver", "--weights-backup", "disk", "--backup-dir", "{file}"]),
    # nothing would be written there (found by review: silently unused, the weights discarded on a release)
    ("--backup-dir", ["--backup-dir", "{tmp}"]),
    ("--backup-dir", ["--enable-memory-saver", "--weights-backup", "none", "--backup-dir", "{tmp}"]),
    ("--free-memory-override-file", ["--free-memory-override-file", "{tmp}"]),
    ("--fault-drill-file", ["--fault-drill-file", "{tmp}"]),
    ("--allowed-local-media-path", ["--allowed-local-media-path", "{file}"]),
    ("--weight-version", ["--weight-version", " "]),
    ("--served-model-name", ["--served-model-name", ""]),
    ("--role", ["--role", "MIXED"]),
    ("--model-override", ["--model-override", "[]"]),
    ("--model-override", ["--model-override", '{"rope_theta": "x"}']),  # a TypeError traceback (found by review)
    ("--model-override", ["--model-override", '{"num_layers": true}']),  # taken for 1 layer
    ("--device", ["--device", "CUDA"]),
    ("--host", ["--host", ""]),
    ("--port-file", ["--port-file", "{tmp}"]),
    ("--max-connections", ["--max-connections", "0"]),
    ("--max-buffered-body-bytes", ["--max-buffered-body-bytes", "0"]),
    ("--max-buffered-body-bytes", ["--max-body-bytes", "2048", "--max-buffered-body-bytes", "1024"]),
    # review G: each below was a traceback (exit 1), or an engine that started and then failed
    ("--max-running-requests", ["--max-running-requests", "99999999999999"]),  # its request table: no memory
    ("--max-running-requests", ["--max-running-requests", "99999999999999999999999"]),
    ("--max-total-tokens", ["--max-total-tokens", "99999999999999"]),  # the KV pool: no memory
    ("--seed", ["--seed", "99999999999999999999999"]),  # past torch's 64 bits
    ("--memory-budget-mb", ["--memory-budget-mb", "99999999999999999999999"]),
    ("--model-override", ["--model-override", '{"max_position_embeddings": 1}']),  # served, refused every prompt
    ("--allowed-local-media-path", ["--allowed-local-media-path", ""]),  # Path(""): the current folder
    ("--port-file", ["--port-file", "/proc/handoff-review-port"]),  # written after the load, and it cannot be
    # review G: refused, in a line that did not name the flag ("/x/config.json is missing")
    ("--model-path", ["--model-path", "{tmp}"]),
    ("--model-path", ["--model-path", "builtin:huge"]),
    ("--model-override", ["--model-override", '{"hidden_size": -1}']),
]


@pytest.fixture(scope="module")
def engine_runner() -> Iterator[RefusalRunner]:
    yield from refusal_runner("node_engine")


@pytest.mark.parametrize(("flag", "args"), CASES, ids=[" ".join(c[1]) for c in CASES])
def test_a_bad_flag_value_stops_the_engine_naming_the_flag(flag: str, args: list[str], tmp_path: Path,
                                                           engine_runner: RefusalRunner) -> None:
    file = tmp_path / "file"
    file.write_text("x")
    values = (a.replace("{tmp}", str(tmp_path)).replace("{file}", str(file)) for a in args)
    stderr = assert_refused_at_start(["node_engine", "--model-path", "builtin:tiny", "--port", "0", *values], flag,
                                     runner=engine_runner)
    assert "loaded in" not in stderr, stderr  # refused before the model loads (minutes for a real one)


def test_python_m_node_engine_itself_refuses_a_bad_flag_value(tmp_path: Path) -> None:
    """The table runs in forks of one process (tests/support/refusal_runner.py); the entry point itself, in a fresh
    interpreter, refuses as they do: in its flags, and past the model's build (torch imported)."""
    for values, flag in ((["--max-body-bytes", "0"], "--max-body-bytes"),
                         (["--max-total-tokens", "99999999999999"], "--max-total-tokens")):
        stderr = assert_refused_at_start(["node_engine", "--model-path", "builtin:tiny", "--port", "0", *values], flag)
        assert "loaded in" not in stderr, stderr


def test_a_memory_budget_past_the_containers_limit_is_refused(tmp_path: Path, monkeypatch, capsys) -> None:
    """In a container whose memory cgroup allows 1 GiB on a larger machine, ``--memory-budget-mb 2048`` was taken
    (only the machine's memory bounded it): the sizer filled the budget, and touching the pool's pages past the
    limit got the process killed by the cgroup's OOM killer, no message, a restart loop. The bound is the memory
    this process may hold, the cgroup's limit included (read here from a cgroup v2 tree made for the test)."""
    import node_engine.__main__ as engine_main
    from node_engine.memory import cgroup_memory

    root = tmp_path / "cgroup"
    root.mkdir()
    (root / "cgroup.controllers").write_text("memory\n")
    (root / "memory.max").write_text(f"{2**30}\n")
    (root / "memory.current").write_text(f"{100 * 2**20}\n")
    (root / "memory.stat").write_text("file 0\nshmem 0\n")
    proc_cgroup = tmp_path / "proc-cgroup"
    proc_cgroup.write_text("0::/\n")
    assert cgroup_memory.host_memory(root, proc_cgroup).total_bytes == 2**30  # the machine here has more
    monkeypatch.setattr(engine_main, "host_memory", lambda: cgroup_memory.host_memory(root, proc_cgroup),
                        raising=False)
    assert engine_main.parse_args(["--model-path", "builtin:tiny", "--memory-budget-mb", "1000"]).memory_budget_mb \
        == 1000
    with pytest.raises(SystemExit) as exit_info:
        engine_main.parse_args(["--model-path", "builtin:tiny", "--memory-budget-mb", "2048"])
    assert exit_info.value.code == 2
    assert "--memory-budget-mb" in capsys.readouterr().err


@pytest.mark.timeout(120)
def test_a_port_in_use_stops_the_engine_before_the_model_loads() -> None:
    """``--port`` taken by another process: the engine loaded its model first (minutes, and the device memory, for
    a real one) and only then found it could not listen, exit 2 (found by review). The port is now bound before
    the model loads; the engine listens on it once it serves."""
    import socket

    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        stderr = assert_refused_at_start(["node_engine", "--model-path", "builtin:tiny", "--host", "127.0.0.1",
                                          "--port", str(port)], f"127.0.0.1:{port}")
    assert "cannot listen on" in stderr and "loaded in" not in stderr, stderr
