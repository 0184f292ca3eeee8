"""Process set-up before the engine is built: the preload hook for the CUDA memory saver.

torch_memory_saver's preload hook mode needs its library in ``LD_PRELOAD``
before CUDA initializes. Rather than asking the user for that, the engine
re-executes itself once with the variable set; ``HANDOFF_TMS_PRELOADED``
marks the second run. The re-executed process also gets:

- ``LD_LIBRARY_PATH`` with the ``nvidia/*/lib`` folders of the pip-installed
  CUDA wheels first: the preload library needs ``libcudart.so.12`` (or 13) and
  has no RPATH, and a pip-installed torch keeps that library there, where the
  loader does not look. Without it the new process dies in the loader (exit
  127) before Python starts.
- ``TMS_RETAIN_CPU_BACKUP=1``: the pinned CPU backup of the weights is kept
  across cycles instead of being freed on every resume and allocated again on
  every release (``memory/saver_cuda.py`` sets the same policy and checks it).

The environment is tried first in a throwaway ``python -c pass``: a preload
that cannot load is a clear start error naming the loader's message, not an
engine that vanishes with exit code 127.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Mapping

log = logging.getLogger(__name__)

_MARKER = "HANDOFF_TMS_PRELOADED"
PRELOAD_PROBE_TIMEOUT_S = 60.0


class StartError(RuntimeError):
    """The engine cannot start as configured; the message says why and what to do."""


def cuda_library_dirs() -> list[str]:
    """The ``lib`` folders of the CUDA wheels torch was installed with (``site-packages/nvidia/*/lib``).

    ``nvidia`` is a namespace package: every folder of it on ``sys.path`` counts.
    """
    spec = importlib.util.find_spec("nvidia")
    roots = list(spec.submodule_search_locations or []) if spec is not None else []
    return sorted({str(lib) for root in roots for lib in Path(root).glob("*/lib") if lib.is_dir()})


def preload_environment(environ: Mapping[str, str], ld_preload: str, library_dirs: list[str]) -> dict[str, str]:
    """The environment of the re-executed engine: ``ld_preload``, the CUDA wheels' libraries first on
    ``LD_LIBRARY_PATH`` (so the preload library binds the CUDA runtime torch itself uses), retained CPU
    backups, and the marker."""
    env = dict(environ)
    env["LD_PRELOAD"] = ld_preload
    existing = [d for d in env.get("LD_LIBRARY_PATH", "").split(":") if d and d not in library_dirs]
    if library_dirs or existing:
        env["LD_LIBRARY_PATH"] = ":".join(library_dirs + existing)
    env["TMS_RETAIN_CPU_BACKUP"] = "1"
    env[_MARKER] = "1"
    return env


def check_preload(env: Mapping[str, str]) -> None:
    """Start a bare interpreter with ``env``; raise :class:`StartError` if the loader refuses the preload."""
    try:
        probe = subprocess.run([sys.executable, "-c", "pass"], env=dict(env), capture_output=True, text=True,
                               timeout=PRELOAD_PROBE_TIMEOUT_S, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise StartError(f"could not try the memory saver's preload library: {exc}") from exc
    if probe.returncode != 0:
        raise StartError(
            f"--enable-memory-saver on CUDA: the process cannot start with torch_memory_saver's preload library "
            f"(exit {probe.returncode}: {probe.stderr.strip()[-500:] or 'no message'}). LD_PRELOAD="
            f"{env.get('LD_PRELOAD', '')}, LD_LIBRARY_PATH={env.get('LD_LIBRARY_PATH', '')}. The library needs "
            "the CUDA runtime (libcudart) of the CUDA wheels torch came with, and the driver (libcuda.so.1): "
            "install torch with its CUDA wheels in this environment, or put their lib folders on LD_LIBRARY_PATH")


def ensure_memory_saver_preload(argv: list[str]) -> None:
    """Re-exec with torch_memory_saver's preload library unless it is already loaded. Never returns on re-exec.

    Raises :class:`StartError` when that cannot work (no torch_memory_saver, a preload the loader refuses).
    """
    if "torch_memory_saver" in os.environ.get("LD_PRELOAD", ""):
        return
    if os.environ.get(_MARKER):
        raise StartError("LD_PRELOAD lost torch_memory_saver after the re-exec; set LD_PRELOAD by hand")
    try:
        from torch_memory_saver import configure_subprocess
    except ImportError as exc:
        raise StartError("--enable-memory-saver on CUDA needs torch_memory_saver: pip install 'handoff[gpu]'") \
            from exc
    with configure_subprocess():
        ld_preload = os.environ["LD_PRELOAD"]
    env = preload_environment(os.environ, ld_preload, cuda_library_dirs())
    check_preload(env)
    log.info("re-executing with torch_memory_saver preloaded (LD_LIBRARY_PATH=%s)", env.get("LD_LIBRARY_PATH", ""))
    try:
        os.execve(sys.executable, [sys.executable, "-m", "node_engine", *argv], env)
    except OSError as exc:
        raise StartError(f"could not re-execute the engine with the memory saver preloaded: {exc}") from exc
