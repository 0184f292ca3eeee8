"""What a foreign engine holds, measured from outside it (vLLM and SGLang do not report freed bytes).

- A CPU engine: the resident set of the engine's processes, found as the
  process listening on the engine's port and all its children (vLLM runs its
  engine core and workers as child processes).
- A GPU engine: the free memory of the devices the sidecar sees (NVML; those in
  ``CUDA_VISIBLE_DEVICES`` when it is set), when ``pynvml`` is installed.

Either may be impossible where the sidecar runs (another PID namespace, no GPU
visible): then nothing is reported rather than a guess.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from urllib.parse import urlsplit

import psutil

log = logging.getLogger(__name__)

PROCESS_RSS = "process_rss"
DEVICE_FREE = "device_free"


@dataclass(frozen=True)
class Reading:
    """One measurement: ``used_bytes`` (what the engine holds: resident set, or device memory in use) by
    ``source`` (:data:`PROCESS_RSS` or :data:`DEVICE_FREE`)."""

    used_bytes: int
    source: str


def freed(before: Reading | None, after: Reading | None) -> tuple[int, str] | None:
    """Bytes given back between two readings of the same source (negative if usage grew), or None."""
    if before is None or after is None or before.source != after.source:
        return None
    return before.used_bytes - after.used_bytes, before.source


class EngineMemory:
    def __init__(self, engine_url: str) -> None:
        self._port = urlsplit(engine_url).port
        self._root: psutil.Process | None = None

    def read(self, device: str) -> Reading | None:
        """The engine's memory now, on ``device`` (``cpu``, else a GPU); None if it cannot be measured here."""
        try:
            return self._read_rss() if device == "cpu" else _read_device()
        except (psutil.Error, OSError) as exc:
            log.warning("cannot measure the engine's memory: %s", exc)
            return None

    def engine_pids(self) -> list[int]:
        root = self._engine_process()
        return [] if root is None else [root.pid, *(child.pid for child in root.children(recursive=True))]

    def _read_rss(self) -> Reading | None:
        root = self._engine_process()
        if root is None:
            return None
        processes = [root, *root.children(recursive=True)]
        total = 0
        for process in processes:
            try:
                total += process.memory_info().rss
            except psutil.NoSuchProcess:
                continue  # a worker that exited between the listing and the reading
        return Reading(total, PROCESS_RSS)

    def _engine_process(self) -> psutil.Process | None:
        if self._root is not None and self._root.is_running():
            return self._root
        self._root = None
        if self._port is None:
            return None
        for conn in psutil.net_connections(kind="tcp"):
            if conn.status == psutil.CONN_LISTEN and conn.laddr and conn.laddr.port == self._port and conn.pid:
                self._root = psutil.Process(conn.pid)
                return self._root
        return None


def _read_device() -> Reading | None:
    try:
        import pynvml  # optional: nvidia-ml-py
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return None
    try:
        wanted = os.environ.get("CUDA_VISIBLE_DEVICES")
        names = [n.strip() for n in wanted.split(",")] if wanted else None
        used = 0
        found: set[str] = set()
        for index in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            uuid = str(pynvml.nvmlDeviceGetUUID(handle))
            named = None if names is None else [n for n in names if _names_device(n, index, uuid)]
            if named is not None and not named:
                continue
            found.update(named or ())
            used += int(pynvml.nvmlDeviceGetMemoryInfo(handle).used)
        if names is not None and found != set(names):
            return None  # a device named that NVML does not list so (a MIG instance): not measured, not 0
        return Reading(used, DEVICE_FREE)
    except pynvml.NVMLError:
        return None
    finally:
        pynvml.nvmlShutdown()


def _names_device(name: str, index: int, uuid: str) -> bool:
    """Whether ``CUDA_VISIBLE_DEVICES``'s ``name`` is this device: its index, its UUID, or a prefix of its UUID
    (``GPU-8932f937``, as CUDA takes)."""
    return name == str(index) or (name.startswith("GPU-") and uuid.startswith(name))
