"""The KV pool's size at start: pinned or a CPU default, else sized from measured peaks.

``--max-total-tokens`` pins the size, and a CPU engine without
``--memory-budget-mb`` takes :data:`~node_engine.config.DEFAULT_CPU_MAX_TOTAL_TOKENS`;
every other engine runs the sizer of ``kv_sizing.py`` (probe, target,
validation, shrink and retry) on the runner, and a failed sizing is a start
error that names every knob with the measured numbers.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

import torch

from node_engine.config import DEFAULT_CPU_MAX_TOTAL_TOKENS, MIN_REQUEST_ROOM_TOKENS, EngineConfig
from node_engine.kv_sizing import DeviceBudget, HostBudget, KVPoolSizer, KVSizingError, MemoryBudget, SizingReport
from node_engine.memory.peak import CudaPeakMeter, HostPeakMeter, PeakUnavailable
from node_engine.memory.tags import MemoryTag

if TYPE_CHECKING:
    from node_engine.runner import ModelRunner

MiB = 2**20


@dataclass(frozen=True)
class KVPlan:
    """The KV pool as sized at start (a run-time result, not configuration)."""

    num_slots: int
    bytes_per_slot: int
    context_len: int

    @property
    def num_bytes(self) -> int:
        return self.num_slots * self.bytes_per_slot


@dataclass
class SizedPool:
    """A pool the sizer chose, zeroed, with how it was chosen and what the stresses left allocated for good."""

    pool: torch.Tensor
    report: SizingReport
    outside_tags: dict[str, int] = field(default_factory=dict)


def sizes_from_peaks(config: EngineConfig) -> bool:
    """Pinned (``--max-total-tokens``) or a CPU engine without a budget: a fixed size, no profiling."""
    return config.max_total_tokens is None and (config.device == "cuda" or config.memory_budget_mb is not None)


def fixed_num_slots(config: EngineConfig) -> int:
    return config.max_total_tokens if config.max_total_tokens is not None else DEFAULT_CPU_MAX_TOTAL_TOKENS


def min_sized_slots(config: EngineConfig, context_len: int) -> int:
    """The least pool the sizer takes, the padding slot included: one full prefill chunk, and never less than
    ``--max-total-tokens``' own floor (the least pool that takes a one-token prompt: below it SGLang's
    ``max_req_input_len``, the pool less 6, refuses every prompt, and the engine would be up for nothing)."""
    return max(min(config.max_batch_tokens, context_len), MIN_REQUEST_ROOM_TOKENS) + 1


def size_from_peaks(runner: ModelRunner, allocate: Callable[[str, int], torch.Tensor] | None) -> SizedPool:
    """Run the sizer on ``runner`` (its weights and workspace already allocated); raises :class:`KVSizingError`
    with :func:`sizing_error`'s message."""
    config, device = runner.config, runner.device
    if device.type == "cuda":
        meter = CudaPeakMeter()
        budget: MemoryBudget = DeviceBudget(config.mem_fraction)
    else:
        meter = HostPeakMeter()
        budget = HostBudget(config.memory_budget_mb * MiB, meter)
    min_slots = min_sized_slots(config, runner.context_len)
    sizer = KVPoolSizer(runner, budget, meter, device=device, min_slots=min_slots, probe_slots=min_slots,
                        allocate=allocate)
    allocated_before = torch.cuda.memory_allocated() if device.type == "cuda" else 0
    try:
        pool = sizer.run()
    except KVSizingError:
        raise KVSizingError(sizing_error(runner, sizer.report, budget)) from None
    except PeakUnavailable as exc:  # no peak to size from (a read-only /proc, gVisor): name what works instead
        raise KVSizingError(f"{budget.describe()} sizes the KV pool from the process's measured peak memory, which "
                            f"this system cannot measure ({exc}); pin the pool with --max-total-tokens instead") \
            from None
    pool.zero_()  # the stresses wrote garbage into it
    sized = SizedPool(pool, sizer.report)
    if device.type == "cuda":  # what the first forwards left allocated for good: cuBLAS's workspaces
        torch.cuda.synchronize()
        sized.outside_tags["cublas_workspace_main_stream"] = max(
            0, torch.cuda.memory_allocated() - allocated_before - pool.nbytes)
    return sized


def sizing_error(runner: ModelRunner, report: SizingReport, budget: MemoryBudget) -> str:
    """Why no pool fits, with every number measured and every knob that would change it."""
    config, vision = runner.config, runner.vision
    weights = runner.saver.tag_bytes(MemoryTag.WEIGHTS)
    workspace = runner.saver.tag_bytes(MemoryTag.WORKSPACE)
    reservation = vision.reservation.num_bytes if vision and vision.reservation else 0
    left = report.free_bytes - report.activation_peak_bytes - report.canary_bytes
    vision_part = ""
    if vision is not None:
        vision_part = (f" of which the vision reservation {reservation / MiB:.1f} MiB for --max-image-tokens "
                       f"{vision.max_image_tokens} and --visual-batch-max-tokens {vision.visual_budget}")
    attempts = "; ".join(f"{a.num_slots} slots: {a.outcome}" for a in report.attempts)
    knobs = "--max-batch-tokens, --max-running-requests, --context-length"
    knobs += ", --max-image-tokens or --visual-batch-max-tokens" if vision is not None else " or the model"
    return (f"no KV pool fits {budget.describe()}: the engine holds {report.held_bytes / MiB:.1f} MiB before "
            f"the pool (weights {weights / MiB:.1f} MiB, workspace {workspace / MiB:.1f} MiB{vision_part}, the "
            f"process itself); the activation peak measured at "
            f"--max-batch-tokens {config.max_batch_tokens} and --max-running-requests "
            f"{config.max_running_requests} ({runner.context_len}-token context) is "
            f"{report.activation_peak_bytes / MiB:.1f} MiB and the canary {report.canary_bytes / MiB:.0f} MiB; "
            f"{report.free_bytes / MiB:.1f} MiB were free, leaving {max(0, left) / MiB:.1f} MiB for the pool "
            f"({max(0, left) // report.bytes_per_slot} slots of {report.bytes_per_slot} bytes; at least "
            f"{min_sized_slots(config, runner.context_len)} needed). Attempts: {attempts or 'none'}. "
            f"Give the engine more memory, lower {knobs}, or pin --max-total-tokens (no sizing).")
