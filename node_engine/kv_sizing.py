"""The KV pool sized from measured peaks, not from a guessed fraction.

1. **Probe.** A small pool, a real prefill stress (one chunk of
   ``--max-batch-tokens`` at the end of the context) and a decode stress (the
   maximum batch, every sequence as long as the context): the measured peak
   above what was held before is the *activation peak*.
2. **Target.** The free memory left (CUDA: the device's free memory times
   ``--mem-fraction``; CPU: ``--memory-budget-mb`` minus the process's
   resident memory) minus the activation peak minus a 256 MiB canary, in slots.
3. **Validate.** Allocate the pool and the canary, run the stresses again on
   the real pool, check the peak (CPU: the process's peak RSS must stay within
   the budget; CUDA: the allocator must not fail). Success frees the canary:
   its 256 MiB stay as headroom.
4. **Shrink and retry.** On a failed allocation or an exceeded budget, 5% less,
   at most 3 retries; then a start error naming every knob with the numbers.
   A probe that runs out of memory is that start error at once.

The sizer only orchestrates: the runner allocates the pool and runs the
stresses (``SizingTarget``); ``allocate`` is injectable so tests can make an
allocation fail.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Callable, Protocol

import torch

from node_engine.config import ConfigError
from node_engine.failures import is_out_of_memory
from node_engine.memory.host_heap import trim_host_heap
from node_engine.memory.peak import PeakMeter

log = logging.getLogger(__name__)

CANARY_BYTES = 256 * 2**20
SHRINK_FACTOR = 0.95
MAX_RETRIES = 3
MiB = 2**20


class AllocationFailed(RuntimeError):
    """A pool, a canary or a stress did not fit (an allocator error, or a peak over the budget)."""


class KVSizingError(ConfigError):
    """The engine cannot start: no KV pool fits. The message names every knob and the measured numbers."""


class SizingTarget(Protocol):
    """What the sizer needs from the runner."""

    bytes_per_slot: int

    def allocate_pool(self, num_slots: int) -> torch.Tensor: ...

    def bind_pool(self, pool: torch.Tensor | None) -> None: ...

    def stress(self, num_slots: int) -> None: ...


class MemoryBudget(Protocol):
    def free_bytes(self) -> int:
        """Bytes the engine may still take."""

    def check_peak(self, meter: PeakMeter) -> None:
        """Raise :class:`AllocationFailed` if the peak since the meter's reset went over the budget."""

    def describe(self) -> str: ...


@dataclass(frozen=True)
class HostBudget:
    """CPU: ``--memory-budget-mb`` bounds the engine process's resident memory."""

    budget_bytes: int
    meter: PeakMeter

    def free_bytes(self) -> int:
        return self.budget_bytes - self.meter.current_bytes()

    def check_peak(self, meter: PeakMeter) -> None:
        peak = meter.peak_bytes()
        if peak > self.budget_bytes:
            raise AllocationFailed(f"peak resident memory {peak / MiB:.1f} MiB is over the budget "
                                   f"({self.budget_bytes / MiB:.1f} MiB)")

    def describe(self) -> str:
        return f"the memory budget (--memory-budget-mb {self.budget_bytes // MiB})"


@dataclass(frozen=True)
class DeviceBudget:
    """CUDA: a share (``--mem-fraction``) of the device's free memory."""

    mem_fraction: float

    def free_bytes(self) -> int:
        free, _ = torch.cuda.mem_get_info()
        return int(free * self.mem_fraction)

    def check_peak(self, meter: PeakMeter) -> None:
        pass  # the device refuses what does not fit: an allocation error, caught as a failure

    def describe(self) -> str:
        return f"--mem-fraction {self.mem_fraction} of the device's free memory"


@dataclass
class SizingAttempt:
    num_slots: int
    outcome: str  # "ok", or why it failed


@dataclass
class SizingReport:
    bytes_per_slot: int
    probe_slots: int
    held_bytes: int = 0             # in use before the pool (process, weights, workspace, vision reservation)
    free_bytes: int = 0             # what the budget left after the probe
    activation_peak_bytes: int = 0  # the probe's measured peak above what was held
    canary_bytes: int = CANARY_BYTES
    target_slots: int = 0
    attempts: list[SizingAttempt] = field(default_factory=list)

    @property
    def num_slots(self) -> int:
        return self.attempts[-1].num_slots if self.attempts and self.attempts[-1].outcome == "ok" else 0


def _is_out_of_memory(exc: BaseException) -> bool:
    return isinstance(exc, AllocationFailed) or is_out_of_memory(exc)


def _default_canary(device: torch.device) -> torch.Tensor:
    return torch.zeros(CANARY_BYTES, dtype=torch.uint8, device=device)  # zeros: the pages are really taken


class KVPoolSizer:
    def __init__(self, target: SizingTarget, budget: MemoryBudget, meter: PeakMeter, *, device: torch.device,
                 min_slots: int, probe_slots: int,
                 allocate: Callable[[str, int], torch.Tensor] | None = None) -> None:
        self.target = target
        self.budget = budget
        self.meter = meter
        self.device = device
        self.min_slots = min_slots
        self.probe_slots = probe_slots
        self.allocate = allocate or self._allocate
        self.report = SizingReport(bytes_per_slot=target.bytes_per_slot, probe_slots=probe_slots)

    def _allocate(self, kind: str, num: int) -> torch.Tensor:
        """``kind`` "pool": ``num`` slots; "canary": ``num`` bytes."""
        return self.target.allocate_pool(num) if kind == "pool" else _default_canary(self.device)

    def run(self) -> torch.Tensor:
        """The validated pool (bound to the model), sized as described in the module docstring."""
        report = self.report
        report.held_bytes = self.meter.current_bytes()
        try:
            report.activation_peak_bytes = self._probe()
        except BaseException as exc:  # the probe's pool or stresses did not fit: a start error, not a traceback
            if not _is_out_of_memory(exc):
                raise
            failure = (str(exc).splitlines() or [type(exc).__name__])[0][:200]
        else:
            failure = None
        if failure is not None:
            self._give_back()
            report.attempts.append(SizingAttempt(self.probe_slots, f"the probe's stresses failed: {failure}"))
            raise KVSizingError("no KV pool fits")  # the runner rewrites the message with every knob
        report.free_bytes = self.budget.free_bytes()
        kv_bytes = report.free_bytes - report.activation_peak_bytes - report.canary_bytes
        report.target_slots = max(0, kv_bytes // report.bytes_per_slot)
        for _ in range(1 + MAX_RETRIES):
            num_slots = max(0, kv_bytes // report.bytes_per_slot)
            if num_slots < self.min_slots:
                report.attempts.append(SizingAttempt(num_slots, f"below the minimum of {self.min_slots} slots"))
                break
            pool = self._validated(num_slots)
            if pool is not None:
                log.info("KV pool sized from measured peaks: %d slots (%.1f MiB); activation peak %.1f MiB, "
                         "%d attempt(s)", num_slots, num_slots * report.bytes_per_slot / MiB,
                         report.activation_peak_bytes / MiB, len(report.attempts))
                return pool
            kv_bytes = int(kv_bytes * SHRINK_FACTOR)
        raise KVSizingError("no KV pool fits")  # the runner rewrites the message with every knob

    def _probe(self) -> int:
        pool = self.allocate("pool", self.probe_slots)
        try:
            self.target.bind_pool(pool)
            self.meter.reset()
            before = self.meter.current_bytes()
            self.target.stress(self.probe_slots)
            return max(0, self.meter.peak_bytes() - before)
        finally:
            self.target.bind_pool(None)
            del pool
            self._give_back()

    def _validated(self, num_slots: int) -> torch.Tensor | None:
        pool = canary = None
        failure: str | None = None
        try:
            pool = self.allocate("pool", num_slots)
            canary = self.allocate("canary", self.report.canary_bytes)
            self.target.bind_pool(pool)
            self.meter.reset()
            self.target.stress(num_slots)
            self.budget.check_peak(self.meter)
        except BaseException as exc:  # only allocation failures are retried; anything else propagates
            if not _is_out_of_memory(exc):
                raise
            failure = (str(exc).splitlines() or [type(exc).__name__])[0][:200]
        # Outside the handler: the exception's frames (and the tensors they hold) are gone by now.
        canary = None
        if failure is not None:
            self.target.bind_pool(None)
            pool = None
        self._give_back()
        self.report.attempts.append(SizingAttempt(num_slots, failure or "ok"))
        return pool

    def _give_back(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        else:
            trim_host_heap()
