"""How the engine fails: which errors of a step it survives, how the process ends when it cannot, and a drill.

A step that raises fails the requests of that step and the engine goes on,
unless the error leaves the device unusable (:func:`leaves_device_unusable`):
then every request and control call still waiting is answered and the
process exits with :data:`EXIT_ENGINE_FAILED`, so its sidecar reports
``engine_unavailable`` and a supervisor restarts it. An out-of-memory is not
fatal: the step's activations are freed with the exception.

:class:`FaultDrill` (``--fault-drill-file``) is for tests and fault drills
only: it makes a chosen step or control call fail as a device would.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

import torch

log = logging.getLogger(__name__)

EXIT_ENGINE_FAILED = 3  # 1 is Python's own for an uncaught error, 2 a configuration error
FATAL_EXIT_GRACE_S = 1.0  # time the event loop has to write the last answers before the process exits

# Messages of errors raised as a plain RuntimeError by CUDA libraries (cuBLAS, cuDNN, NCCL) and older paths.
_DEVICE_ERROR_MARKERS = ("CUDA error", "CUBLAS_STATUS", "CUDNN_STATUS", "cuDNN error", "NCCL error",
                         "device-side assert")


class DeviceFailed(RuntimeError):
    """A step raised an error that leaves the device unusable; the engine thread stops."""


_ACCELERATOR_ERROR: type[Exception] | None = getattr(torch, "AcceleratorError", None)  # torch >= 2.8


def leaves_device_unusable(exc: BaseException) -> bool:
    """Whether ``exc`` from a step means the device (and so this process) cannot be trusted any more.

    An out-of-memory is survivable; a CUDA error is not (an illegal address, a
    device-side assert, an ECC error leave the context broken for good). Any
    other exception (a bug hit by one batch) fails the step and the engine goes on.
    """
    if isinstance(exc, torch.OutOfMemoryError) or "out of memory" in str(exc):
        return False
    if _ACCELERATOR_ERROR is not None and isinstance(exc, _ACCELERATOR_ERROR):
        return True
    message = str(exc)
    return isinstance(exc, RuntimeError) and any(marker in message for marker in _DEVICE_ERROR_MARKERS)


def exit_process(exc: BaseException) -> None:
    """End the engine process after a fatal error (called on the engine thread, after every answer was sent).

    ``os._exit``: no interpreter teardown, which could block on a broken device.
    """
    log.critical("the engine cannot go on (%s: %s); exiting with code %d so that it is restarted",
                 type(exc).__name__, exc, EXIT_ENGINE_FAILED)
    time.sleep(FATAL_EXIT_GRACE_S)
    logging.shutdown()
    os._exit(EXIT_ENGINE_FAILED)


class FaultDrill:
    """A one-shot fault armed by writing JSON to a file; a drill and test hook, never for production.

    ``{"kind": K, "at": A, "delay_s": S}``: the next operation matching ``at``
    (``prefill``, ``decode``, ``step`` for either, ``release``, ``resume``, ``read``
    for a checkpoint file read) waits ``S`` seconds (default 0) and then fails with ``K``:

    - ``oom``: ``torch.OutOfMemoryError``, as a device out of memory raises;
    - ``error``: a ``RuntimeError`` (a bug hit by one batch);
    - ``fatal``: ``torch.AcceleratorError``, a CUDA error that leaves the device unusable;
    - ``exit``: the process exits with code 1 at once, as torch_memory_saver does on a failed resume;
    - ``stall``: nothing fails, the operation goes on after the wait (a hung network mount that comes back).

    When it fires, the file is renamed to ``<file>.fired`` (a test waits for that
    before queueing work behind a delayed fault).
    """

    KINDS = ("oom", "error", "fatal", "exit", "stall")
    POINTS = ("prefill", "decode", "step", "release", "resume", "read")

    def __init__(self, path: Path) -> None:
        self.path = path

    def fire(self, point: str) -> None:
        """Raise the fault armed for ``point``, if one is."""
        if not self.path.exists():  # the common case: one stat
            return
        try:
            fault = json.loads(self.path.read_text())
        except (OSError, ValueError) as exc:
            log.warning("fault drill: ignoring %s: %s", self.path, exc)
            return
        at = fault.get("at", "step")
        if not (at == point or (at == "step" and point in ("prefill", "decode"))):
            return
        kind = fault.get("kind")
        if kind not in self.KINDS:
            log.warning("fault drill: unknown kind %r in %s (known: %s)", kind, self.path, ", ".join(self.KINDS))
            return
        try:
            os.replace(self.path, self.path.with_name(self.path.name + ".fired"))
        except FileNotFoundError:
            return  # another thread (a parallel read's slice) fired it first: a fault fires once
        log.warning("fault drill: %s at %s", kind, point)
        time.sleep(float(fault.get("delay_s", 0)))
        if kind == "stall":
            return
        message = f"{kind} injected at {point} by the fault drill"
        if kind == "exit":
            logging.shutdown()
            os._exit(1)
        if kind == "oom":
            raise torch.OutOfMemoryError(f"CUDA out of memory ({message})")
        if kind == "fatal":
            raise (_ACCELERATOR_ERROR or RuntimeError)(
                f"CUDA error: an illegal memory access was encountered ({message})")
        raise RuntimeError(message)


def is_out_of_memory(exc: BaseException) -> bool:
    """An allocation the host or the device refused: Python's MemoryError, torch's device out of memory, torch's
    CPU allocator ("DefaultCPUAllocator: can't allocate memory", a plain RuntimeError), or CUDA's own refusal
    raised as a plain RuntimeError (a pinned-host or device allocation: "CUDA error: out of memory", "CUDA out of
    memory")."""
    if isinstance(exc, (MemoryError, torch.OutOfMemoryError)):
        return True
    text = str(exc)
    return any(marker in text for marker in _OUT_OF_MEMORY_TEXTS)


_OUT_OF_MEMORY_TEXTS = ("can't allocate memory", "CUDA error: out of memory", "CUDA out of memory")
