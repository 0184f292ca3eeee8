"""The measure of a GPU engine's memory (:mod:`node_sidecar.engines.measure`) against a fake NVML: the devices
``CUDA_VISIBLE_DEVICES`` names are summed, and a reading that finds none of them is no reading."""

from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest

from node_sidecar.engines.measure import DEVICE_FREE, EngineMemory


def fake_nvml(used: list[int]) -> SimpleNamespace:
    class NVMLError(Exception):
        pass

    return SimpleNamespace(
        NVMLError=NVMLError, nvmlInit=lambda: None, nvmlShutdown=lambda: None,
        nvmlDeviceGetCount=lambda: len(used), nvmlDeviceGetHandleByIndex=lambda i: i,
        nvmlDeviceGetUUID=lambda i: f"GPU-{i}aaaaaaa-bbbb-cccc-dddd-eeeeeeeeeeee",
        nvmlDeviceGetMemoryInfo=lambda i: SimpleNamespace(used=used[i]))


def test_visible_devices_are_summed_and_none_found_is_no_reading(monkeypatch: pytest.MonkeyPatch) -> None:
    """Devices ``CUDA_VISIBLE_DEVICES`` names in a way NVML does not list (a MIG instance's ``MIG-`` UUID, a
    UUID's prefix, as CUDA takes) were left out: a reading of 0 bytes (or of the others alone), so a release
    reported ``bytes_freed`` 0 "measured by device_free" for gigabytes freed (found by review). A prefix names its
    device now, and a name that finds none is no reading."""
    monkeypatch.setitem(sys.modules, "pynvml", fake_nvml([10, 20, 40]))
    memory = EngineMemory("http://127.0.0.1:9")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,2")
    reading = memory.read("cuda")
    assert reading is not None and reading.used_bytes == 50 and reading.source == DEVICE_FREE
    for names in ("GPU-1aaaaaaa-bbbb-cccc-dddd-eeeeeeeeeeee", "GPU-1aaaaaaa"):  # a UUID, or its prefix
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", names)
        assert memory.read("cuda").used_bytes == 20  # type: ignore[union-attr]
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert memory.read("cuda").used_bytes == 70  # type: ignore[union-attr]
    for names in ("MIG-5c1ed2d4-6d4a-5d8b-9b0b-5e0e2b3a5f3e", "7", "0,MIG-5c1ed2d4"):
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", names)
        assert memory.read("cuda") is None, names
