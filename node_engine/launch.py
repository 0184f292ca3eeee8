"""Process set-up before the engine is built: the preload hook for the CUDA memory saver.

torch_memory_saver's preload hook mode needs its library in ``LD_PRELOAD``
before CUDA initializes. Rather than asking the user for that, the engine
re-executes itself once with the variable set; ``HANDOFF_TMS_PRELOADED``
marks the second run.
"""

from __future__ import annotations

import logging
import os
import sys

log = logging.getLogger(__name__)

_MARKER = "HANDOFF_TMS_PRELOADED"


def ensure_memory_saver_preload(argv: list[str]) -> None:
    """Re-exec with torch_memory_saver's preload library unless it is already loaded. Never returns on re-exec."""
    if "torch_memory_saver" in os.environ.get("LD_PRELOAD", ""):
        return
    if os.environ.get(_MARKER):
        raise RuntimeError("LD_PRELOAD lost torch_memory_saver after re-exec; set it by hand")
    try:
        from torch_memory_saver import configure_subprocess
    except ImportError as exc:
        raise RuntimeError("--enable-memory-saver on CUDA needs torch_memory_saver: pip install 'handoff[gpu]'") \
            from exc
    with configure_subprocess():
        env = dict(os.environ)
    env[_MARKER] = "1"
    log.info("re-executing with torch_memory_saver preloaded")
    os.execve(sys.executable, [sys.executable, "-m", "node_engine", *argv], env)
