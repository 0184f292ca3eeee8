"""Ctrl-C in ``handoff demo``: one held back while torch is imported, and a later one that kills the cluster."""

from __future__ import annotations

import contextlib
import signal
import threading
from typing import TYPE_CHECKING, Iterator

if TYPE_CHECKING:
    from handoff.cluster.local import LocalCluster

__all__ = ["ctrl_c_held_back", "kill_on_later_ctrl_c"]


@contextlib.contextmanager
def ctrl_c_held_back() -> Iterator[None]:
    """A Ctrl-C during the block is a KeyboardInterrupt once the block is done. For torch's import: raised inside
    its C++ parts it was lost (their import of numpy takes any exception for a failed import and goes on: the demo
    played on, or failed on a half-made numpy) or aborted the process (SIGABRT, from a pybind11 callback)."""
    if (threading.current_thread() is not threading.main_thread()  # where Python takes no signal
            or signal.getsignal(signal.SIGINT) is not signal.default_int_handler):  # ignored, or taken over
        yield
        return
    caught: list[int] = []
    signal.signal(signal.SIGINT, lambda signum, _frame: caught.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if caught:
        raise KeyboardInterrupt


def kill_on_later_ctrl_c(cluster: LocalCluster) -> None:
    """From the first Ctrl-C on, a further one kills the cluster's processes (the graceful stop waits up to 10 s
    for each) instead of raising KeyboardInterrupt inside that stop, which ended it there: a process slow to end was
    left to its parent-death signal. Set for the rest of the process: it is on its way out."""
    def on_sigint(_signum: int, _frame: object) -> None:
        cluster.kill(wait=False)

    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:
        signal.signal(signal.SIGINT, on_sigint)
